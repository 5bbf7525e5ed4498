"""Context parallelism for torch: ring attention over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

Glossary: P ranks in ``group``, r this rank, N the global sequence length (N % 2P == 0),
L = N / 2P one chunk, B batch, Hq/Hkv heads, D/Dv head dims.

**Layout** (load-balanced "dual chunk", TransformerEngine's and ring-flash-attention's zigzag):
the sequence is cut into 2P chunks and rank r holds chunks ``r`` and ``2P-1-r``, concatenated
along the sequence dim, so every rank does the same causal work. :func:`shard_sequence` /
:func:`unshard_sequence` / :func:`sequence_positions` convert; tensors passed to
:func:`ring_attention` are the local ``[B, 2L, H, D]`` shards.

**Global attention** (causal or not): K/V blocks travel the ring (``batch_isend_irecv``, one
send and one receive per step on NCCL's stream) while the kernel runs on the block already
here; partial results merge in fp32 by the log-sum-exp rule. Under causality step 0 is the
local causal block and every later step is one unmasked half-block (all local queries on the
first chunk of an earlier rank, or the second local chunk on all of a later rank). The
backward runs the low-level backward on the **merged** out/lse per block; dK/dV accumulators
(fp32) travel with their block and arrive back at their owner after the last step.

**Sliding windows** (both sides finite, e.g. causal with a left window): no ring. Each chunk
needs only the ``left`` keys before it and the ``right`` after it, so ranks all-gather the
chunk edges once (a halo exchange) and each chunk runs the windowed kernel on
``[left halo, chunk, right halo]``; halo gradients are summed back to their owners with one
all-reduce.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from xattn.core.ring_layout import causal_ring_source, chunk_length, chunks_of, edge_widths, halo_plan
from xattn.core.spec import canonical_mask

from . import ops
from .attention import default_family

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "sequence_positions"]


# --- layout helpers ------------------------------------------------------------------------

def _world(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def shard_sequence(x: torch.Tensor, group=None, *, dim: int = 1, rank: int | None = None,
                   world_size: int | None = None) -> torch.Tensor:
    """This rank's load-balanced shard of a full sequence: chunks ``r`` and ``2P-1-r`` of ``x``
    along ``dim`` (2P equal chunks), concatenated (a new tensor). ``rank``/``world_size``
    default to ``group``'s; pass both to shard without an initialised process group."""
    if rank is None or world_size is None:
        rank, world_size = _world(group)
    chunk = chunk_length(x.shape[dim], world_size, "shard_sequence")
    a, b = chunks_of(world_size, rank)
    return torch.cat([x.narrow(dim, a * chunk, chunk), x.narrow(dim, b * chunk, chunk)], dim=dim)


class _AllGather(torch.autograd.Function):
    """``[P, *x.shape]`` from every rank's ``x``; the gradient of ``x`` is the sum over ranks of theirs for it."""

    @staticmethod
    def forward(ctx, x, group):
        rank, world_size = _world(group)
        out = x.new_empty((world_size, *x.shape))
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
        ctx.group, ctx.rank = group, rank
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None


