"""Torch driver of the chunked-GEMM backward (see :mod:`xattn.core.gemm_bwd_plan` for the math).

:func:`gemm_backward` takes dense ``[B, N, H, D]`` tensors and returns ``(dq, dk, dv)``, contiguous,
in q's dtype. The layout glue (query rows of a KV head's query heads stacked per block, δ,
fp32 -> 16-bit) runs as torch ops; the five GEMMs per block are the core's fixed-signature quack
launchers (:mod:`xattn.core.gemm_sm90`, the same ones :mod:`xattn.jax` calls through XLA FFI), called
on torch's current stream with torch views: whole K/V and whole fp32 dK/dV accumulators (the
launchers read the block's prefix in place), P/dS as ``kend``-wide views of one block buffer,
and the last block writes dk/dv straight into their ``[B, Nk, Hkv, D]`` layout. With B == 1,
K/V are read in place, and without GQA so are q/dout and dq is written in place (no copies).
Scratch: :func:`xattn.core.gemm_bwd_plan.workspace_bytes`.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

from xattn.core import gemm_bwd_plan as plan_mod

__all__ = ["gemm_backward", "gemm_backward_varlen", "gemm_backward_equal_documents", "CoreGemms", "copy_words",
           "default_gemms", "launchable_in_place", "row_bias", "row_delta"]

LOG2E = 1.4426950408889634
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _core_launcher(spec):
    from xattn.core.cache import get_launcher

    return get_launcher(spec).function


class CoreGemms:
    """The GEMM steps of a block on the core's launchers (:mod:`xattn.core.gemm_sm90`), in their
    parameter order: inputs, outputs, scalar, ``max_active_clusters``.

    ``launcher(spec) -> callable`` defaults to the compiled launcher of the core cache (tests pass
    stand-ins). ``num_sms`` is the GPU's SM count (it sizes the persistent schedule). ``tiles``:
    ``{kind: (M, N)}`` for launchers of another tile than the kind's default
    (:class:`xattn.core.gemm_sm90.GemmSpec`). ``p_dtype``: the dtype of the copy of P that dS is
    formed from (``"float16"``, the default, or ``"float32"``; :data:`xattn.core.gemm_sm90.P_DTYPES`),
    also :attr:`p_dtype` as a torch dtype for the driver's buffer. The block plan and the memory bound
    (:func:`xattn.core.gemm_bwd_plan.workspace_bytes`) count the default's 2 bytes; fp32 (for A/Bs) takes
    2 more per score of a block."""

    def __init__(self, dtype: torch.dtype, num_sms: int, launcher=None, tiles=None, p_dtype: str | None = None):
        from xattn.core.gemm_sm90 import P_DTYPES, max_active_clusters

        if dtype not in _DTYPES:
            raise ValueError(f"the GEMM backward runs float16/bfloat16, got {dtype}")
        self._dtype, self._clusters = _DTYPES[dtype], max_active_clusters(num_sms)
        self._launcher = launcher or _core_launcher
        self._tiles = dict(tiles or {})  # kind -> (M, N) tile; the launchers' default elsewhere
        self._p_dtype = P_DTYPES[0] if p_dtype is None else p_dtype
        if self._p_dtype not in P_DTYPES:
            raise ValueError(f"p_dtype={p_dtype!r}: expected one of {P_DTYPES}")
        self.p_dtype = getattr(torch, self._p_dtype)
        self._fns: dict = {}

    def _fn(self, kind: str, d32: bool = False):
        fn = self._fns.get((kind, d32))
        if fn is None:
            from xattn.core.gemm_sm90 import P_DTYPES, P_KINDS, GemmSpec

            p_dtype = self._p_dtype if kind in P_KINDS else P_DTYPES[0]
            spec = GemmSpec(kind, self._dtype, d32, self._tiles.get(kind), p_dtype)
            fn = self._fns[kind, d32] = self._launcher(spec)
        return fn

    def probs(self, q, keys, p, pf, rowbias, rowpos, colpos, scale_log2: float, causal: bool) -> None:
        """``p`` (q's dtype) and ``pf`` (:attr:`p_dtype`) ``(L, M, n)`` = P of ``q (L, M, D)`` against
        the first n rows of ``keys``."""
        if causal:
            self._fn("probs_causal")(q, keys, rowbias, rowpos, colpos, p, pf, scale_log2, self._clusters)
        else:
            self._fn("probs_full")(q, keys, rowbias, p, pf, scale_log2, self._clusters)

    def grad_scores(self, dout, values, ds, pf, delta, scale: float) -> None:
        """``ds (L, M, n) = (dout · values[:, :n]ᵀ − δ) ⊙ pf · scale``."""
        self._fn("grad_scores")(dout, values, pf, delta, ds, scale, self._clusters)

    def add_into(self, x, y, acc, rows_set: int) -> None:
        """``acc[:, :m] = xᵀ y + acc[:, :m]`` in place (x ``(L, K, m)``, acc fp32 ``(L, >= m, N)``), where
        only acc's first ``rows_set`` rows hold values: the rest are taken as 0, never read."""
        m = x.shape[2]
        if rows_set <= 0:
            self._fn("mm_kv", True)(x, y, acc, self._clusters)
        else:
            self._fn("acc", True)(x, y, acc, acc, min(rows_set, m), self._clusters)

    def add_to(self, x, y, c, out, rows_set: int) -> None:
        """``out = xᵀ y + c`` (c fp32, out 16-bit, the same ``(L, m, N)``); c's rows from ``rows_set``
        on are taken as 0, never read."""
        if rows_set <= 0:
            self._fn("mm_kv")(x, y, out, self._clusters)
        else:
            self._fn("acc")(x, y, c, out, min(rows_set, x.shape[2]), self._clusters)

    def mm_kv(self, x, y, out) -> None:
        """``out = xᵀ y``."""
        self._fn("mm_kv")(x, y, out, self._clusters)

    def mm_dq(self, x, y, out) -> None:
        """``out = x · y[:, :K]`` (x ``(L, M, K)``)."""
        self._fn("mm_dq")(x, y, out, self._clusters)

    # the packed route's launchers (xattn.core.gemm_segments_sm90): per piece of ``tables`` / ``cu_rows``

    def seg_probs(self, q, keys, tables, cu_rows, rowbias, rowpos, colpos, p, pf, scale_log2: float) -> None:
        """``p`` (q's dtype) and ``pf`` (fp16), ``(rows, kend)``: P of each piece's query rows against its
        document's first ``kend`` keys (causal by ``rowpos`` / ``colpos``)."""
        self._fn("seg_probs")(q, keys, tables, cu_rows, rowbias, rowpos, colpos, p, pf, scale_log2, self._clusters)

    def seg_grad_scores(self, dout, values, tables, cu_rows, pf, delta, ds, scale: float) -> None:
        """``ds (rows, kend) = (dout_rows · values_docᵀ − δ) ⊙ pf · scale`` per piece."""
        self._fn("seg_grad_scores")(dout, values, tables, cu_rows, pf, delta, ds, scale, self._clusters)

    def seg_mm_dq(self, ds, keys, tables, cu_rows, dq) -> None:
        """``dq_rows = ds · keys_doc`` per piece, in place (no other row of ``dq`` written)."""
        self._fn("seg_mm_dq")(ds, keys, tables, cu_rows, dq, dq, self._clusters)

    def seg_acc(self, x, y, tables, cu_rows, acc) -> None:
        """``acc_doc[:keys] += x_pieceᵀ y_rows`` per piece (fp32, in place)."""
        self._fn("seg_acc")(x, y, tables, cu_rows, acc, acc, self._clusters)


def _whole_words(x: Tensor) -> bool:
    """Whether 16-bit ``x`` can be viewed as 8-byte words: unit last stride, and the last dim, every
    other stride and the start multiples of 4 elements."""
    return (x.stride(-1) == 1 and x.shape[-1] % 4 == 0 and x.storage_offset() % 4 == 0
            and all(st % 4 == 0 for st in x.stride()[:-1]))


def copy_words(dst: Tensor, src: Tensor) -> None:
    """``dst.copy_(src)`` (one shape, one 16-bit dtype), moved as 8-byte words (4 elements each) where both
    allow it (:func:`_whole_words`). A strided permutation (the query side's heads regrouped) then copies a
    quarter as many elements: torch's strided copy moves 2-byte elements one at a time (H200: ~0.45 ms per
    512 MiB permuted, 5 such copies were 16 % of a packed d512 backward's GPU time on mix16k)."""
    if (dst.shape == src.shape and dst.dtype == src.dtype and dst.element_size() == 2 and _whole_words(dst)
            and _whole_words(src)):
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


def _rows_to_blocks(x: Tensor, hkv: int, rows: int, padded: int) -> Tensor:
    """``[B, N, Hq, D]`` (any strides) -> ``[B*Hkv, C, rows*g, D]``, GEMM row ``r*g + i`` = query
    row r of head ``kv*g + i``. Padded rows are zero."""
    b, n, hq, d = x.shape
    g, c = hq // hkv, padded // rows
    out = torch.empty(b, hkv, c, rows, g, d, device=x.device, dtype=x.dtype)
    rows_of = out.view(b, hkv, c * rows, g, d)  # (b, kv, row, i, d)
    copy_words(rows_of[:, :, :n], x.unflatten(2, (hkv, g)).permute(0, 2, 1, 3, 4))
    rows_of[:, :, n:].zero_()
    return out.view(b * hkv, c, rows * g, d)


def _blocks_to_rows(xp: Tensor, out: Tensor, rows: int) -> None:
    """Inverse of :func:`_rows_to_blocks` into ``out`` ``[B, N, Hq, D]`` (padded rows dropped)."""
    b, n, hq, d = out.shape
    hkv = xp.shape[0] // b
    g, c = hq // hkv, xp.shape[1]
    rows_of = xp.view(b, hkv, c * rows, g, d)
    copy_words(out.unflatten(2, (hkv, g)), rows_of[:, :, :n].permute(0, 2, 1, 3, 4))


def _keys_to_blocks(x: Tensor, padded: int) -> Tensor:
    """``[B, Nk, Hkv, D]`` -> ``[B*Hkv, padded, D]`` with zero rows from Nk on (the launchers' key
    operands and ``colpos`` share one length)."""
    b, n, h, d = x.shape
    out = torch.empty(b, h, padded, d, device=x.device, dtype=x.dtype)
    copy_words(out[:, :, :n], x.transpose(1, 2))
    out[:, :, n:].zero_()
    return out.view(b * h, padded, d)


def _vec_to_blocks(x: Tensor, hkv: int, rows: int, padded: int, fill: float) -> Tensor:
    """``[B, Hq, N]`` fp32 -> ``[B*Hkv, C, rows*g]`` in :func:`_rows_to_blocks`' row order
    (padded rows hold ``fill``); always row-contiguous, as quack's TMA needs."""
    b, hq, n = x.shape
    g, c = hq // hkv, padded // rows
    x = torch.nn.functional.pad(x, (0, padded - n), value=fill)  # may be x itself (no padding): any strides
    out = torch.empty(b, hkv, c, rows, g, device=x.device, dtype=x.dtype)
    out.copy_(x.reshape(b, hkv, g, c, rows).permute(0, 1, 3, 4, 2))
    return out.view(b * hkv, c, rows * g)


def row_delta(dout: Tensor, out: Tensor) -> Tensor:
    """``rowsum(dO ⊙ O)`` in fp32, ``[B, Hq, N]``, in slices of query rows whose temporaries stay
    within :data:`xattn.core.gemm_bwd_plan.DELTA_SLICE_BYTES`.

    CUDA: per query row one ``dO[b, n] · O[b, n]ᵀ`` (Hq x D x Hq, a batched GEMM with fp32 output),
    whose diagonal is δ: one read of dO and O, no fp32 copies of them. Elsewhere: fp32 products."""
    b, n, hq, d = out.shape
    delta = torch.empty(b, n, hq, device=out.device, dtype=torch.float32)
    # per query row: the Hq x Hq fp32 product and 16-bit copies of dO / O rows that a GEMM cannot
    # take as they are (CUDA), or two fp32 copies and their product (elsewhere)
    per_row = 4 * hq * hq + 4 * hq * d if out.is_cuda else 12 * hq * d
    step = max(1, plan_mod.DELTA_SLICE_BYTES // per_row)
    for i in range(b):
        for s in range(0, n, step):
            e = min(n, s + step)
            ds, os_ = dout[i, s:e], out[i, s:e]  # (rows, Hq, D) views
            if out.is_cuda:
                prod = torch.bmm(ds, os_.transpose(1, 2), out_dtype=torch.float32)
                delta[i, s:e] = prod.diagonal(dim1=1, dim2=2)
            else:
                delta[i, s:e] = (ds.float() * os_.float()).sum(-1)
    return delta.transpose(1, 2)


def launchable_in_place(x: Tensor) -> bool:
    """Whether ``x`` can cross to the launchers as it is: unit last stride, 16-byte aligned rows."""
    return x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(st % 8 == 0 for st in x.stride()[:-1])


def _heads_rows(x: Tensor) -> Tensor:
    """``[1, N, H, D]`` -> its ``(H, N, D)`` view (no copy)."""
    return x[0].transpose(0, 1)


def _run_blocks(gemms: CoreGemms, p, qp, dop, kp, vp, rowbias, delta, rowpos, colpos, dqp, g: int,
                masked: bool, softmax_scale: float, write_dkv, split_acc: bool = True) -> None:
    """The five GEMMs of every block of plan ``p`` over the GEMM-ready operands (see
    :func:`gemm_backward`; a block is ``g * p.rows`` GEMM rows, or fewer at the end of ``qp``): dq
    blocks into ``dqp``; ``write_dkv(gemms, a, b, p_rows, dout_rows, ds_rows, q_rows, dk_acc, dv_acc,
    rows_set)`` writes dk/dv keys ``[a, b)`` from the last block (P/dS cut to those keys; the
    accumulators are None with one block; their rows from ``a + rows_set`` on hold nothing yet).
    The fp32 dK/dV accumulators are never zeroed: a block's GEMMs read only the key rows earlier
    blocks wrote (``written``) and start the others. ``masked``: the probabilities mask by position
    (causal, or padded keys).

    Each block runs piece by piece along its causal diagonal (``p.pieces``): P, dS and dq of a piece
    stop at its own key limit. ``split_acc``: dK/dV are accumulated per key range too (keys between
    two pieces' limits take the rows of the later pieces only); otherwise P/dS past each piece's
    limit are zeroed and one GEMM per block takes them whole."""
    L, D, dt, dev = qp.shape[0], qp.shape[2], qp.dtype, qp.device
    C, nk8, block_rows = p.num_blocks, p.keys_stride, g * p.rows
    dk_acc = dv_acc = None
    if C > 1:  # fp32 accumulators of dk/dv over the blocks (one block writes dk/dv directly)
        dk_acc = torch.empty(L, p.blocks[-1][1], D, device=dev, dtype=torch.float32)  # as many rows as dk/dv
        dv_acc = torch.empty_like(dk_acc)
    written = 0  # the accumulators' first `written` key rows hold sums (blocks' key limits only grow)
    n_scores = L * block_rows * nk8
    p_buf = torch.empty(n_scores, device=dev, dtype=dt)
    ds_buf = torch.empty(n_scores, device=dev, dtype=dt)
    pf_buf = torch.empty(n_scores, device=dev, dtype=gemms.p_dtype)
    scale_log2 = softmax_scale * LOG2E
    for c, ((_, kend), pieces) in enumerate(zip(p.blocks, p.pieces)):
        r0 = c * block_rows
        if not pieces:  # every row of the block is before the first key
            dqp[:, r0:min(r0 + block_rows, qp.shape[1])].zero_()
            continue
        m, first = g * pieces[-1][1], g * pieces[0][0]  # real rows; rows before `first` see no key
        if first:
            dqp[:, r0:r0 + first].zero_()
        k8 = -(-kend // plan_mod.ROW_ALIGN) * plan_mod.ROW_ALIGN
        pb, dsb, pf = (buf[: L * m * k8].view(L, m, k8) for buf in (p_buf, ds_buf, pf_buf))
        qc, doc = qp[:, r0:r0 + m], dop[:, r0:r0 + m]
        for lo, hi, keys in pieces:
            rs = slice(g * lo, g * hi)
            # whole kp / vp / colpos: the launchers use their first `keys` rows in place
            gemms.probs(qc[:, rs], kp, pb[:, rs, :keys], pf[:, rs, :keys], rowbias[:, r0:r0 + m][:, rs],
                        rowpos[:, r0:r0 + m][:, rs], colpos, scale_log2, masked)
            gemms.grad_scores(doc[:, rs], vp, dsb[:, rs, :keys], pf[:, rs, :keys], delta[:, r0:r0 + m][:, rs],
                              softmax_scale)
            if not split_acc and keys < kend:
                pb[:, rs, keys:kend].zero_()
                dsb[:, rs, keys:kend].zero_()
            gemms.mm_dq(dsb[:, rs, :keys], kp, dqp[:, r0:r0 + m][:, rs])
        if split_acc:  # keys [a, b): the rows of the pieces whose limit passes a
            ranges, a = [], 0
            for lo, _, keys in pieces:
                if keys > a:
                    ranges.append((g * lo, a, keys))
                    a = keys
        else:
            ranges = [(first, 0, kend)]
        for row, a, b in ranges:
            xs = (pb[:, row:, a:b], doc[:, row:], dsb[:, row:, a:b], qc[:, row:])
            if c < C - 1:
                gemms.add_into(xs[0], xs[1], dv_acc[:, a:], written - a)
                gemms.add_into(xs[2], xs[3], dk_acc[:, a:], written - a)
            else:  # the last block sees every key the plan has (kend == its Nk)
                write_dkv(gemms, a, b, *xs, dk_acc, dv_acc, written - a)
        written = max(written, kend)


def _write_dkv_into(dk_dst, dv_dst, slices):
    """``write_dkv`` for :func:`_run_blocks` writing ``dst[i]`` from the rows ``slices[i]`` of L."""
    def write(gemms, a, b, pb, doc, dsb, qc, dk_acc, dv_acc, rows_set):
        for ls, dk_out, dv_out in zip(slices, dk_dst, dv_dst):
            if dk_acc is not None:
                gemms.add_to(pb[ls], doc[ls], dv_acc[ls, a:b], dv_out[:, a:b], rows_set)
                gemms.add_to(dsb[ls], qc[ls], dk_acc[ls, a:b], dk_out[:, a:b], rows_set)
            else:
                gemms.mm_kv(pb[ls], doc[ls], dv_out[:, a:b])
                gemms.mm_kv(dsb[ls], qc[ls], dk_out[:, a:b])
    return write


def default_gemms(gemms, q: Tensor) -> CoreGemms:
    if gemms is None:
        gemms = CoreGemms(q.dtype, torch.cuda.get_device_properties(q.device).multi_processor_count)
    return gemms


def gemm_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                  softmax_scale: float, causal: bool, gemms=None, rows: int | None = None,
                  pieces: int | None = None, split_acc: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """dq ``[B, Nq, Hq, D]``, dk/dv ``[B, Nk, Hkv, D]`` (summed over each GQA group) from the given
    out/lse (lse fp32 ``[B, Hq, Nq]``, natural log; ``-inf`` rows contribute nothing).

    Causal is bottom-right aligned. ``gemms`` defaults to :class:`CoreGemms` on q's GPU; ``rows``
    overrides the block rows that the budget (``XATTN_GEMM_BWD_BUDGET_MIB``) gives, ``pieces`` the
    diagonal pieces of a causal block (:func:`xattn.core.gemm_bwd_plan.plan`), ``split_acc`` how dK/dV
    follow them (:func:`_run_blocks`).
    """
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    g, L = Hq // Hkv, B * Hkv
    dev, dt = q.device, q.dtype
    gemms = default_gemms(gemms, q)
    p = plan_mod.plan(B, Nq, Nk, Hq, causal, rows=rows, pieces=pieces)
    R, C, Np, nk8 = p.rows, p.num_blocks, p.padded_q, p.keys_stride
    shift = Nk - Nq

    # The GEMMs see q, dout, dq as (L, rows, D) with one block = one range of rows. With B == 1
    # and no GQA stacking (g == 1) those are views of the caller's tensors (row r of head h is
    # q[0, r, h]); otherwise copies with the g query heads of a KV head stacked per block row
    # (_rows_to_blocks: padded to whole blocks). K/V likewise: views when B == 1.
    direct = B == 1 and g == 1 and all(launchable_in_place(x) for x in (q, dout))
    keys_in_place = B == 1 and launchable_in_place(k) and launchable_in_place(v)
    dq = torch.empty(B, Nq, Hq, D, device=dev, dtype=dt)
    if direct:
        qp, dop, dqp = _heads_rows(q), _heads_rows(dout), _heads_rows(dq)
    else:
        qp = _rows_to_blocks(q, Hkv, R, Np).view(L, C * g * R, D)
        dop = _rows_to_blocks(dout, Hkv, R, Np).view(L, C * g * R, D)
        dqp = torch.empty(L, C * g * R, D, device=dev, dtype=dt)
    nkeys = Nk if keys_in_place else nk8  # K/V rows as passed; colpos has as many (one length)
    kp, vp = (_heads_rows(k), _heads_rows(v)) if keys_in_place else (_keys_to_blocks(k, nk8), _keys_to_blocks(v, nk8))
    rowbias = _vec_to_blocks(row_bias(lse), Hkv, R, Np, -math.inf)
    delta = _vec_to_blocks(row_delta(dout, out), Hkv, R, Np, 0.0)
    pos = torch.arange(Np, device=dev, dtype=torch.float32) + shift
    rowpos = pos.view(1, C, R, 1).expand(L, C, R, g).reshape(L, C, R * g)
    rowbias, delta, rowpos = (x.view(L, C * g * R) for x in (rowbias, delta, rowpos))
    colpos = torch.arange(nk8, device=dev, dtype=torch.float32).expand(L, nk8).contiguous()[:, :nkeys]
    dk = torch.empty(B, Nk, Hkv, D, device=dev, dtype=dt)
    dv = torch.empty_like(dk)
    assert p.blocks[-1][1] == Nk  # the last block's rows reach the last key (causal bottom-right too)
    # the last block writes dk/dv in their final [B, Nk, Hkv, D] layout, one batch entry at a time
    slices = [slice(b * Hkv, (b + 1) * Hkv) for b in range(B)]
    write = _write_dkv_into([_heads_rows(dk[b:b + 1]) for b in range(B)],
                            [_heads_rows(dv[b:b + 1]) for b in range(B)], slices)
    _run_blocks(gemms, p, qp, dop, kp, vp, rowbias, delta, rowpos, colpos, dqp, g, causal, softmax_scale,
                write, split_acc)
    if not direct:
        _blocks_to_rows(dqp.view(L, C, g * R, D), dq, R)
    return dq, dk, dv


def row_bias(lse: Tensor) -> Tensor:
    """``−lse·log2e`` (the probabilities' exponent offset), ``-inf`` where lse is not finite."""
    return torch.where(torch.isfinite(lse), lse * -LOG2E, -math.inf)


def gemm_backward_equal_documents(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  documents: int, nq: int, nk: int, *, softmax_scale: float, causal: bool,
                                  gemms=None) -> tuple[Tensor, Tensor, Tensor]:
    """The packed backward of ``documents`` documents of ``nq`` queries and ``nk`` keys each, packed from
    row 0 (q/dout/out ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, lse fp32 ``[Hq, Tq]``): they are one dense
    ``[documents, n, H, D]`` batch, so :func:`gemm_backward` runs on views of them (no gather). Returns dq
    ``[Tq, Hq, D]``, dk/dv ``[Tk, Hkv, D]``, 0 on rows after the last document."""
    rq, rk = documents * nq, documents * nk

    def batch(x, n):
        return x[:documents * n].unflatten(0, (documents, n))

    lse_b = lse[:, :rq].unflatten(1, (documents, nq)).transpose(0, 1)
    grads = gemm_backward(batch(dout, nq), batch(q, nq), batch(k, nk), batch(v, nk), batch(out, nq), lse_b,
                          softmax_scale=softmax_scale, causal=causal, gemms=gemms)
    full = []
    for grad, like, rows in zip(grads, (q, k, v), (rq, rk, rk)):
        grad = grad.flatten(0, 1)
        if rows < like.shape[0]:  # rows after the last document: zero gradients
            grad = torch.cat([grad, grad.new_zeros(like.shape[0] - rows, *like.shape[1:])])
        full.append(grad)
    return tuple(full)


def _group_rows(starts: Tensor, lengths: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """Token index ``(G, pad)`` of row t of each document (``starts + min(t, len - 1)``: padding
    repeats a real row, so every operand stays finite) and its validity ``t < len``."""
    t = torch.arange(pad, device=starts.device)
    valid = t[None] < lengths[:, None]
    return starts[:, None] + torch.minimum(t[None], lengths[:, None] - 1), valid


def gemm_backward_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         seqlens_q, seqlens_k, *, softmax_scale: float, causal: bool, gemms=None,
                         rows: int | None = None, groups=None, pieces: int | None = None,
                         split_acc: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """The packed (varlen) backward: q/dout/out ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, lse fp32
    ``[Hq, Tq]``; document i holds query rows ``sum(seqlens_q[:i]) + [0, seqlens_q[i])`` and keys
    likewise (host ints; causal bottom-right within each document). Returns dq ``[Tq, Hq, D]``,
    dk/dv ``[Tk, Hkv, D]`` (0 on rows and keys outside every document).

    Documents run in :func:`xattn.core.gemm_bwd_plan.varlen_groups` (``groups`` overrides them): each
    group is gathered into the blocked layout of :func:`gemm_backward` (one ``index_select`` per
    operand, padding rows masked by position and ``−inf`` row bias), runs the same blocks, and is
    scattered back (padding goes to one spare row that is dropped). ``rows``, ``pieces``,
    ``split_acc``: as for :func:`gemm_backward`."""
    Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[0], k.shape[1]
    g = Hq // Hkv
    dev, dt = q.device, q.dtype
    gemms = default_gemms(gemms, q)
    seqlens_q, seqlens_k = [int(x) for x in seqlens_q], [int(x) for x in seqlens_k]
    if groups is None:
        groups = plan_mod.varlen_groups(seqlens_q, seqlens_k, Hq)
    starts_q = list(itertools.accumulate(seqlens_q[:-1], initial=0))
    starts_k = list(itertools.accumulate(seqlens_k[:-1], initial=0))
    # flat row views; one spare (dump) row at the end of each output takes every padded row's write
    q_rows, do_rows = q.reshape(Tq * Hq, D), dout.reshape(Tq * Hq, D)
    k_rows, v_rows = k.reshape(Tk * Hkv, D), v.reshape(Tk * Hkv, D)
    dq_rows = torch.zeros(Tq * Hq + 1, D, device=dev, dtype=dt)
    dk_rows = torch.zeros(Tk * Hkv + 1, D, device=dev, dtype=dt)
    dv_rows = torch.zeros_like(dk_rows)
    rowbias_all = row_bias(lse).reshape(Hq * Tq)
    delta_all = row_delta(dout[None], out[None])[0].reshape(Hq * Tq)  # [Hq, Tq]
    heads_q = torch.arange(Hq, device=dev).view(1, Hkv, 1, 1, g)  # (doc, kv, block, row, i) order
    heads_k = torch.arange(Hkv, device=dev).view(1, Hkv, 1)
    # every group's document lengths and starts in ONE asynchronous copy from pinned memory: a copy
    # from pageable memory waits for the stream, and one per group serialised the host with the GPU
    # (H200: 26 ms of host per backward on a mix of 11 documents, the GPU idle in between)
    order = [i for grp in groups for i in grp.docs]
    table = torch.tensor([[seqlens_q[i] for i in order], [seqlens_k[i] for i in order],
                          [starts_q[i] for i in order], [starts_k[i] for i in order]], dtype=torch.int64)
    table = table.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else table.to(dev)
    first = 0
    for grp in groups:
        G = len(grp.docs)
        lq, lk, sq, sk = table[:, first:first + G]
        first += G
        p = plan_mod.plan(G, grp.pad_q, grp.pad_k, Hq, causal, rows=rows, shift=grp.shift, pieces=pieces)
        R, C, Np, nk8 = p.rows, p.num_blocks, p.padded_q, p.keys_stride
        L = G * Hkv
        tok_q, valid_q = _group_rows(sq, lq, Np)
        tok_k, valid_k = _group_rows(sk, lk, nk8)
        # GEMM row (doc, kv, block c, row r, head i) <- flat row tok * Hq + kv * g + i
        shape_q = (G, 1, C, R, 1)
        src_q = (tok_q.view(shape_q) * Hq + heads_q).reshape(-1)
        qp = q_rows.index_select(0, src_q).view(L, C * g * R, D)
        dop = do_rows.index_select(0, src_q).view(L, C * g * R, D)
        src_k = (tok_k.view(G, 1, nk8) * Hkv + heads_k).reshape(-1)
        kp = k_rows.index_select(0, src_k).view(L, nk8, D)
        vp = v_rows.index_select(0, src_k).view(L, nk8, D)
        vec_valid = valid_q.view(shape_q).expand(G, Hkv, C, R, g).reshape(L, C * g * R)
        src_vec = (heads_q * Tq + tok_q.view(shape_q)).reshape(L, C * g * R)  # lse/δ are [Hq, Tq]
        rowbias = torch.where(vec_valid, rowbias_all[src_vec], -math.inf)
        delta = torch.where(vec_valid, delta_all[src_vec], 0.0)
        t = torch.arange(Np, device=dev, dtype=torch.float32)
        if causal:  # row t of a document sees keys j <= t + nk - nq
            pos = t[None] + (lk - lq)[:, None].float()
        else:  # every real key: j <= nk - 1
            pos = (lk - 1)[:, None].float().expand(G, Np)
        rowpos = pos.view(shape_q).expand(G, Hkv, C, R, g).reshape(L, C * g * R).contiguous()  # TMA: unit stride
        colpos = torch.arange(nk8, device=dev, dtype=torch.float32).expand(L, nk8).contiguous()
        dqp = torch.empty(L, C * g * R, D, device=dev, dtype=dt)
        dkp = torch.empty(L, nk8, D, device=dev, dtype=dt)
        dvp = torch.empty_like(dkp)
        assert p.blocks[-1][1] == grp.pad_k  # the last block writes dk/dv for every key row of the group
        write = _write_dkv_into([dkp[:, :grp.pad_k]], [dvp[:, :grp.pad_k]], [slice(None)])
        _run_blocks(gemms, p, qp, dop, kp, vp, rowbias, delta, rowpos, colpos, dqp, g,
                    causal or grp.masked_keys, softmax_scale, write, split_acc)
        dst_q = torch.where(vec_valid.reshape(-1), src_q, Tq * Hq)
        dq_rows.index_copy_(0, dst_q, dqp.view(-1, D))
        dst_k = torch.where(valid_k.view(G, 1, nk8).expand(G, Hkv, nk8).reshape(-1), src_k, Tk * Hkv)
        dk_rows.index_copy_(0, dst_k, dkp.view(-1, D))
        dv_rows.index_copy_(0, dst_k, dvp.view(-1, D))
    return (dq_rows[:-1].view(Tq, Hq, D), dk_rows[:-1].view(Tk, Hkv, D), dv_rows[:-1].view(Tk, Hkv, D))
