"""Packed (varlen) attention for JAX, and the ``segment_ids`` packing convention.

Varlen layout: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D/Dv]``, int32 ``cu_seqlens_q/k`` ``[S + 1]``
(segment s is tokens ``cu[s]:cu[s+1]``; zero-length segments are fine), static
``max_seqlen_q/k``; lse fp32 ``[Hq, Tq]``. Causal/windows are bottom-right aligned per
segment. ``segment_ids`` ``[B, N]`` (equal ids attend, 0 = padding) are turned into
cu_seqlens on device with a static bound ``max_segments`` on the number of runs.

Checked inputs. The kernels trust ``0 = cu[0] <= ... <= cu[S] <= T`` and segments ``<= max_seqlen``
(unchecked, a bad cu_seqlens is undefined behaviour: wrong output or an illegal memory access).
``check_inputs=True`` (``None``: when ``XATTN_CHECK_INPUTS=1``) states these rules as
``jax.experimental.checkify`` user checks, each message naming the first bad index and the values
(:mod:`xattn.core.varlen_check`):

* eager (concrete cu_seqlens): one device -> host copy of a small summary, then a failing rule
  raises ``checkify.JaxRuntimeError`` (a ``ValueError``) at once;
* under ``checkify.checkify(f, errors=checkify.user_checks)``, jitted or not: the checks are
  functionalized, ``err.get()`` / ``err.throw()`` report the first failing one. A failed check
  does not stop the computation, so the kernels then get all-zero cu_seqlens (empty segments:
  no bad offset reaches them) and the outputs are meaningless until ``err`` is looked at;
* under ``jax.jit`` WITHOUT checkify the values are abstract and a check cannot be staged: compiling
  the jitted function raises JAX's ``ValueError`` "Cannot abstractly evaluate a checkify.check which
  was not functionalized" (whatever the values). Wrap the function in checkify, or pass
  ``check_inputs=False`` there (``XATTN_CHECK_INPUTS=1`` turns this on for every jitted varlen call).

int32 dtype and the ``[S + 1]`` shapes are static and always checked.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import checkify

from xattn.core import routes
from xattn.core import varlen_check as vc
from xattn.core.spec import canonical_mask
from xattn.core.workspace import bwd_workspace_shapes

from . import _ffi
from .attention import RESIDUAL_NAMES, Config, check_dense, resolve_backend, static_scale
from .reference import attention_reference, attention_reference_bwd, varlen_visible

__all__ = ["varlen_attention", "varlen_fwd", "varlen_bwd", "segment_ids_to_cu_seqlens", "packed_attention"]


@dataclass(frozen=True)
class VarlenConfig:
    """Static options of a varlen call: the dense :class:`Config` plus the static max lengths."""

    base: Config
    max_seqlen_q: int
    max_seqlen_k: int
    same_segments: bool = False  # cu_seqlens_q is cu_seqlens_k (every document has nq == nk)


_log = logging.getLogger("xattn")

_OPS = vc.ArrayOps(first_true=jnp.argmax, take=lambda x, i: x[i],
                   stack=lambda values: jnp.stack([jnp.asarray(x).astype(jnp.int32) for x in values]))


def _check_values(cu_q, cu_k, total_q: int, total_k: int, max_seqlen_q, max_seqlen_k):
    """Checked mode: every cu_seqlens rule as a checkify user check (see the module docstring).

    Returns the cu_seqlens to launch with: the given ones, or all zeros (only empty segments) when a
    rule fails, because under checkify a failed check does not stop the computation."""
    flat = jnp.concatenate([vc.summary(_OPS, cu_q, total_q, max_seqlen_q),
                            vc.summary(_OPS, cu_k, total_k, max_seqlen_k)])
    rules = vc.entries(cu_q.shape[0] - 1, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if isinstance(flat, jax.core.Tracer):
        for bad, values, template in rules:
            checkify.check(flat[bad] == 0, template, *flat[values])
        ok = jnp.all(flat[jnp.array([bad for bad, _, _ in rules])] == 0)
        return jnp.where(ok, cu_q, 0), jnp.where(ok, cu_k, 0)
    flat = np.asarray(flat)  # the one device -> host copy; only a failing rule reaches checkify
    for bad, values, template in rules:
        if flat[bad]:  # raises here, or is recorded under an eager checkify
            checkify.check(jnp.asarray(False), template, *(jnp.asarray(x) for x in flat[values]))
            return jnp.zeros_like(cu_q), jnp.zeros_like(cu_k)
    return cu_q, cu_k


def varlen_forward_call(cfg: VarlenConfig, q, k, v, cu_q, cu_k):
    """``(out [Tq, Hq, Dv], lse fp32 [Hq, Tq])`` of one packed call on ``cfg``'s backend (no checks: the
    public functions and :mod:`xattn.jax.nn` validate first)."""
    c = cfg.base
    if c.backend == "reference":
        c.checked("fwd", q, k, v, cu_q, cu_k, cfg.max_seqlen_q, cfg.max_seqlen_k)  # the one validator
        mask = varlen_visible(cu_q, cu_k, q.shape[0], k.shape[0], c.causal, c.window)
        out, lse = attention_reference(q[None], k[None], v[None], scale=c.scale, mask=mask)
        return out[0], lse[0]
    spec = c.spec("fwd", q, k, v, cu_q, cu_k, cfg.max_seqlen_q, cfg.max_seqlen_k)
    if q.shape[0] == 0 or k.shape[0] == 0:  # no query token, or no key in any segment: no launch
        return jnp.zeros((*q.shape[:2], v.shape[-1]), q.dtype), jnp.full((q.shape[1], q.shape[0]), -jnp.inf,
                                                                         jnp.float32)
    route = forward_route(cfg, spec, k, cu_q)
    if route.name == "split-kv":
        from .split_kv import packed_split_forward

        return packed_split_forward(c, route.plan, q, k, v, cu_q, cu_k, cfg.max_seqlen_q)
    outs = [("out", (*q.shape[:2], v.shape[-1]), q.dtype), ("lse", (q.shape[1], q.shape[0]), "float32")]
    out, lse = _ffi.call(spec, [q, k, v, cu_q, cu_k], outs, [], c.scale, vmap_method="sequential")
    return out, lse


def forward_route(cfg: VarlenConfig, spec, k, cu_q) -> routes.Route:
    """The forward route of a packed call (:func:`xattn.core.routes.forward_route`, from static shapes at trace
    time): ``split-kv`` for decoding (at most 16 queries per document on many keys), else ``fused``."""
    from .split_kv import num_sms

    c = cfg.base
    problem = routes.FwdProblem(spec.family, cu_q.shape[0] - 1, k.shape[1], spec.qhead_per_kvhead,
                                cfg.max_seqlen_q, cfg.max_seqlen_k, causal=spec.causal, local=spec.is_local,
                                varlen=True, num_sms=num_sms(), num_splits=c.num_splits, traced=True)
    route = routes.forward_route(problem, c.fwd_route)
    _log.debug("xattn packed forward route %s: %s", route.name, route.reason)
    return route


def varlen_backward_call(cfg: VarlenConfig, dout, q, k, v, out, lse, cu_q, cu_k):
    """``(dq, dk, dv)`` of one packed call from the given out/lse, on the route :func:`packed_route` names
    (the family's fused varlen backward or a GEMM backward); no checks, as :func:`varlen_forward_call`."""
    c = cfg.base
    if c.backend == "reference":
        c.checked("bwd", q, k, v, cu_q, cu_k, cfg.max_seqlen_q, cfg.max_seqlen_k)  # the one validator
        mask = varlen_visible(cu_q, cu_k, q.shape[0], k.shape[0], c.causal, c.window)
        grads = attention_reference_bwd(dout[None], q[None], k[None], v[None], out[None], lse[None],
                                        scale=c.scale, mask=mask)
        return tuple(g[0] for g in grads)
    spec = c.spec("bwd", q, k, v, cu_q, cu_k, cfg.max_seqlen_q, cfg.max_seqlen_k)
    if q.shape[0] == 0 or k.shape[0] == 0:  # nothing was computed: every gradient is 0
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    route = packed_route(cfg, spec, q, k, cu_q)
    _log.debug("xattn packed backward route %s: %s", route.name, route.reason)

    def fused():
        ws = bwd_workspace_shapes(spec, cu_q.shape[0] - 1, cfg.max_seqlen_q, cfg.max_seqlen_k, q.shape[0],
                                  k.shape[0], q.shape[1], k.shape[1])
        outs = [("dq", q.shape, q.dtype), ("dk", k.shape, k.dtype), ("dv", v.shape, v.dtype)]
        dq, dk, dv = _ffi.call(spec, [dout, q, k, v, out, lse, cu_q, cu_k], outs, ws, c.scale,
                               vmap_method="sequential")
        return dq, dk, dv

    def segments():
        from .gemm_bwd_segments import gemm_backward_segments

        return gemm_backward_segments(dout, q, k, v, out, lse, cu_q, max_seqlen=min(cfg.max_seqlen_q, cfg.max_seqlen_k),
                                      softmax_scale=c.scale, causal=c.causal, budget=c.budget())

    if route.name == "fused":
        return fused()
    if route.name == "gemm-padded":
        from .gemm_bwd import gemm_backward_padded

        return gemm_backward_padded(dout, q, k, v, out, lse, cu_q, cu_k, max_seqlen_q=cfg.max_seqlen_q,
                                    max_seqlen_k=cfg.max_seqlen_k, softmax_scale=c.scale, causal=c.causal,
                                    same_segments=cfg.same_segments, budget=c.budget())
    if route.name == "gemm-segments":
        return segments()
    if route.name == "gemm-segments|fused":  # the table's rule, evaluated on the device
        return jax.lax.cond(routes.segments_take_gemms(jnp, cu_q, spec.qhead_per_kvhead), segments, fused)
    raise AssertionError(f"route {route.name!r} has no JAX driver")  # backward_route never returns one


def packed_route(cfg: VarlenConfig, spec, q, k, cu_q) -> routes.Route:
    """The backward route of a packed call under ``jit`` (:func:`xattn.core.routes.backward_route`, kind
    ``traced``: decided from static shapes, as the document lengths are traced values)."""
    c = cfg.base
    problem = routes.BwdProblem(spec.family, spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead, c.causal,
                                (spec.window_left, spec.window_right), "traced", total_q=q.shape[0],
                                total_k=k.shape[0], slots=cu_q.shape[0] - 1, max_seqlen_q=cfg.max_seqlen_q,
                                max_seqlen_k=cfg.max_seqlen_k, same_segments=cfg.same_segments,
                                heads_q=q.shape[1])
    return routes.backward_route(problem, c.bwd_route[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _varlen(cfg: VarlenConfig, q, k, v, cu_q, cu_k):
    return varlen_forward_call(cfg, q, k, v, cu_q, cu_k)[0]


def _varlen_fwd_rule(cfg, q, k, v, cu_q, cu_k):
    out, lse = varlen_forward_call(cfg, q, k, v, cu_q, cu_k)
    res = tuple(checkpoint_name(x, n) for x, n in zip((q, k, v, out, lse), RESIDUAL_NAMES))
    return out, (*res, cu_q, cu_k)


def _varlen_bwd_rule(cfg, res, dout):
    q, k, v, out, lse, cu_q, cu_k = res
    return (*varlen_backward_call(cfg, dout, q, k, v, out, lse, cu_q, cu_k), None, None)


_varlen.defvjp(_varlen_fwd_rule, _varlen_bwd_rule)


def _config(family, q, scale, causal, window, backend, max_seqlen_q, max_seqlen_k) -> VarlenConfig:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a static non-negative int, got {value!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    scale = static_scale(scale, q.shape[-1] if q.ndim else 0)  # TypeError/ValueError naming `scale`
    causal, left, right = canonical_mask(causal, *tuple(window))  # one spelling per mask
    if family == "ffpa" and (left, right) != (None, None):  # on every backend, as the kernels refuse it
        raise NotImplementedError(f"window_size {tuple(window)}: FFPA has no sliding-window kernel on sm90; use "
                                  "family='fa4' (head_dim <= 256) for local layers")
    base = Config(family, scale, causal, (left, right), resolve_backend(backend), kernel_rules=backend != "reference")
    return VarlenConfig(base, max_seqlen_q, max_seqlen_k)


def _devices(x):
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
        return x.devices()
    return None  # NumPy, Python, or traced: placed by XLA with the rest


def _check_same_devices(q, **others) -> None:
    """Committed arrays on other devices than q (e.g. cu_seqlens on the host) would move the whole call
    off the GPU (to a platform without the kernels): name them instead."""
    where = _devices(q)
    if where is None:
        return
    for name, x in others.items():
        got = _devices(x)
        if got is not None and got != where and getattr(x, "committed", True):
            raise ValueError(f"{name}: on {sorted(map(str, got))} but q is on {sorted(map(str, where))}; "
                             "put every input on q's device (jax.device_put)")


def _checked_config(q, k, v, cu_q, cu_k, family, scale, causal, window, backend, max_seqlen_q, max_seqlen_k,
                    check_inputs):
    """The static checks and the config; then, in checked mode, the cu_seqlens values.
    Returns ``(cfg, cu_q, cu_k)``, the cu_seqlens to launch with."""
    check_dense(q, k, v)  # arrays; the rest is the core's one validator, run here on the call's metadata
    cu_q, cu_k = (jnp.asarray(x) if not hasattr(x, "dtype") else x for x in (cu_q, cu_k))
    _check_same_devices(q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    cfg = dataclasses.replace(_config(family, q, scale, causal, window, backend, max_seqlen_q, max_seqlen_k),
                              same_segments=cu_q is cu_k)
    cfg.base.checked("fwd", q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    if vc.checking(check_inputs):
        cu_q, cu_k = _check_values(cu_q, cu_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    return cfg, cu_q, cu_k


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
                     family: str = "ffpa", scale: float | None = None, causal: bool = False,
                     window_size=(None, None), backend: str = "auto", check_inputs: bool | None = None):
    """Differentiable packed attention; returns out ``[Tq, Hq, Dv]``.

    ``family``: ``"ffpa"`` (head_dim 320-512) or ``"fa4"`` (<= 256, windows allowed).
    Under ``vmap`` the launches run one per mapped element (cu_seqlens differ per element).
    ``check_inputs``: ``True`` checks the cu_seqlens values (checkify user checks, see the module
    docstring), ``False`` trusts them, ``None`` follows ``XATTN_CHECK_INPUTS``.
    """
    cfg, cu_seqlens_q, cu_seqlens_k = _checked_config(q, k, v, cu_seqlens_q, cu_seqlens_k, family, scale, causal,
                                                      window_size, backend, max_seqlen_q, max_seqlen_k, check_inputs)
    return _varlen(cfg, q, k, v, cu_seqlens_q, cu_seqlens_k)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
               family: str = "ffpa", scale: float, causal: bool = False, window_size=(None, None),
               backend: str = "auto", check_inputs: bool | None = None):
    """``(out [Tq, Hq, Dv], lse [Hq, Tq])``, not differentiable (see :func:`varlen_bwd`);
    ``check_inputs`` as in :func:`varlen_attention`."""
    cfg, cu_seqlens_q, cu_seqlens_k = _checked_config(q, k, v, cu_seqlens_q, cu_seqlens_k, family, scale, causal,
                                                      window_size, backend, max_seqlen_q, max_seqlen_k, check_inputs)
    return varlen_forward_call(cfg, q, k, v, cu_seqlens_q, cu_seqlens_k)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
               max_seqlen_k: int, family: str = "ffpa", scale: float, causal: bool = False,
               window_size=(None, None), backend: str = "auto", check_inputs: bool | None = None):
    """``(dq, dk, dv)`` using exactly the supplied out/lse; ``check_inputs`` as in :func:`varlen_attention`."""
    cfg, cu_seqlens_q, cu_seqlens_k = _checked_config(q, k, v, cu_seqlens_q, cu_seqlens_k, family, scale, causal,
                                                      window_size, backend, max_seqlen_q, max_seqlen_k, check_inputs)
    return varlen_backward_call(cfg, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)


def segment_ids_to_cu_seqlens(segment_ids, max_segments: int):
    """``(cu_seqlens int32 [max_segments + 1], num_segments, overflow)`` for flattened ``[B * N]`` tokens.

    Every run of equal ids inside a row is one segment (padding runs, id 0, too), so the
    segments tile all B*N tokens; unused trailing entries are B*N (zero-length segments).
    ``overflow`` is True when the rows hold more than ``max_segments`` runs (then cu_seqlens
    is wrong: :func:`packed_attention` turns its output into NaN rather than a silent error).
    """
    b, n = segment_ids.shape
    seg = segment_ids.reshape(-1)
    t = jnp.arange(b * n)
    new_run = (t % n == 0) | (seg != jnp.roll(seg, 1))
    run = jnp.cumsum(new_run) - 1
    num = run[-1] + 1
    index = jnp.where(new_run, run, max_segments + 1)  # non-starts: out of range, dropped
    cu = jnp.full((max_segments + 1,), b * n, dtype=jnp.int32).at[index].set(t.astype(jnp.int32), mode="drop")
    return cu, num, num > max_segments


def packed_attention(q, k, v, segment_ids, *, max_segments: int, family: str = "ffpa",
                     scale: float | None = None, causal: bool = True, window_size=(None, None),
                     backend: str = "auto"):
    """Document-(causal) attention over packed rows: q/k/v ``[B, N, H, D]``, segment_ids ``[B, N]``.

    Tokens attend within their run of equal ids (0 = padding: output 0). Runs one varlen
    launch over all B*N tokens. ``max_segments`` is a static bound on runs in the whole batch.
    """
    b, n = segment_ids.shape
    if q.shape[:2] != (b, n) or k.shape[:2] != (b, n):
        raise ValueError(f"q/k/v: expected [B, N, ...] = {(b, n)} like segment_ids, got {q.shape}, {k.shape}")
    cu, _, overflow = segment_ids_to_cu_seqlens(segment_ids, max_segments)
    flat = [x.reshape(b * n, *x.shape[2:]) for x in (q, k, v)]
    out = varlen_attention(*flat, cu, cu, max_seqlen_q=n, max_seqlen_k=n, family=family, scale=scale,
                           causal=causal, window_size=window_size, backend=backend,
                           check_inputs=False)  # built here; an overflow turns into NaN below
    keep = (segment_ids.reshape(-1) > 0)[:, None, None]
    out = jnp.where(keep, out, jnp.zeros_like(out))
    out = jnp.where(overflow, jnp.full_like(out, jnp.nan), out)
    return out.reshape(b, n, *out.shape[1:])