def unshard_sequence(x: torch.Tensor, group=None, *, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (an all-gather, differentiable: the gradient of a
    rank's shard is the sum over ranks of their gradients for it). Inverse of :func:`shard_sequence`."""
    _, world_size = _world(group)
    parts = _AllGather.apply(x, group).unbind(0)
    chunks = [None] * (2 * world_size)
    for r, part in enumerate(parts):
        a, b = chunks_of(world_size, r)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def sequence_positions(seqlen: int, group=None, *, rank: int | None = None, world_size: int | None = None,
                       device=None) -> torch.Tensor:
    """Global positions (int64 ``[seqlen / P]``) of this rank's shard of a length-``seqlen``
    sequence: the ``position_ids`` for rotary embeddings of a sharded model."""
    positions = torch.arange(seqlen, device=device)
    return shard_sequence(positions, group, dim=0, rank=rank, world_size=world_size)


# --- partial results -----------------------------------------------------------------------

def merge_partial(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Merge one partial attention result into the running one, in place (log-sum-exp rule).

    ``out`` fp32 ``[B, N, H, Dv]`` and ``lse`` fp32 ``[B, H, N]`` accumulate; ``part_out``/``part_lse``
    cover the same rows. Rows no key reached on either side stay out 0 / lse -inf (no NaN).
    """
    new_lse = torch.logaddexp(lse, part_lse)
    seen = torch.isfinite(new_lse)
    safe = torch.where(seen, new_lse, torch.zeros_like(new_lse))
    w_old = torch.where(seen, torch.exp(lse - safe), torch.zeros_like(lse)).transpose(1, 2).unsqueeze(-1)
    w_new = torch.where(seen, torch.exp(part_lse - safe), torch.zeros_like(lse)).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(part_out.float() * w_new)
    lse.copy_(new_lse)


# --- point-to-point ring step ---------------------------------------------------------------

class _RingStep:
    """Send tensors to the next rank and receive same-shaped ones from the previous rank, async."""

    def __init__(self, group, tensors):
        rank, world_size = _world(group)
        nxt = dist.get_global_rank(group, (rank + 1) % world_size) if group is not None else (rank + 1) % world_size
        prv = dist.get_global_rank(group, (rank - 1) % world_size) if group is not None else (rank - 1) % world_size
        self.received = [torch.empty_like(t) for t in tensors]
        ops_ = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
        ops_ += [dist.P2POp(dist.irecv, t, prv, group) for t in self.received]
        self._works = dist.batch_isend_irecv(ops_)

    def wait(self):
        for w in self._works:
            w.wait()
        return self.received


# --- the kernels on one block ---------------------------------------------------------------

class _Params:
    """Static options of one ring call: family, scale, window (launcher convention: -1 unbounded)."""

    def __init__(self, family, scale, causal, left, right):
        self.family, self.scale, self.causal = family, scale, causal
        self.left, self.right = left, right

    def fwd(self, q, k, v, causal, left=-1, right=-1):
        return ops.forward_impl(q, k, v, self.family, self.scale, causal, left, right, None, None, 0, 0)

    def bwd(self, dout, q, k, v, out, lse, causal, left=-1, right=-1):
        return ops.backward_impl(dout, q, k, v, out, lse.contiguous(), self.family, self.scale, causal, left, right,
                             None, None, 0, 0)


def _ring_blocks(rank: int, world_size: int, step: int, causal: bool, chunk: int):
    """What step ``step`` computes: ``(q_rows, kv_rows, causal)`` as slices of the local q and of
    the held K/V block (from rank ``(rank - step) % P``)."""
    full = slice(None)
    if step == 0:
        return full, full, causal
    if not causal:
        return full, full, False
    _, earlier = causal_ring_source(rank, world_size, step)
    if earlier:  # the held block's first chunk precedes both local chunks; its second follows both
        return full, slice(0, chunk), False
    return slice(chunk, None), full, False  # only the local second chunk follows anything of a later rank


def _ring_forward(p: _Params, group, q, k, v):
    rank, world_size = _world(group)
    chunk = q.shape[1] // 2
    b, n, hq, _ = q.shape
    out = q.new_zeros((b, n, hq, v.shape[-1]), dtype=torch.float32)
    lse = q.new_full((b, hq, n), float("-inf"), dtype=torch.float32)
    kv = (k, v)
    for step in range(world_size):
        pending = _RingStep(group, kv) if step + 1 < world_size else None
        rows, cols, causal = _ring_blocks(rank, world_size, step, p.causal, chunk)
        part_out, part_lse = p.fwd(q[:, rows], kv[0][:, cols], kv[1][:, cols], causal)
        merge_partial(out[:, rows], lse[:, :, rows], part_out, part_lse)  # views: merged in place
        if pending is not None:
            kv = tuple(pending.wait())
    return out.to(q.dtype), lse


def _ring_backward(p: _Params, group, dout, q, k, v, out, lse):
    rank, world_size = _world(group)
    chunk = q.shape[1] // 2
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv, dkv, dkv_pending = (k, v), None, None
    for step in range(world_size):
        pending = _RingStep(group, kv) if step + 1 < world_size else None
        rows, cols, causal = _ring_blocks(rank, world_size, step, p.causal, chunk)
        dq_b, dk_b, dv_b = p.bwd(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows],
                                 lse[:, :, rows], causal)
        dq[:, rows] += dq_b
        if dkv_pending is None:
            dkv = [torch.zeros_like(kv[0], dtype=torch.float32), torch.zeros_like(kv[1], dtype=torch.float32)]
        else:
            dkv = dkv_pending.wait()
        dkv[0][:, cols] += dk_b
        dkv[1][:, cols] += dv_b
        if world_size > 1:  # on to the next rank; after the last step, home to its owner
            dkv_pending = _RingStep(group, dkv)
        if pending is not None:
            kv = tuple(pending.wait())
    dk, dv = dkv_pending.wait() if world_size > 1 else dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- sliding windows: the halo exchange -------------------------------------------------------

class _Halo:
    """This rank's view of the halo exchange (:mod:`xattn.core.ring_layout`): edges of width
    ``tail``/``head`` of every chunk, gathered from all ranks as ``[P, 2, B, width, H, D]``
    (slot 0/1 = a rank's first/second chunk)."""

    def __init__(self, rank, world_size, chunk, left, right):
        self.rank, self.world_size, self.chunk = rank, world_size, chunk
        self.tail, self.head = edge_widths(chunk, left, right)
        self.left, self.right = left, right

    def plan(self, c: int):
        return halo_plan(c, self.world_size, self.chunk, self.left, self.right)


def _gather_edges(group, x, halo: _Halo):
    """``(tails, heads)`` of every chunk on every rank: ``[P, 2, B, width, H, D]`` each (or None)."""
    chunk = halo.chunk
    out = []
    for width, start in ((halo.tail, chunk - halo.tail), (halo.head, 0)):
        if width == 0:
            out.append(None)
            continue
        mine = torch.stack([x[:, start:start + width], x[:, chunk + start:chunk + start + width]])
        buf = x.new_empty((halo.world_size, *mine.shape))
        dist.all_gather(list(buf.unbind(0)), mine.contiguous(), group=group)
        out.append(buf)
    return out


def _extended(x, slot, edges, plan):
    """``[before halo, own chunk, after halo]`` of ``x`` for one local slot."""
    tails, heads = edges
    chunk = x.shape[1] // 2
    parts = [tails[r, s, :, a:b] for r, s, a, b in plan.before] + [x[:, slot * chunk:(slot + 1) * chunk]]
    return torch.cat(parts + [heads[r, s, :, a:b] for r, s, a, b in plan.after], dim=1)


def _halo_forward(p: _Params, group, q, k, v):
    rank, world_size = _world(group)
    halo = _Halo(rank, world_size, q.shape[1] // 2, p.left, p.right)
    k_edges, v_edges = _gather_edges(group, k, halo), _gather_edges(group, v, halo)
    outs, lses = [], []
    for slot, c in enumerate(chunks_of(world_size, rank)):
        plan = halo.plan(c)
        o, l_ = p.fwd(q[:, slot * halo.chunk:(slot + 1) * halo.chunk], _extended(k, slot, k_edges, plan),
                      _extended(v, slot, v_edges, plan), False, *plan.window(p.left, p.right))
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _halo_backward(p: _Params, group, dout, q, k, v, out, lse):
    rank, world_size = _world(group)
    halo = _Halo(rank, world_size, q.shape[1] // 2, p.left, p.right)
    chunk = halo.chunk
    k_edges, v_edges = _gather_edges(group, k, halo), _gather_edges(group, v, halo)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    # gradients for every rank's chunk edges, summed over ranks: [tails/heads][k/v] of [P, 2, B, w, H, D]
    edge_grads = [[None if e is None else torch.zeros_like(e, dtype=torch.float32) for e in edges]
                  for edges in zip(k_edges, v_edges)]
    for slot, c in enumerate(chunks_of(world_size, rank)):
        rows = slice(slot * chunk, (slot + 1) * chunk)
        plan = halo.plan(c)
        hl = plan.left_len
        dq_c, dk_ext, dv_ext = p.bwd(dout[:, rows], q[:, rows], _extended(k, slot, k_edges, plan),
                                     _extended(v, slot, v_edges, plan), out[:, rows], lse[:, :, rows], False,
                                     *plan.window(p.left, p.right))
        dq[:, rows] = dq_c
        dk[:, rows] += dk_ext[:, hl:hl + chunk]
        dv[:, rows] += dv_ext[:, hl:hl + chunk]
        pos = 0
        for side, spans in ((0, plan.before), (None, None), (1, plan.after)):
            if side is None:
                pos += chunk
                continue
            for r, s, a, b in spans:
                for which, g in ((0, dk_ext), (1, dv_ext)):
                    edge_grads[side][which][r, s, :, a:b] += g[:, pos:pos + b - a]
                pos += b - a
    for side, start in ((0, chunk - halo.tail), (1, 0)):
        width = halo.tail if side == 0 else halo.head
        for which, acc in ((0, dk), (1, dv)):
            g = edge_grads[side][which]
            if g is None:
                continue
            dist.all_reduce(g, group=group)
            acc[:, start:start + width] += g[rank, 0]
            acc[:, chunk + start:chunk + start + width] += g[rank, 1]
    return dq, dk.to(k.dtype), dv.to(v.dtype)


# --- the differentiable function --------------------------------------------------------------

class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, params, group, halo):
        run = _halo_forward if halo else _ring_forward
        out, lse = run(params, group, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params, ctx.group, ctx.halo = params, group, halo
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        run = _halo_backward if ctx.halo else _ring_backward
        dq, dk, dv = run(ctx.params, ctx.group, dout.contiguous(), q, k, v, out, lse)
        return dq, dk, dv, None, None, None


def _check(q, k, v):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v: expected rank 4 [B, N_local, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.shape[:2] == k.shape[:2] == v.shape[:2]) or k.shape[2] != v.shape[2]:
        raise ValueError(f"q, k, v: the local shards must share B and N_local, k/v their heads; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % 2 or q.shape[1] == 0:
        raise ValueError(f"q: the local sequence length must be even and > 0 (two chunks), got {q.shape[1]}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v: expected one device, got {q.device}, {k.device}, {v.device}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = True,
                   softmax_scale: float | None = None, window_size=(None, None),
                   family: str | None = None) -> torch.Tensor:
    """Attention over a sequence sharded across ``group`` (context parallelism), differentiable.

    q ``[B, N_local, Hq, D]``, k/v ``[B, N_local, Hkv, D/Dv]``: this rank's shard in the
    load-balanced layout of :func:`shard_sequence` (N_local = 2 chunks of the global N / 2P).
    Returns out ``[B, N_local, Hq, Dv]`` (q's dtype) for the same rows. ``causal`` and
    ``window_size=(left, right)`` (``None`` or ``-1`` = unbounded) act on global positions, as in
    :func:`xattn.torch.attention` with Nq == Nk; a window needs both sides finite (causal
    counts as right 0). ``softmax_scale`` defaults to 1/sqrt(D); ``family`` to the head dim's.

    Every rank must call it with the same options and shapes. Memory beyond the output: one
    received K/V block, fp32 out/lse accumulators (forward) and fp32 dQ plus travelling fp32
    dK/dV (backward). Not traceable by torch.compile (collectives run eagerly): compile around it.
    """
    _check(q, k, v)
    causal, left, right = canonical_mask(bool(causal), *window_size)
    if (left is None) != (right is None):
        raise NotImplementedError(f"ring_attention: window_size {tuple(window_size)} with one unbounded side is "
                                  "not supported; use causal=True, a window with both sides finite, or none")
    family = family or default_family(q.shape[-1], v.shape[-1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    halo = left is not None
    if halo and family != "fa4":  # before any collective: every rank refuses alike
        raise NotImplementedError(f"ring_attention: window_size {tuple(window_size)} needs a sliding-window kernel; "
                                  f"{family} (head_dim {q.shape[-1]}) has none (FA4 serves head_dim <= 256)")
    params = _Params(family, scale, causal, -1 if left is None else int(left), -1 if right is None else int(right))
    if not dist.is_initialized():
        raise RuntimeError("ring_attention: torch.distributed is not initialised (call init_process_group)")
    return _RingAttention.apply(q, k, v, params, group, halo)
