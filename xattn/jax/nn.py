"""``xattn.jax.dot_product_attention``: a drop-in for ``jax.nn.dot_product_attention`` (and Flax's ``attention_fn``).

Same signature and conventions as ``jax.nn.dot_product_attention``: layout ``[..., T, N, H]``
(``BTNH``, or ``TNH`` without batch), causal and ``local_window_size`` TOP-LEFT aligned (query i
sees key j iff ``j <= i`` / ``i - left <= j <= i + right``), ``query_seq_lengths`` /
``key_value_seq_lengths`` as valid prefixes, the residual as the natural-log logsumexp ``[..., T, N]``.
The kernels are bottom-right aligned (FlashAttention): this module rewrites every top-left mask
into the kernels' form exactly (slicing keys no query can see, shifting windows by ``Nk - Nq``,
varlen segments for key padding). What the kernels cannot run exactly (bias/mask arrays, head dims
without a kernel, fp32, windows the rewrite cannot express) runs on ``jax.nn.dot_product_attention``'s
own XLA implementation, and Flax's dropout / ``sow_weights`` on Flax's own ``dot_product_attention``: the
peer's exact result, with a one-time warning naming the reason. ``strict=True`` (or ``XATTN_STRICT=1``)
raises instead. ``backend="reference"`` computes everything (bias, mask arrays, any lengths) in jnp.

Glossary: B batch (any leading dims, flattened), T / S query / key lengths (Nq / Nk), N / K query /
key-value heads (GQA when N > K), H / Hv head dims.
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from xattn.core import routes
from xattn.core.spec import FA4_HEAD_DIMS, canonical_mask, family_for

from .attention import RESIDUAL_NAMES, Config, backward_call, forward_call, check_dense, resolve_backend, static_scale
from . import split_kv
from .varlen import VarlenConfig, varlen_backward_call, varlen_forward_call

__all__ = ["dot_product_attention"]

_NEG = -0.7 * float(np.finfo(np.float32).max)  # jax.nn's masked logit


# --- arguments ----------------------------------------------------------------------------

def _family(d: int, dv: int) -> str:
    family = family_for(d, dv)
    if family is not None:
        return family
    raise NotImplementedError(f"head dims {d}/{dv}: no xattn kernel (FFPA: 320-512 step 16; FA4: "
                              f"{', '.join(f'{a}/{b}' for a, b in FA4_HEAD_DIMS)}); pass backend='reference'")


def _flatten(query, key, value):
    """``(q, k, v, lead)``: inputs ``[..., T, N, H]`` as ``[B, T, N, H]`` (B = prod(lead), 1 for 3-D)."""
    q, k, v = (jnp.asarray(x) for x in (query, key, value))
    if q.ndim < 3 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"query/key/value: expected equal ranks >= 3 ([..., T, N, H]), got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    lead = q.shape[:-3]
    if k.shape[:-3] != lead or v.shape[:-3] != lead:
        raise ValueError(f"key/value: leading dims {k.shape[:-3]}, {v.shape[:-3]} differ from query's {lead}")
    b = math.prod(lead)  # not -1: a reshape cannot infer it when T, S or B is 0
    q, k, v = (x.reshape(b, *x.shape[-3:]) for x in (q, k, v))
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:  # jax.nn's names, before check_dense's
        raise ValueError(f"key: the number of query heads ({q.shape[2]}) must be a multiple of key/value heads "
                         f"({k.shape[2]})")
    check_dense(q, k, v)
    return q, k, v, lead


def _lengths(x, name: str, lead: tuple, b: int):
    """int32 ``[B]`` valid-prefix lengths (shape ``lead`` or ``[B]``), or None."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.dtype != jnp.int32:
        raise TypeError(f"{name}: expected int32 lengths (as jax.nn), got {x.dtype}")
    if x.shape not in (tuple(lead), (b,)):
        raise ValueError(f"{name}: expected one length per batch row, shape {tuple(lead)} or ({b},); got {x.shape}")
    return x.reshape(b)


