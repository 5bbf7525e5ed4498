"""Context-parallel ring attention for ``jax.shard_map`` (issue #13), on the load-balanced layout.

Glossary: B batch, N global length, P devices on ``axis_name``, L = N / (2P) chunk length,
Hq/Hkv heads, D q/k head dim, Dv v head dim. Dual-chunk ("zigzag") layout: the sequence is cut
into 2P chunks of L tokens; device r holds ``concat(chunk r, chunk 2P-1-r)``, N_local = 2L
tokens in increasing global order. :func:`shard_sequence` / :func:`unshard_sequence` /
:func:`sequence_positions` build it. Masks are FlashAttention's (bottom-right aligned) on the
global problem; with Nq == Nk that is the usual causal / sliding window.

Global attention (window ``(None, None)``): K/V blocks travel the ring (``lax.ppermute``
r -> r+1), P steps, partial (out, lse) merged in fp32 with the log-sum-exp rule. Causal
balancing: step 0 is causal attention on the local block; at step s > 0 the block of device
src = r - s holds chunks (src, 2P-1-src): if src < r every local query sees chunk src only, if
src > r only the local chunk 2P-1-r sees the block, all of it. r is traced inside shard_map,
so the two cases are a ``lax.cond`` whose branches have the same shapes (the half-query branch
pads out with 0 and lse with -inf). The backward (``custom_vjp``) runs the low-level backward
with the MERGED out/lse; fp32 dK/dV accumulators travel with their K/V block and one last
shift returns them to their owners. The P steps are unrolled (P is static), each step's
ppermute issued before its compute so XLA can overlap them.

Sliding windows (both sides finite): a halo exchange, not a ring. The last ``min(left, L)``
and first ``min(right, L)`` tokens of every chunk are all-gathered; each local chunk c
attends to ``concat(left halo, chunk, right halo)`` with the real halo lengths
``hl = min(left, cL)``, ``hr = min(right, N - (c+1)L)``, clipped at the sequence ends, and
the window ``(left + hr, right - hr)``, which lines query i up with key ``hl + i`` under
bottom-right alignment. Those lengths depend on r, so the per-device program is a
``lax.switch`` over r with P branches in which every shape is static; the branches return
fixed shapes (no sentinel keys, no extra masking; the kernel sees only real keys). The
backward (``custom_vjp`` too, so no branch residuals) scatters the halo gradients into a
``[P, 2, ...]`` buffer and ``lax.psum_scatter`` hands each device those of its own tails and
heads. The all-gather moves ``2P * (min(left, L) + min(right, L))`` tokens of K and V.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from xattn.core.ring_layout import chunk_length, chunks_of, edge_widths, halo_plan
from xattn.core.spec import FA4_HEAD_DIMS, canonical_mask, family_for

from . import _ffi
from .attention import (RESIDUAL_NAMES, Config, backward_call, check_dense, forward_call, resolve_backend,
                        static_scale)

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "sequence_positions"]

_F32 = jnp.float32


@dataclass(frozen=True)
class RingConfig:
    """Static options of one ring/halo call; ``window`` is canonical (both ints, or None/None)."""

    axis_name: Hashable
    size: int
    family: str
    scale: float
    causal: bool
    window: tuple
    backend: str
    kernel_rules: bool = True  # as Config.kernel_rules: False only for backend="reference" by name

    @property
    def halo(self) -> bool:
        return self.window != (None, None)

    def attn(self, causal: bool = False, window=(None, None)) -> Config:
        return Config(self.family, self.scale, causal, window, self.backend, kernel_rules=self.kernel_rules)


# --- the dual-chunk layout ----------------------------------------------------------------

def _check_layout(seqlen: int, world_size, rank=None) -> int:
    if isinstance(world_size, np.integer):
        world_size = int(world_size)
    chunk = chunk_length(seqlen, world_size)
    if rank is not None and not (isinstance(rank, (int, np.integer)) and 0 <= rank < world_size):
        raise ValueError(f"rank: expected an int in [0, {world_size}), got {rank!r}")
    return chunk


def _slice(x, axis: int, lo: int, hi: int):
    if isinstance(x, np.ndarray):
        return x[(slice(None),) * axis + (slice(lo, hi),)]
    return lax.slice_in_dim(x, lo, hi, axis=axis)


def _chunks_of(world_size: int, rank=None) -> list[int]:
    ranks = range(world_size) if rank is None else [rank]
    return [c for r in ranks for c in chunks_of(world_size, r)]


def shard_sequence(x, world_size: int, rank: int | None = None, axis: int = 1):
    """Dual-chunk layout of the full sequence ``x`` (length N along ``axis``).

    ``rank=None``: the whole array permuted into device order (``concat_r[chunk r, chunk
    2P-1-r]``), so sharding ``axis`` over the mesh axis gives every device its shard;
    with a rank: that device's ``[.., 2L, ..]`` shard only. NumPy in, NumPy out.
    """
    xp = np if isinstance(x, np.ndarray) else jnp
    axis = axis % x.ndim
    chunk = _check_layout(x.shape[axis], world_size, rank)
    return xp.concatenate([_slice(x, axis, c * chunk, (c + 1) * chunk) for c in _chunks_of(world_size, rank)],
                          axis=axis)


def unshard_sequence(x, world_size: int, axis: int = 1):
    """Inverse of ``shard_sequence(x, world_size)``: the device-ordered array back in sequence order."""
    xp = np if isinstance(x, np.ndarray) else jnp
    axis = axis % x.ndim
    chunk = _check_layout(x.shape[axis], world_size)
    slot = {c: i for i, c in enumerate(_chunks_of(world_size))}
    return xp.concatenate([_slice(x, axis, slot[c] * chunk, (slot[c] + 1) * chunk)
                           for c in range(2 * world_size)], axis=axis)


def sequence_positions(seqlen: int, world_size: int, rank: int | None = None):
    """int32 global positions in the dual-chunk order (``[N]``, or ``[2L]`` for one rank), e.g. rotary ids."""
    return jnp.asarray(shard_sequence(np.arange(seqlen, dtype=np.int32), world_size, rank, axis=0))


# --- ring (global attention) --------------------------------------------------------------

def _shift(tree, cfg: RingConfig):
    """Send to the next device on the ring (r -> r + 1 mod P)."""
    if cfg.size == 1:
        return tree
    return lax.ppermute(tree, cfg.axis_name, [(i, (i + 1) % cfg.size) for i in range(cfg.size)])


def _pad_seq(x, front: int, back: int, axis: int = 1, value=0.0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (front, back)
    return jnp.pad(x, widths, constant_values=value)


def _merge(out, lse, part, part_lse):
    """Log-sum-exp merge in fp32; rows that saw no key stay out 0 / lse -inf, never NaN."""
    m = jnp.maximum(lse, part_lse)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    a, b = jnp.exp(lse - m), jnp.exp(part_lse - m)
    total = a + b
    inv = 1.0 / jnp.where(total > 0, total, 1.0)
    w = lambda x: jnp.swapaxes(x * inv, 1, 2)[..., None]  # noqa: E731  [B, Hq, N] -> [B, N, Hq, 1]
    return w(a) * out + w(b) * part.astype(_F32), jnp.where(total > 0, m + jnp.log(total), -jnp.inf)


def _fwd_step(cfg: RingConfig, s: int, rank, q, k, v):
    """``(out, lse)`` of the local queries on the block of device ``r - s`` (shapes of the full local q)."""
    if s == 0 or not cfg.causal:
        return forward_call(cfg.attn(causal=cfg.causal and s == 0), q, k, v)
    half = q.shape[1] // 2

    def early(q, k, v):  # src < r: all local queries, the block's first chunk
        return forward_call(cfg.attn(), q, k[:, :half], v[:, :half])

    def late(q, k, v):  # src > r: the second local chunk, the whole block
        out, lse = forward_call(cfg.attn(), q[:, half:], k, v)
        return _pad_seq(out, half, 0), _pad_seq(lse, half, 0, axis=2, value=-jnp.inf)

    return lax.cond(s <= rank, early, late, q, k, v)


def _bwd_step(cfg: RingConfig, s: int, rank, dout, q, k, v, out, lse):
    """``(dq, dk, dv)`` of step s with the merged out/lse (shapes of the local q and block)."""
    if s == 0 or not cfg.causal:
        return backward_call(cfg.attn(causal=cfg.causal and s == 0), dout, q, k, v, out, lse)
    half = q.shape[1] // 2

    def early(dout, q, k, v, out, lse):
        dq, dk, dv = backward_call(cfg.attn(), dout, q, k[:, :half], v[:, :half], out, lse)
        return dq, _pad_seq(dk, 0, half), _pad_seq(dv, 0, half)

    def late(dout, q, k, v, out, lse):
        dq, dk, dv = backward_call(cfg.attn(), dout[:, half:], q[:, half:], k, v, out[:, half:], lse[..., half:])
        return _pad_seq(dq, half, 0), dk, dv

    return lax.cond(s <= rank, early, late, dout, q, k, v, out, lse)


def _ring_forward(cfg: RingConfig, q, k, v):
    rank = lax.axis_index(cfg.axis_name)
    kv, out, lse = (k, v), None, None
    for s in range(cfg.size):
        nxt = _shift(kv, cfg) if s + 1 < cfg.size else None  # issued before this step's compute
        part, part_lse = _fwd_step(cfg, s, rank, q, *kv)
        out, lse = (part.astype(_F32), part_lse) if out is None else _merge(out, lse, part, part_lse)
        kv = nxt
    return out.astype(q.dtype), lse


def _ring_backward(cfg: RingConfig, dout, q, k, v, out, lse):
    rank = lax.axis_index(cfg.axis_name)
    kv, dq, dkv = (k, v), None, None
    for s in range(cfg.size):
        nxt = _shift(kv, cfg) if s + 1 < cfg.size else None
        gq, gk, gv = _bwd_step(cfg, s, rank, dout, q, *kv, out, lse)
        dq = gq.astype(_F32) if dq is None else dq + gq
        dkv = (gk.astype(_F32), gv.astype(_F32)) if dkv is None else (dkv[0] + gk, dkv[1] + gv)
        # the accumulator of block r - s moves on with the block; after step P-1 this shift
        # delivers every block's dk/dv to its owner
        dkv = _shift(dkv, cfg)
        kv = nxt
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


# --- halo (sliding windows) ---------------------------------------------------------------

def _gather_halos(cfg: RingConfig, k, v):
    """``(tails, heads)``: ``(k, v)`` pairs ``[P, 2, B, T, Hkv, D]`` of every chunk's last min(left, L) /
    first min(right, L) tokens (None for an empty side)."""
    chunk = k.shape[1] // 2
    left, right = cfg.window

    def gather(lo, hi):
        return tuple(lax.all_gather(jnp.stack([x[:, lo:hi], x[:, chunk + lo:chunk + hi]]), cfg.axis_name)
                     for x in (k, v))
    tl, tr = edge_widths(chunk, left, right)
    return (gather(chunk - tl, chunk) if tl else None), (gather(0, tr) if tr else None)


def _extend(x, slot: int, chunk: int, pieces_l, pieces_r, bufs_l, bufs_r):
    parts = [bufs_l[p, s][:, lo:hi] for p, s, lo, hi in pieces_l]
    parts.append(x[:, slot * chunk:(slot + 1) * chunk])
    parts += [bufs_r[p, s][:, lo:hi] for p, s, lo, hi in pieces_r]
    return jnp.concatenate(parts, axis=1)


def _scatter(buf, pieces, grad):
    """Add the halo gradient ``grad`` (pieces in sequence order) into the gathered-shape ``buf``."""
    at = 0
    for p, s, lo, hi in pieces:
        buf = buf.at[p, s, :, lo:hi].add(grad[:, at:at + hi - lo])
        at += hi - lo
    return buf


def _slots(cfg: RingConfig, r: int, chunk: int):
    """Per local slot: ``(slot, window, pieces_l, pieces_r)`` for device r (static; see ``halo_plan``)."""
    for slot, c in enumerate(chunks_of(cfg.size, r)):
        plan = halo_plan(c, cfg.size, chunk, *cfg.window)
        yield slot, plan.window(*cfg.window), plan.before, plan.after


def _halo_forward(cfg: RingConfig, q, k, v):
    chunk = q.shape[1] // 2
    tails, heads = _gather_halos(cfg, k, v)

    def branch(r, q, k, v, tails, heads):
        outs, lses = [], []
        for slot, window, pl, pr in _slots(cfg, r, chunk):
            kv = [_extend(x, slot, chunk, pl, pr, tails and tails[i], heads and heads[i]) for i, x in enumerate((k, v))]
            out, lse = forward_call(cfg.attn(window=window), q[:, slot * chunk:(slot + 1) * chunk], *kv)
            outs.append(out)
            lses.append(lse)
        return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)

    rank = lax.axis_index(cfg.axis_name)
    return lax.switch(rank, [functools.partial(branch, r) for r in range(cfg.size)], q, k, v, tails, heads)


def _halo_backward(cfg: RingConfig, dout, q, k, v, out, lse):
    chunk = q.shape[1] // 2
    tails, heads = _gather_halos(cfg, k, v)

    def branch(r, dout, q, k, v, out, lse, tails, heads):
        def zeros(bufs):  # typed varying like q: every switch branch must return the same types
            return None if bufs is None else _ffi.match_varying([jnp.zeros(bufs[0].shape, _F32)], [q])[0]
        halo_grads = [[zeros(tails), zeros(heads)] for _ in range(2)]  # [dk, dv] x [tails, heads]
        dq, dkv = [], [[], []]
        for slot, window, pl, pr in _slots(cfg, r, chunk):
            rows = slice(slot * chunk, (slot + 1) * chunk)
            kv = [_extend(x, slot, chunk, pl, pr, tails and tails[i], heads and heads[i]) for i, x in enumerate((k, v))]
            g = backward_call(cfg.attn(window=window), dout[:, rows], q[:, rows], *kv, out[:, rows], lse[..., rows])
            dq.append(g[0])
            hl = sum(hi - lo for *_, lo, hi in pl)
            for i in range(2):
                grad = g[1 + i].astype(_F32)
                dkv[i].append(grad[:, hl:hl + chunk])
                halo_grads[i][0] = _scatter(halo_grads[i][0], pl, grad[:, :hl])
                halo_grads[i][1] = _scatter(halo_grads[i][1], pr, grad[:, hl + chunk:])
        return (jnp.concatenate(dq, axis=1), *(jnp.concatenate(d, axis=1) for d in dkv), halo_grads)

    rank = lax.axis_index(cfg.axis_name)
    dq, dk, dv, halo_grads = lax.switch(rank, [functools.partial(branch, r) for r in range(cfg.size)],
                                        dout, q, k, v, out, lse, tails, heads)
    grads = [dk, dv]
    for i in range(2):
        for side, bufs in enumerate((tails, heads)):
            if bufs is None:
                continue
            own = lax.psum_scatter(halo_grads[i][side], cfg.axis_name, scatter_dimension=0)  # [2, B, T, H, D]
            t = own.shape[2]
            lo = chunk - t if side == 0 else 0
            for slot in range(2):
                grads[i] = grads[i].at[:, slot * chunk + lo:slot * chunk + lo + t].add(own[slot])
    return dq, grads[0].astype(k.dtype), grads[1].astype(v.dtype)


# --- the differentiable function ----------------------------------------------------------

def _fwd_any(cfg: RingConfig, q, k, v):
    return (_halo_forward if cfg.halo else _ring_forward)(cfg, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: RingConfig, q, k, v):
    return _fwd_any(cfg, q, k, v)[0]


def _ring_fwd(cfg: RingConfig, q, k, v):
    out, lse = _fwd_any(cfg, q, k, v)
    return out, tuple(checkpoint_name(x, n) for x, n in zip((q, k, v, out, lse), RESIDUAL_NAMES))


def _ring_bwd(cfg: RingConfig, res, dout):
    return (_halo_backward if cfg.halo else _ring_backward)(cfg, dout, *res)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _window(causal, window_size):
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    ok = lambda w: w is None or (isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0)  # noqa: E731
    if not (isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(map(ok, window_size))):
        raise ValueError(f"window_size: expected (left, right), each a non-negative int or None; got {window_size!r}")
    causal, left, right = canonical_mask(causal, *(None if w is None else int(w) for w in window_size))
    if (left is None) != (right is None):
        raise NotImplementedError(f"ring_attention: window_size={tuple(window_size)} (causal={causal}) has one "
                                  "unbounded side; supported are global attention (causal or not) and windows "
                                  "with both sides finite, e.g. (w, 0) for causal sliding")
    return causal, (left, right)


def _family(family, d: int, dv: int, sliding: bool, kernel_rules: bool) -> str:
    if family is not None:
        if family not in ("ffpa", "fa4"):
            raise ValueError(f"family: expected 'ffpa', 'fa4' or None, got {family!r}")
        return family
    family = family_for(d, dv, sliding=sliding)
    if family is None and kernel_rules:
        raise NotImplementedError(f"head dims {d}/{dv}: no xattn kernel (FFPA: 320-512 step 16, no windows; FA4: "
                                  f"{', '.join(f'{a}/{b}' for a, b in FA4_HEAD_DIMS)}); pass backend='reference'")
    return family or "fa4"


def ring_attention(q, k, v, *, axis_name, causal: bool = True, scale: float | None = None,
                   window_size: tuple = (None, None), family: str | None = None, backend: str = "auto"):
    """Context-parallel attention inside ``jax.shard_map``; returns the local out ``[B, 2L, Hq, Dv]``.

    q ``[B, 2L, Hq, D]``, k/v ``[B, 2L, Hkv, D/Dv]``: this device's dual-chunk shard along
    ``axis_name`` (see :func:`shard_sequence`). The result is the local shard of attention on
    the global sequence: K/V ring for ``window_size=(None, None)`` (causal or not), halo
    exchange for windows with both sides finite (causal + left window = ``(left, 0)``).
    ``scale`` defaults to 1/sqrt(D); ``family`` to FFPA for D 320-512 (global only) and FA4
    for D <= 256. Differentiable (``custom_vjp`` whose backward uses the merged out/lse);
    works under jit, grad and remat (residuals tagged ``xattn_*``).
    """
    check_dense(q, k, v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:  # the shard layout first; the core validates the rest
        raise ValueError(f"q, k, v: expected rank 4 [B, 2L, H, D] (a dual-chunk shard), got {q.shape}, {k.shape}, "
                         f"{v.shape}")
    if q.shape[1] != k.shape[1] or q.shape[1] % 2 or q.shape[1] == 0:
        raise ValueError(f"q, k: expected the same even local length 2L > 0 (dual-chunk shard), got "
                         f"{q.shape[1]} and {k.shape[1]}")
    causal, window = _window(causal, window_size)
    kernel_rules = backend != "reference"  # "auto" off-GPU refuses what the kernels would (see Config)
    backend = resolve_backend(backend)
    family = _family(family, q.shape[-1], v.shape[-1], window != (None, None), kernel_rules)
    try:
        size = lax.axis_size(axis_name)
    except NameError:
        raise ValueError(f"axis_name={axis_name!r} is not a mapped axis here: call ring_attention inside "
                         "jax.shard_map over that mesh axis") from None
    scale = static_scale(scale, q.shape[-1])  # the core's one scale check, under jax.nn's name
    cfg = RingConfig(axis_name, int(size), family, scale, causal, window, backend, kernel_rules)
    if kernel_rules:  # refuse unsupported kernels before any collective is traced
        for direction in ("fwd", "bwd"):
            cfg.attn(causal, window).spec(direction, q, k, v)
    return _ring(cfg, q, k, v)
