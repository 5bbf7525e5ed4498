"""Packed (varlen) attention for JAX, and the ``segment_ids`` packing convention.

Varlen layout: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D/Dv]``, int32 ``cu_seqlens_q/k`` ``[S + 1]``
(segment s is tokens ``cu[s]:cu[s+1]``; zero-length segments are fine), static
``max_seqlen_q/k``; lse fp32 ``[Hq, Tq]``. Causal/windows are bottom-right aligned per
segment. ``segment_ids`` ``[B, N]`` (equal ids attend, 0 = padding) are turned into
cu_seqlens on device with a static bound ``max_segments`` on the number of runs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from xattn.core.workspace import bwd_workspace_shapes

from . import _ffi
from .attention import RESIDUAL_NAMES, Config, resolve_backend
from .reference import attention_reference, attention_reference_bwd, varlen_visible

__all__ = ["varlen_attention", "varlen_fwd", "varlen_bwd", "segment_ids_to_cu_seqlens", "packed_attention"]


@dataclass(frozen=True)
class VarlenConfig:
    """Static options of a varlen call: the dense :class:`Config` plus the static max lengths."""

    base: Config
    max_seqlen_q: int
    max_seqlen_k: int


def _check(q, k, v, cu_q, cu_k):
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
        raise ValueError(f"q, k, v: expected rank 3 [T, H, D] (varlen), got {q.shape}, {k.shape}, {v.shape}")
    if cu_q.ndim != 1 or cu_q.shape != cu_k.shape or cu_q.shape[0] < 2:
        raise ValueError(f"cu_seqlens_q/k: expected equal shapes [S + 1] with S >= 1, got {cu_q.shape}, {cu_k.shape}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dtype != jnp.int32:
            raise TypeError(f"{name}: expected int32, got {cu.dtype}")


def _fwd(cfg: VarlenConfig, q, k, v, cu_q, cu_k):
    c = cfg.base
    if c.backend == "reference":
        mask = varlen_visible(cu_q, cu_k, q.shape[0], k.shape[0], c.causal, c.window)
        out, lse = attention_reference(q[None], k[None], v[None], scale=c.scale, mask=mask)
        return out[0], lse[0]
    spec = c.spec("fwd", q, k, v, varlen=True)
    outs = [("out", (*q.shape[:2], v.shape[-1]), q.dtype), ("lse", (q.shape[1], q.shape[0]), "float32")]
    out, lse = _ffi.call(spec, [q, k, v, cu_q, cu_k], outs, [], c.scale, vmap_method="sequential")
    return out, lse


def _bwd(cfg: VarlenConfig, dout, q, k, v, out, lse, cu_q, cu_k):
    c = cfg.base
    if c.backend == "reference":
        mask = varlen_visible(cu_q, cu_k, q.shape[0], k.shape[0], c.causal, c.window)
        grads = attention_reference_bwd(dout[None], q[None], k[None], v[None], out[None], lse[None],
                                        scale=c.scale, mask=mask)
        return tuple(g[0] for g in grads)
    spec = c.spec("bwd", q, k, v, varlen=True)
    ws = bwd_workspace_shapes(spec, cu_q.shape[0] - 1, cfg.max_seqlen_q, cfg.max_seqlen_k, q.shape[0],
                              k.shape[0], q.shape[1], k.shape[1])
    outs = [("dq", q.shape, q.dtype), ("dk", k.shape, k.dtype), ("dv", v.shape, v.dtype)]
    dq, dk, dv = _ffi.call(spec, [dout, q, k, v, out, lse, cu_q, cu_k], outs, ws, c.scale,
                           vmap_method="sequential")
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _varlen(cfg: VarlenConfig, q, k, v, cu_q, cu_k):
    return _fwd(cfg, q, k, v, cu_q, cu_k)[0]


def _varlen_fwd_rule(cfg, q, k, v, cu_q, cu_k):
    out, lse = _fwd(cfg, q, k, v, cu_q, cu_k)
    res = tuple(checkpoint_name(x, n) for x, n in zip((q, k, v, out, lse), RESIDUAL_NAMES))
    return out, (*res, cu_q, cu_k)


def _varlen_bwd_rule(cfg, res, dout):
    q, k, v, out, lse, cu_q, cu_k = res
    return (*_bwd(cfg, dout, q, k, v, out, lse, cu_q, cu_k), None, None)


_varlen.defvjp(_varlen_fwd_rule, _varlen_bwd_rule)


def _config(family, q, scale, causal, window, backend, max_seqlen_q, max_seqlen_k) -> VarlenConfig:
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected a static non-negative int, got {value!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    base = Config(family, scale, causal, tuple(window), resolve_backend(backend))
    return VarlenConfig(base, max_seqlen_q, max_seqlen_k)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
                     family: str = "ffpa", scale: float | None = None, causal: bool = False,
                     window_size=(None, None), backend: str = "auto"):
    """Differentiable packed attention; returns out ``[Tq, Hq, Dv]``.

    ``family``: ``"ffpa"`` (head_dim 320-512) or ``"fa4"`` (<= 256, windows allowed).
    Under ``vmap`` the launches run one per mapped element (cu_seqlens differ per element).
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cfg = _config(family, q, scale, causal, window_size, backend, max_seqlen_q, max_seqlen_k)
    return _varlen(cfg, q, k, v, cu_seqlens_q, cu_seqlens_k)


def varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
               family: str = "ffpa", scale: float, causal: bool = False, window_size=(None, None),
               backend: str = "auto"):
    """``(out [Tq, Hq, Dv], lse [Hq, Tq])``, not differentiable (see :func:`varlen_bwd`)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cfg = _config(family, q, scale, causal, window_size, backend, max_seqlen_q, max_seqlen_k)
    return _fwd(cfg, q, k, v, cu_seqlens_q, cu_seqlens_k)


def varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int,
               max_seqlen_k: int, family: str = "ffpa", scale: float, causal: bool = False,
               window_size=(None, None), backend: str = "auto"):
    """``(dq, dk, dv)`` using exactly the supplied out/lse."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k)
    cfg = _config(family, q, scale, causal, window_size, backend, max_seqlen_q, max_seqlen_k)
    return _bwd(cfg, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)


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
                           causal=causal, window_size=window_size, backend=backend)
    keep = (segment_ids.reshape(-1) > 0)[:, None, None]
    out = jnp.where(keep, out, jnp.zeros_like(out))
    out = jnp.where(overflow, jnp.full_like(out, jnp.nan), out)
    return out.reshape(b, n, *out.shape[1:])