def _window(local_window_size):
    """``(left, right)`` ints (an int w means ``(w, w)``), or None."""
    w = local_window_size
    if w is None:
        return None
    is_int = lambda x: isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))  # noqa: E731
    if is_int(w):
        w = (w, w)
    if not (isinstance(w, (tuple, list)) and len(w) == 2 and all(is_int(x) for x in w)):
        raise TypeError(f"local_window_size: expected an int or a (left, right) pair of ints, got {w!r}")
    return int(w[0]), int(w[1])


def _per_head(x, name: str, lead: tuple, n: int, t: int, s: int):
    """A jax.nn bias/mask (broadcastable to ``[..., N, T, S]``) as ``[B, N, T, S]``."""
    x = jnp.asarray(x)
    target = (*lead, n, t, s)
    extra = x.ndim - len(target)
    if extra > 0 and all(d == 1 for d in x.shape[:extra]):
        x = x.reshape(x.shape[extra:])
    try:
        x = jnp.broadcast_to(x, target)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: shape {x.shape} does not broadcast to [..., N, T, S] = {target}") from None
    return x.reshape(-1, n, t, s)


# --- kernels with the logsumexp as a second output -----------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_lse(cfg, q, k, v, *cu):
    """``(out, lse)``; like jax.nn's residual, lse carries no gradient (its cotangent is dropped)."""
    return varlen_forward_call(cfg, q, k, v, *cu) if cu else forward_call(cfg, q, k, v)


def _with_lse_fwd(cfg, q, k, v, *cu):
    out, lse = _with_lse(cfg, q, k, v, *cu)
    res = tuple(checkpoint_name(x, n) for x, n in zip((q, k, v, out, lse), RESIDUAL_NAMES))
    return (out, lse), (res, cu)


def _with_lse_bwd(cfg, res, cts):
    (q, k, v, out, lse), cu = res
    dout = cts[0]
    if cu:
        grads = varlen_backward_call(cfg, dout, q, k, v, out, lse, *cu)
    else:
        grads = backward_call(cfg, dout, q, k, v, out, lse)
    return (*grads, *(None for _ in cu))


