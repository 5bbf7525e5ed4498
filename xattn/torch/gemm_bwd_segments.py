"""Torch driver of the segmented GEMM backward: a packed self-attention batch's d512 backward with one
GEMM per row block over every document.

The grouped route (:func:`xattn.torch.gemm_bwd.gemm_backward_varlen`) pads documents of similar length
into dense batches: a mix of lengths becomes many small batches, each with its own launches. Here
each row block c of :func:`xattn.core.gemm_bwd_plan.segment_plan` is five launches over every (KV head,
document) piece with rows in it (:mod:`xattn.core.gemm_segments_sm90`, the launchers :mod:`xattn.jax`
runs under ``jit``). The document lengths are host ints here, so the per-piece tables
(:func:`xattn.core.gemm_bwd_plan.segment_block_tables`) are built with NumPy, every launch's in one
pinned asynchronous copy, and each launch's scratch holds exactly its pieces' rows. Layouts (built
once per call): query side ``[Hkv, T, g, D]`` (a KV head's query heads stacked per token; q itself
when Hkv == 1), key side ``[Hkv, T + spare, D]``, fp32 dK/dV accumulators ``[Hkv, acc_rows, D]`` with
each document at a multiple of 256 rows. Scratch: :func:`xattn.core.gemm_bwd_plan.segment_workspace_bytes`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from xattn.core import gemm_bwd_plan as plan_mod

from .gemm_bwd import LOG2E, copy_words, default_gemms, launchable_in_place, row_bias, row_delta

__all__ = ["gemm_backward_segments"]

_ALIGN = 8  # every launch's slice of the uploaded tables and row vectors starts 32 bytes in (TMA: 16)


class _HostTables:
    """int32 host arrays packed at :data:`_ALIGN`-element offsets, sent to the GPU in one copy."""

    def __init__(self):
        self.parts, self.size = [], 0

    def add(self, x: np.ndarray) -> int:
        x = np.ascontiguousarray(x, dtype=np.int32).reshape(-1)
        offset, pad = self.size, -x.size % _ALIGN
        self.parts += [x, np.zeros(pad, np.int32)]
        self.size += x.size + pad
        return offset

    def upload(self, device) -> Tensor:
        host = torch.from_numpy(np.concatenate(self.parts))
        return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def _query_side(x: Tensor, hkv: int) -> Tensor:
    """``[T, Hq, D]`` -> ``(Hkv·T·g, D)``: row ``(h·T + t)·g + i`` is token t of query head ``h·g + i``
    (``x`` itself where that is its layout and the launchers can read it in place)."""
    t, hq, d = x.shape
    g = hq // hkv
    if hkv == 1 and x.is_contiguous() and launchable_in_place(x):
        return x.view(t * g, d)
    side = torch.empty(hkv, t, g, d, device=x.device, dtype=x.dtype)
    copy_words(side, x.unflatten(1, (hkv, g)).transpose(0, 1))
    return side.view(-1, d)


def _row_vector(x: Tensor, hkv: int) -> Tensor:
    """``[Hq, T]`` fp32 -> the query side's row order, contiguous."""
    hq, t = x.shape
    return x.reshape(hkv, hq // hkv, t).transpose(1, 2).reshape(-1).contiguous()


def gemm_backward_segments(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seqlens, *,
                           softmax_scale: float, causal: bool, gemms=None, rows: int | None = None,
                           budget: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """dq ``[T, Hq, D]``, dk/dv ``[Tk, Hkv, D]`` of a packed self-attention call from its out/lse: q/dout/out
    ``[T, Hq, D]``, k/v ``[Tk, Hkv, D]`` (the documents end within both), lse fp32 ``[Hq, T]``; document i
    holds rows (queries and keys) ``sum(seqlens[:i]) + [0, seqlens[i])`` (host ints, causal within each
    document). Rows past the last document get zero gradients. ``gemms``:
    :class:`xattn.torch.gemm_bwd.CoreGemms` (default: the core's launchers on q's GPU); ``rows`` /
    ``budget``: :func:`xattn.core.gemm_bwd_plan.segment_plan`'s."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    g, dev, dt = Hq // Hkv, q.device, q.dtype
    lens = np.asarray([int(n) for n in seqlens], np.int64)
    if (lens < 0).any() or lens.sum() > min(T, k.shape[0]):
        raise ValueError(f"documents {lens.tolist()} over {T} queries and {k.shape[0]} keys: the segmented "
                         f"backward takes self-attention documents within the packed rows")
    if k.shape[0] != T:  # rows past the last document belong to none: the key side takes the query side's count
        tk = k.shape[0]
        fit = (lambda x: x[:T]) if tk > T else (lambda x: torch.cat([x, x.new_zeros(T - tk, *x.shape[1:])]))
        dq, dk, dv = gemm_backward_segments(dout, q, fit(k), fit(v), out, lse, lens.tolist(), gemms=gemms, rows=rows,
                                            softmax_scale=softmax_scale, causal=causal, budget=budget)
        refit = (lambda x: torch.cat([x, x.new_zeros(tk - T, *x.shape[1:])])) if tk > T else (lambda x: x[:tk])
        return dq, refit(dk), refit(dv)
    used = int(lens.sum())
    if used == 0:
        return tuple(torch.zeros(T, h, D, device=dev, dtype=dt) for h in (Hq, Hkv, Hkv))
    gemms = default_gemms(gemms, q)
    p = plan_mod.segment_plan(T, len(lens), int(lens.max()), Hq, Hkv, causal, budget=budget, rows=rows)
    R, spare, acc_rows = p.rows, p.spare_keys, p.acc_rows
    cu = np.concatenate([[0], np.cumsum(lens)])
    lens_, starts, acc_starts = plan_mod.segment_offsets(np, cu)

    # host: every launch's tables and the per-piece values its rows are expanded from (on the GPU)
    host, launches, pieces = _HostTables(), [], []  # pieces: (first row, count, query row, row position)
    row_at = 0
    for first, count in p.head_groups:
        heads = np.arange(first, first + count)
        for c, (kend, _) in enumerate(p.blocks):
            tables, cu_rows = plan_mod.segment_block_tables(np, lens_, starts, acc_starts, heads, c, R, kend, T,
                                                            spare, acc_rows, g)
            m = int(cu_rows[-1])
            if m == 0:
                continue
            n = np.diff(cu_rows)
            pos = np.repeat(c * R, n.size) if causal else np.tile(lens_ - 1, count)
            pieces.append((row_at + cu_rows[:-1], n, tables[0, :-1], pos))
            launches.append((kend, m, row_at, host.add(tables), host.add(cu_rows), tables.shape[1]))
            row_at += m + (-m % _ALIGN)
            if m % _ALIGN:  # the padding rows up to the next launch: a piece over query rows 0, 1, ...
                pad = -m % _ALIGN
                pieces.append((np.array([row_at - pad]), np.array([pad]), np.zeros(1, np.int64), np.zeros(1, np.int64)))
    firsts, counts, qrows, poss = (np.concatenate(x) for x in zip(*pieces))
    acc_row = np.zeros(T, np.int64)  # each token's row in its document's accumulator rows
    doc = np.repeat(np.arange(len(lens)), lens)
    acc_row[:used] = acc_starts[doc] + np.arange(used) - starts[doc]
    offs = [host.add(x) for x in (firsts, counts, qrows, poss, acc_row)]
    buf = host.upload(dev)
    n_pieces = firsts.size
    firsts_d, counts_d, qrows_d, poss_d = (buf[o:o + n_pieces] for o in offs[:4])
    acc_row_d = buf[offs[4]:offs[4] + T]

    # per row of every launch: its query-side row, and its last visible key's position (causal: the
    # block's first row's position plus the row's token offset in its piece; else the document's end)
    piece_of = torch.repeat_interleave(torch.arange(n_pieces, device=dev), counts_d, output_size=row_at)
    within = torch.arange(row_at, device=dev) - firsts_d.long()[piece_of]
    qrow = (qrows_d.long()[piece_of] + within).clamp_(max=Hkv * T * g - 1)  # padding rows past a tiny batch
    rowpos = (poss_d.float()[piece_of] + (within // g).float()) if causal else poss_d.float()[piece_of]
    del piece_of, within

    qr, dor = _query_side(q, Hkv), _query_side(dout, Hkv)
    kr, vr = (torch.empty(Hkv, T + spare, D, device=dev, dtype=dt) for _ in range(2))
    for side, x in ((kr, k), (vr, v)):
        copy_words(side[:, :T], x.transpose(0, 1))
        side[:, T:].zero_()  # the key view of the last document reads up to `spare` rows past it
    kr, vr = kr.view(-1, D), vr.view(-1, D)
    rowbias = _row_vector(row_bias(lse.float()), Hkv)[qrow]
    delta = _row_vector(row_delta(dout[None], out[None])[0], Hkv)[qrow]
    colpos = torch.arange(spare, device=dev, dtype=torch.float32)
    dq_side = torch.empty(Hkv, T, g * D, device=dev, dtype=dt)
    dq_side[:, used:].zero_()  # every row of a document is written by its blocks
    dq_side = dq_side.view(-1, D)
    dk_acc, dv_acc = (torch.zeros(Hkv * acc_rows, D, device=dev, dtype=torch.float32) for _ in range(2))
    scores = max(m * kend for kend, m, *_ in launches)
    p_buf, ds_buf = (torch.empty(scores, device=dev, dtype=dt) for _ in range(2))
    pf_buf = torch.empty(scores, device=dev, dtype=torch.float16)
    scale_log2 = softmax_scale * LOG2E
    for kend, m, r0, t_off, c_off, p1 in launches:
        tables, cu_rows = buf[t_off:t_off + 4 * p1].view(4, p1), buf[c_off:c_off + p1]
        pb, pf, ds = (x[:m * kend].view(m, kend) for x in (p_buf, pf_buf, ds_buf))
        rb, rp, dl = rowbias[r0:r0 + m], rowpos[r0:r0 + m], delta[r0:r0 + m]
        gemms.seg_probs(qr, kr, tables, cu_rows, rb, rp, colpos, pb, pf, scale_log2)
        gemms.seg_grad_scores(dor, vr, tables, cu_rows, pf, dl, ds, softmax_scale)
        gemms.seg_mm_dq(ds, kr, tables, cu_rows, dq_side)
        gemms.seg_acc(pb, dor, tables, cu_rows, dv_acc)
        gemms.seg_acc(ds, qr, tables, cu_rows, dk_acc)
    dk, dv = (torch.empty(T, Hkv, D, device=dev, dtype=dt) for _ in range(2))
    for dst, acc in ((dk, dk_acc), (dv, dv_acc)):
        dst[used:].zero_()
        dst[:used].copy_(acc.view(Hkv, acc_rows, D).index_select(1, acc_row_d[:used]).transpose(0, 1))
    if Hkv == 1:
        return dq_side.view(T, Hq, D), dk, dv
    dq = torch.empty(T, Hq, D, device=dev, dtype=dt)
    copy_words(dq.view(T, Hkv, g, D), dq_side.view(Hkv, T, g, D).transpose(0, 1))
    return dq, dk, dv