_with_lse.defvjp(_with_lse_fwd, _with_lse_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _split_with_lse(cfg, plan, q, k, v, kv_len):
    """``(out, lse)`` of each row's first ``kv_len`` keys by the split-KV forward (:mod:`xattn.jax.split_kv`);
    the backward is the varlen one of the same rows (:func:`_row_segments`) from that out and lse."""
    return split_kv.split_forward(cfg, plan, q, k, v, lengths=kv_len)


def _split_with_lse_fwd(cfg, plan, q, k, v, kv_len):
    out, lse = _split_with_lse(cfg, plan, q, k, v, kv_len)
    return (out, lse), (q, k, v, out, lse, kv_len)


def _split_with_lse_bwd(cfg, plan, res, cts):
    q, k, v, out, lse, kv_len = res
    (b, t, n, _), s = q.shape, k.shape[1]
    flat = lambda x: x.reshape(-1, *x.shape[2:])  # noqa: E731
    grads = varlen_backward_call(VarlenConfig(cfg, t, s), flat(cts[0]), flat(q), flat(k), flat(v), flat(out),
                                 lse.transpose(1, 0, 2).reshape(n, b * t), *_row_segments(kv_len, b, t, s))
    return (*(g.reshape(x.shape) for g, x in zip(grads, (q, k, v))), None)


_split_with_lse.defvjp(_split_with_lse_fwd, _split_with_lse_bwd)


# --- top-left masks on bottom-right kernels ------------------------------------------------

def _bounds(causal: bool, window):
    """Top-left ``(left, right)`` key bounds relative to the query index (None: unbounded)."""
    if window is not None and min(window) < 0:
        raise ValueError(f"local_window_size={window}: negative window sides exclude the diagonal, which the "
                         "kernels' windows always contain; use backend='reference'")
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0
    return left, right


def _kernel_window(t: int, s: int, left, right):
    """``(t', s', l, r)``: the kernel computes queries ``[0, t')`` against keys ``[0, s')`` with the
    bottom-right window ``(l, r)``, both sides >= 0 or None, which equals the top-left bounds.

    Queries past ``s - 1 + left`` see no key (output 0); keys past ``t' - 1 + right`` are seen by
    no query (zero gradient). A bound that cuts nothing inside the sliced problem becomes None.
    """
    tk = t if left is None else min(t, s + left)
    sk = s if right is None else min(s, tk + right)
    left = None if left is not None and left >= tk - 1 else left
    right = None if right is not None and right >= sk - 1 else right
    shift = sk - tk
    return tk, sk, None if left is None else left + shift, None if right is None else right - shift


def _dense(q, k, v, family: str, scale: float, bounds, what: str):
    """``(out [B, T, N, Hv], lse [B, N, T])`` with top-left ``bounds`` on the dense kernels."""
    t = q.shape[1]
    tk, sk, wl, wr = _kernel_window(t, k.shape[1], *bounds)
    q, k, v = q[:, :tk], k[:, :sk], v[:, :sk]
    causal, wl, wr = canonical_mask(False, wl, wr)
    if family == "ffpa" and (wl, wr) != (None, None):
        if wl is not None:
            raise NotImplementedError(f"{what}: needs the sliding window ({wl}, {wr}) in the kernels' bottom-right "
                                      f"convention, and FFPA (head_dim {q.shape[-1]}) has none; use head_dim <= 256 "
                                      "(FA4) or backend='reference'")
        m = tk - wr  # rows [0, m) are causal with offset (sk - m); rows [m, tk) see every key
        parts = [_with_lse(Config("ffpa", scale, True), q[:, :m], k, v),
                 _with_lse(Config("ffpa", scale, False), q[:, m:], k, v)]
        out = jnp.concatenate([p[0] for p in parts], axis=1)
        lse = jnp.concatenate([p[1] for p in parts], axis=2)
    else:
        out, lse = _with_lse(Config(family, scale, causal, (wl, wr)), q, k, v)
    if tk < t:
        out = jnp.pad(out, ((0, 0), (0, t - tk), (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, 0), (0, t - tk)), constant_values=-jnp.inf)
    return out, lse


def _row_segments(kv_len, b: int, t: int, s: int):
    """int32 cu_seqlens for rows as varlen segments: per row, (all T queries, keys ``[0, max(kv, 1))``)
    then (no query, the padding keys). Keys tile ``[B * S]``; no segment has queries without keys."""
    rows = jnp.arange(b, dtype=jnp.int32)
    keys = rows * s + jnp.clip(kv_len, 1, s).astype(jnp.int32)
    ends_q = (rows + 1) * t
    zero = jnp.zeros((1,), jnp.int32)
    cu_q = jnp.concatenate([zero, jnp.stack([ends_q, ends_q], 1).reshape(-1)])
    cu_k = jnp.concatenate([zero, jnp.stack([keys, (rows + 1) * s], 1).reshape(-1)])
    return cu_q, cu_k


def _varlen(q, k, v, kv_len, family: str, scale: float):
    """Unmasked attention over each row's first ``kv_len`` keys: ``(out [B, T, N, Hv], lse [B, N, T])``; a decoding
    call (T <= 16) on the split-KV route where :func:`xattn.core.routes.forward_route` picks it."""
    (b, t, n, _), s = q.shape, k.shape[1]
    problem = routes.FwdProblem(family, b, k.shape[2], n // k.shape[2], t, s, num_sms=split_kv.num_sms(), traced=True)
    route = routes.forward_route(problem)
    if route.name == "split-kv":  # rows with no key see key 0 here too (the caller zeroes them): lse stays finite
        return _split_with_lse(Config(family, scale), route.plan, q, k, v, jnp.clip(kv_len, 1, s).astype(jnp.int32))
    cu_q, cu_k = _row_segments(kv_len, b, t, s)
    flat = [x.reshape(-1, *x.shape[2:]) for x in (q, k, v)]
    out, lse = _with_lse(VarlenConfig(Config(family, scale), t, s), *flat, cu_q, cu_k)
    return out.reshape(b, t, n, -1), lse.reshape(n, b, t).transpose(1, 0, 2)


def _empty_rows(t: int, q_len, kv_len, left):
    """Bool ``[B, T]``: rows that see no key by their lengths (-> out 0, lse -inf)."""
    i = jnp.arange(t)[None]
    empty = jnp.zeros((1, t), bool) if q_len is None else i >= q_len[:, None]
    if kv_len is not None:
        kv = kv_len[:, None]
        empty = empty | (kv <= 0) | (False if left is None else i - left >= kv)
    return empty


def _causal_padded(q, k, v, kv_len, family: str, scale: float, what: str):
    """Top-left causal with ``key_value_seq_lengths``: row i sees keys ``j <= i`` and ``j < kv_len``.
    Rows ``i < kv_len`` see only real keys (the dense causal launch is exact for them); rows ``i >= kv_len``
    see all ``kv_len`` keys (the unmasked varlen launch). Two launches, the rows picked per batch row."""
    causal_out, causal_lse = _dense(q, k, v, family, scale, (None, 0), what)
    full_out, full_lse = _varlen(q, k, v, kv_len, family, scale)
    inside = jnp.arange(q.shape[1])[None] < kv_len[:, None]  # [B, T]
    out = jnp.where(inside[..., None, None], causal_out, full_out)
    return out, jnp.where(inside[:, None], causal_lse, full_lse)


def _kernel(q, k, v, scale, causal, window, q_len, kv_len, what):
    """``(out, lse)`` on the kernels; the caller checked :func:`_kernel_blocker` (no window with kv_len)."""
    family = _family(q.shape[-1], v.shape[-1])
    bounds = _bounds(causal, window)
    lengths = kv_len is not None and q.size and k.shape[1]  # (empty inputs: the dense path)
    if lengths and bounds == (None, None):
        out, lse = _varlen(q, k, v, kv_len, family, scale)
    elif lengths and bounds == (None, 0):
        out, lse = _causal_padded(q, k, v, kv_len, family, scale, what)
    else:
        out, lse = _dense(q, k, v, family, scale, bounds, what)
    if q_len is None and kv_len is None:
        return out, lse
    empty = _empty_rows(q.shape[1], q_len, kv_len, bounds[0])
    out = jnp.where(empty[..., None, None], 0, out)
    lse = jnp.where(empty[:, None], -jnp.inf, lse)
    return out, lse


def _kernel_blocker(q, k, v, bias, mask, causal: bool, window, kv_len) -> tuple[str, str, type] | None:
    """``(reason, message, error)`` when the kernels cannot run this call exactly (decided from static
    shapes and dtypes at trace time), else None. ``error`` is what ``strict=True`` raises."""
    if bias is not None or mask is not None:
        return ("mask/bias", "mask/bias arrays have no kernel form (use is_causal=True, local_window_size, "
                "query_seq_lengths/key_value_seq_lengths, or xattn.jax.packed_attention for documents)", ValueError)
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "dtype", f"{jnp.dtype(q.dtype)}: the kernels take float16/bfloat16", NotImplementedError
    family = family_for(q.shape[-1], v.shape[-1])
    if family is None:
        return ("head_dim", f"head dims {q.shape[-1]}/{v.shape[-1]} have no xattn kernel (FFPA: 320-512 step 16; "
                f"FA4: {', '.join(f'{a}/{b}' for a, b in FA4_HEAD_DIMS)})", NotImplementedError)
    if window is not None and min(window) < 0:
        return ("window", f"local_window_size={window}: negative sides exclude the diagonal, which the kernels' "
                "windows always contain", NotImplementedError)
    if window is not None and kv_len is not None:
        return ("window+lengths", "local_window_size with key_value_seq_lengths: the window's top-left offset "
                "differs per row, which one kernel window cannot express", NotImplementedError)
    bounds = _bounds(causal, window)
    if family == "ffpa" and bounds[0] is not None:
        _, _, wl, _ = _kernel_window(q.shape[1], k.shape[1], *bounds)
        if wl is not None:
            return ("ffpa_window", f"a sliding window at head_dim {q.shape[-1]} (FFPA has none; FA4 has windows up "
                    "to head_dim 256)", NotImplementedError)
    return None


# --- the pure-jnp path: jax.nn's masks, bias and mask arrays -------------------------------

def _visible(t: int, s: int, causal: bool, window, q_len, kv_len):
    """Bool ``[B or 1, T, S]``: jax.nn's causal, window and length masks (top-left)."""
    i, j = jnp.arange(t)[:, None], jnp.arange(s)[None]
    vis = jnp.ones((t, s), bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= (i <= j + window[0]) & (i >= j - window[1])
    vis = vis[None]
    if q_len is not None:
        vis = vis & (i[None] < q_len[:, None, None])
    if kv_len is not None:
        vis = vis & (j[None] < kv_len[:, None, None])
    return vis


def _reference(q, k, v, bias, mask, *, scale, causal, window, q_len, kv_len, precision):
    """``(out, lse)`` in float32 math; rows that see no key give 0 and -inf (as the kernels)."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    f32 = jnp.float32
    qg = q.astype(f32).reshape(b, t, kh, n // kh, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(f32), precision=precision) * scale
    if bias is not None:
        logits = logits + bias.astype(f32).reshape(bias.shape[0], kh, n // kh, t, s)
    vis = _visible(t, s, causal, window, q_len, kv_len)[:, None, None]
    if mask is not None:
        vis = vis & mask.reshape(mask.shape[0], kh, n // kh, t, s)
    vis = jnp.broadcast_to(vis, logits.shape)
    seen = vis.any(-1)
    logits = jnp.where(vis, logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1) * seen[..., None]
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(f32), precision=precision).reshape(b, t, n, -1)
    lse = jnp.where(seen, jax.nn.logsumexp(logits, axis=-1), -jnp.inf).reshape(b, n, t)
    return out.astype(q.dtype), jax.lax.stop_gradient(lse)


# --- fallbacks: the peer's own implementation ----------------------------------------------

_FALLBACK_WARNED: set[str] = set()


def _strict(strict) -> bool:
    """``strict`` as given, or ``XATTN_STRICT`` (unset/"0": fall back; "1": raise) when None."""
    if strict is None:
        return os.environ.get("XATTN_STRICT", "0").strip().lower() not in ("", "0", "false", "no", "off")
    if not isinstance(strict, (bool, np.bool_)):
        raise TypeError(f"strict: expected a bool or None, got {type(strict).__name__}")
    return bool(strict)


def _fall_back(reason: str, message: str, error: type, strict: bool, target: str) -> None:
    """Raise ``error`` (strict), else warn once per reason that ``target`` runs the call."""
    if strict:
        raise error(f"{message}; strict=True (or XATTN_STRICT=1) refuses the fallback to {target}")
    if reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(reason)
        warnings.warn(f"xattn.jax.dot_product_attention: {message}; running {target} instead (its exact result; "
                      f"warned once per reason, strict=True raises)", stacklevel=4)


def _flax_attention(query, key, value, bias, mask, *, is_causal: bool, broadcast_dropout, dropout_rng, dropout_rate,
                    deterministic, dtype, precision, module, jax_nn_args: dict):
    """Flax's own ``dot_product_attention`` (linen's for a linen ``module``, else nnx's): dropout and
    ``sow_weights`` as Flax runs them. ``is_causal`` joins the mask (linen's function has no is_causal)."""
    unsupported = [name for name, value in jax_nn_args.items() if value is not None]
    if unsupported:
        raise NotImplementedError(f"{', '.join(unsupported)} with dropout or module (sow_weights): Flax's attention, "
                                  "which runs those, has no such argument")
    from flax import linen, nnx

    if is_causal:
        t, s = jnp.shape(query)[-3], jnp.shape(key)[-3]
        causal = jnp.arange(s)[None] <= jnp.arange(t)[:, None]
        mask = causal if mask is None else jnp.logical_and(jnp.asarray(mask).astype(bool), causal)
    fn = linen.dot_product_attention if isinstance(module, linen.Module) else nnx.dot_product_attention
    return fn(query, key, value, bias, mask, broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng,
              dropout_rate=dropout_rate, deterministic=deterministic, dtype=dtype, precision=precision,
              module=module)


# --- entry points --------------------------------------------------------------------------

def _xattn(query, key, value, bias, mask, scale, is_causal, q_len, kv_len, window, precision, backend, strict):
    """``(out [..., T, N, Hv], lse [B, N, T] fp32)`` on the xattn kernels or the reference; None when the
    kernels cannot run the call exactly and jax.nn's XLA implementation must (after the warning)."""
    q, k, v, lead = _flatten(query, key, value)
    (b, t, n, d), s = q.shape, k.shape[1]
    q_len = _lengths(q_len, "query_seq_lengths", lead, b)
    kv_len = _lengths(kv_len, "key_value_seq_lengths", lead, b)
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal: expected a static bool, got {type(is_causal).__name__}")
    scale = static_scale(scale, d)
    if backend == "reference":
        bias, mask = (_per_head(x, name, lead, n, t, s) if x is not None else None
                      for x, name in ((bias, "bias"), (mask, "mask")))
        out, lse = _reference(q, k, v, bias, mask, scale=scale, causal=bool(is_causal), window=window,
                              q_len=q_len, kv_len=kv_len, precision=precision)
    else:
        blocker = _kernel_blocker(q, k, v, bias, mask, bool(is_causal), window, kv_len)
        if blocker is not None:
            _fall_back(*blocker, strict=strict, target="jax.nn.dot_product_attention (XLA)")
            return None
        what = f"is_causal={bool(is_causal)}, local_window_size={window} with T={t}, S={s}"
        out, lse = _kernel(q, k, v, scale, bool(is_causal), window, q_len, kv_len, what)
    return out.reshape(*lead, *out.shape[1:]), lse


def _jax_nn(implementation, query, key, value, bias, mask, **kw):
    """Honour ``implementation="xla"/"cudnn"``: jax.nn's own implementation, leading dims flattened."""
    q, k, v, lead = _flatten(query, key, value)
    (b, t, n, _), s = q.shape, k.shape[1]
    if len(lead) > 1:
        bias, mask = (_per_head(x, name, lead, n, t, s) if x is not None else None
                      for x, name in ((bias, "bias"), (mask, "mask")))
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        kw[name] = _lengths(kw[name], name, lead, b)
    res = jax.nn.dot_product_attention(q, k, v, bias, mask, implementation=implementation, **kw)
    out, residual = res if kw["return_residual"] else (res, None)
    out = out.reshape(*lead, *out.shape[1:])
    return out if residual is None else (out, residual.reshape(*lead, t, n))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False, broadcast_dropout: bool = True, dropout_rng=None,
                          dropout_rate: float = 0.0, deterministic: bool = True, dtype=None, precision=None,
                          module=None, backend: str = "auto", strict: bool | None = None):
    """``jax.nn.dot_product_attention`` on the xattn kernels (FFPA: head_dim 320-512; FA4: 64-256).

    Shapes: query ``[..., T, N, H]``, key ``[..., S, K, H]``, value ``[..., S, K, Hv]`` (``Hv != H``
    only where FA4 has the pair, e.g. 192/128) with the same leading dims (none, one batch dim as
    jax.nn's ``BTNH``, or several); ``N % K == 0`` (GQA/MQA). Returns out ``[..., T, N, Hv]``, and with
    ``return_residual=True`` ``(out, residual)``, residual ``[..., T, N]`` = logsumexp over the visible
    keys of ``scale * q.k`` (natural log, jax.nn's layout and dtype: key's), without gradient (jax.nn
    stops it too).

    Args, as jax.nn (all but query/key/value/bias/mask keyword-only):
      bias, mask: arrays broadcastable to ``[..., N, T, S]`` (mask: True / nonzero = attend, as Flax
        casts it to bool). No kernel takes them: the call runs on jax.nn's XLA implementation (see
        Fallbacks); ``backend="reference"`` computes them in jnp.
      scale: static float, default ``1/sqrt(H)``; finite and > 0 (``ValueError`` otherwise, on both backends).
      is_causal: top-left: query i sees keys ``j <= i`` (also when T != S).
      local_window_size: ``w`` or ``(left, right)``: query i sees ``i - left <= j <= i + right``
        (top-left), combined with ``is_causal``.
      query_seq_lengths, key_value_seq_lengths: int32 ``[B]`` (or the leading dims' shape): row b's
        valid queries/keys are its first ``len[b]``. Padded query rows give 0 (as jax.nn's).
      implementation: None runs xattn (``backend`` decides where); ``"xla"``/``"cudnn"`` are honoured:
        jax.nn's own implementation runs (with ``backend`` left at "auto", else ``ValueError``).
      return_residual: see above.
    Flax ``attention_fn`` keywords (``nnx.MultiHeadAttention(..., attention_fn=...)`` and linen's
    ``MultiHeadDotProductAttention`` pass them): ``dtype`` casts query/key/value (Flax's computation
    dtype, so the output has it too); ``precision`` reaches the reference's einsums (the kernels multiply
    fp16/bf16 with fp32 accumulation under any setting); dropout (``dropout_rate > 0`` and not
    ``deterministic``, with ``dropout_rng``, ``broadcast_dropout``) and ``module`` (``sow_weights``) run
    on Flax's own ``dot_product_attention`` (see Fallbacks).
    backend: ``"kernel"``, ``"reference"`` (pure jnp, exact jax.nn masks incl. bias/mask arrays) or
      ``"auto"`` (kernel on GPU, reference elsewhere).
    strict: True raises where a fallback would run (``ValueError`` for mask/bias arrays,
      ``NotImplementedError`` otherwise); None (default) reads ``XATTN_STRICT`` ("1": strict).

    Fallbacks (``backend`` "kernel"/"auto" on GPU, decided at trace time from static shapes and dtypes;
    a one-time ``UserWarning`` names each reason): mask/bias arrays, head dims no kernel has, dtypes
    other than fp16/bf16, negative window sides, ``local_window_size`` together with
    ``key_value_seq_lengths``, and a sliding window that still cuts keys at FFPA's head dims run on
    ``jax.nn.dot_product_attention(..., implementation="xla")``; Flax dropout and ``module`` run on
    Flax's ``dot_product_attention``. The kernels run every other case exactly, including causal with
    ``key_value_seq_lengths`` (two launches: rows ``i < kv_len`` causal, the rest see all real keys) and
    causal with T > S at FFPA's head dims (two launches).

    Difference from jax.nn, on the kernels and the reference: a query row that sees no key (a zero
    ``key_value_seq_lengths``, a window past the keys) gives out 0 and residual -inf, where jax.nn
    averages every value uniformly and returns a huge negative residual; padded query rows give out 0
    on both (residual -inf here). Unknown keywords raise ``TypeError`` (no ``**kwargs``).
    """
    strict = _strict(strict)
    if dtype is not None:
        query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    if mask is not None and jnp.asarray(mask).dtype != jnp.bool_:
        mask = jnp.asarray(mask).astype(jnp.bool_)  # Flax's masks are float (make_causal_mask): nonzero = attend
    if (dropout_rate > 0.0 and not deterministic) or module is not None:
        what = "attention dropout" if module is None else "module (Flax sow_weights: the attention weights)"
        _fall_back("dropout" if module is None else "module", f"{what} has no kernel", NotImplementedError, strict,
                   "Flax's dot_product_attention")
        if return_residual:
            raise NotImplementedError("return_residual with dropout or module: Flax's attention returns no residual")
        return _flax_attention(query, key, value, bias, mask, is_causal=bool(is_causal),
                               broadcast_dropout=broadcast_dropout, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
                               deterministic=deterministic, dtype=dtype, precision=precision, module=module,
                               jax_nn_args=dict(scale=scale, query_seq_lengths=query_seq_lengths,
                                                key_value_seq_lengths=key_value_seq_lengths,
                                                local_window_size=local_window_size, implementation=implementation))
    jax_nn_kw = dict(scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                     return_residual=return_residual)
    if implementation is not None:
        if implementation not in ("xla", "cudnn"):
            raise ValueError(f"implementation: expected None, 'xla' or 'cudnn', got {implementation!r}")
        if backend != "auto":
            raise ValueError(f"implementation={implementation!r} runs jax.nn's own implementation; it cannot be "
                             f"combined with backend={backend!r} (pass implementation=None)")
        return _jax_nn(implementation, query, key, value, bias, mask, **jax_nn_kw)
    res = _xattn(query, key, value, bias, mask, scale, is_causal, query_seq_lengths, key_value_seq_lengths,
                 _window(local_window_size), precision, resolve_backend(backend), strict)
    if res is None:
        return _jax_nn("xla", query, key, value, bias, mask, **jax_nn_kw)
    out, lse = res
    if not return_residual:
        return out
    return out, lse.transpose(0, 2, 1).astype(jnp.asarray(key).dtype).reshape(out.shape[:-1])
