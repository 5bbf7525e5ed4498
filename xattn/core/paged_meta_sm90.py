"""The index launcher of the paged split route (:class:`xattn.core.paged.PagedMetaSpec`): one small kernel writes
what the route's split and tail launches read, in place of a dozen elementwise framework ops per decode step.

Launcher signature (glossary of :mod:`xattn.core.paged`; S splits of ``pps`` pages, W tail pages)::

  lengths [B] i32, page_table [B, P] i32 (any strides), kv_meta [S*B, 1+pps] i32, tail_meta [B, 1+W] i32,
  lse_fill [F] f32, cu_seqlens_q [B+1] i32, q_rows [B*Nq] i32, out_rows [Tq] i32, zero [Z] i32,
  page_size i32, seqlen_q i32, tiles_per_page i32

The kernel sees the table through ``tiles_per_page`` = r: pool page p of ``r * page_size`` rows as the r pages
``p r .. p r + r - 1`` of ``page_size`` rows (:func:`xattn.core.paged.tma_page_rows`: FA4 loads a page of its key
tile by TMA), so column c of the table it reads is ``page_table[b, c // r] * r + c % r``, of ``P r`` columns.
Writes, for entry ``s * B + b`` of ``kv_meta``: column 0 its keys (:func:`xattn.core.paged.entry_bounds`), then the
columns ``s * pps ..`` of sequence b (0 past the table); with ``tail``, row b of ``tail_meta``: the tail's keys,
then the columns from the page holding key ``L - min(L, Nq)`` (clamped to the last column); every element of
``lse_fill`` = -inf (the partials' pre-fill). Without ``tail``, ``tail_meta`` is not touched (any int32 tensor).
With ``packed`` (queries packed as ``q [Tq, Hq, D]`` by ``cu_seqlens_q``, at most Nq per sequence: vLLM's decode
call) it also writes the gathers around the dense problem (:mod:`xattn.core.split_kv`, "Packed queries"): ``q_rows``
(dense row b Nq + k reads packed row ``cu[b + 1] - Nq + k``, clamped), ``out_rows`` (packed row t of sequence b
reads dense row ``b Nq + k`` back, of out and of lse; rows outside every sequence read the sentinel row ``B Nq``)
and zeroes ``zero`` (an int32 view of the sentinel out row; the caller's lse fill covers the lse sentinel).
Without ``packed`` (or ``tail``) those tensors are not touched (any int32 tensors).
One thread per written element.
"""

from __future__ import annotations

from .symbolic import compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .paged import PagedMetaSpec  # noqa: E402

__all__ = ["compile_paged_meta", "write_packed_rows", "packed_count"]

_THREADS = 256


class _PagedMeta:
    def __init__(self, tail: bool, packed: bool):
        self.tail, self.packed = tail, packed

    @cute.jit
    def __call__(self, mLengths: cute.Tensor, mTable: cute.Tensor, mMeta: cute.Tensor, mTail: cute.Tensor,
                 mLse: cute.Tensor, mCuQ: cute.Tensor, mQRows: cute.Tensor, mOutRows: cute.Tensor,
                 mZero: cute.Tensor, page_size: Int32, seqlen_q: Int32, tiles_per_page: Int32, stream):
        total = mMeta.shape[0] * mMeta.shape[1] + mLse.shape[0]
        if cutlass.const_expr(self.tail):
            total = total + mTail.shape[0] * mTail.shape[1]
        if cutlass.const_expr(self.packed):
            total = total + packed_count(mQRows, mOutRows, mZero)
        self.kernel(mLengths, mTable, mMeta, mTail, mLse, mCuQ, mQRows, mOutRows, mZero, page_size, seqlen_q,
                    tiles_per_page).launch(
            grid=[cutlass.max(cute.ceil_div(total, _THREADS), 1), 1, 1], block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLengths: cute.Tensor, mTable: cute.Tensor, mMeta: cute.Tensor, mTail: cute.Tensor,
               mLse: cute.Tensor, mCuQ: cute.Tensor, mQRows: cute.Tensor, mOutRows: cute.Tensor,
               mZero: cute.Tensor, page_size: Int32, seqlen_q: Int32, tiles_per_page: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * _THREADS + tidx
        r = tiles_per_page
        batch, columns = mTable.shape[0], mTable.shape[1] * tiles_per_page
        width = mMeta.shape[1]  # 1 + pps
        start = mMeta.shape[0] * width
        if i < start:  # the split entries: keys, then table columns
            row = i // width
            col = i - row * width
            s = row // batch
            b = row - s * batch
            n = mLengths[b]
            before = n
            if cutlass.const_expr(self.tail):
                before = (n - cutlass.min(n, seqlen_q)) // page_size * page_size
            pps = width - 1
            if col == 0:
                span = pps * page_size
                mMeta[row, col] = cutlass.max(cutlass.min(before - s * span, span), 0)
            else:
                c = s * pps + col - 1
                page = Int32(0)
                if c < columns:
                    page = mTable[b, c // r] * r + c % r
                mMeta[row, col] = page
        j = i - start
        if j >= 0 and j < mLse.shape[0]:  # the lse pre-fill
            mLse[j] = Float32(float("-inf"))
        start = start + mLse.shape[0]
        if cutlass.const_expr(self.tail):  # the causal tail's entries
            j = i - start
            tail_width = mTail.shape[1]
            if j >= 0 and j < mTail.shape[0] * tail_width:
                b = j // tail_width
                col = j - b * tail_width
                n = mLengths[b]
                first = (n - cutlass.min(n, seqlen_q)) // page_size
                if col == 0:
                    mTail[b, col] = n - first * page_size
                else:
                    c = cutlass.min(first + col - 1, columns - 1)
                    mTail[b, col] = mTable[b, c // r] * r + c % r
            start = start + mTail.shape[0] * tail_width
        if cutlass.const_expr(self.packed):
            write_packed_rows(i, start, batch, mCuQ, mQRows, mOutRows, mZero, seqlen_q)



def packed_count(mQRows: cute.Tensor, mOutRows: cute.Tensor, mZero: cute.Tensor):
    """Elements of :func:`write_packed_rows`' index space."""
    return mQRows.shape[0] + mOutRows.shape[0] + mZero.shape[0]


@cute.jit
def write_packed_rows(i, start, batch, mCuQ: cute.Tensor, mQRows: cute.Tensor, mOutRows: cute.Tensor,
                      mZero: cute.Tensor, seqlen_q: Int32):
    """Thread ``i``'s share of the packed queries' gathers, from element ``start`` of its index space (shared with
    :mod:`xattn.core.split_meta_sm90`): dense row (b, k) of Nq reads packed row ``cu[b + 1] - Nq + k`` (clamped);
    packed row t of sequence b reads dense row ``b Nq + k`` back; rows outside every sequence the sentinel ``B Nq``.
    ``mZero``: the sentinel out row (an int32 view), zeroed. Spans ``B Nq + Tq + Z`` elements."""
    total_q = mOutRows.shape[0]
    j = i - start
    if j >= 0 and j < mQRows.shape[0]:
        b = j // seqlen_q
        t = mCuQ[b + 1] - seqlen_q + (j - b * seqlen_q)
        mQRows[j] = cutlass.max(cutlass.min(t, total_q - 1), 0)
        if t >= mCuQ[b] and t < total_q:
            mOutRows[t] = j
    start = start + mQRows.shape[0]
    j = i - start
    if j >= 0 and j < total_q:
        if j < mCuQ[0] or j >= mCuQ[batch]:
            mOutRows[j] = batch * seqlen_q
    start = start + total_q
    j = i - start
    if j >= 0 and j < mZero.shape[0]:
        mZero[j] = Int32(0)


def compile_paged_meta(spec: PagedMetaSpec):
    """Compile the index launcher of ``spec``; returns the compiled TVM-FFI function."""
    sym = cute.sym_int
    b, p, rows, cols, tail_rows, tail_cols, fill = sym(), sym(), sym(), sym(), sym(), sym(), sym()
    vector = lambda n: make_fake_tensor(Int32, (n,), divisibility=1, leading_dim=None)  # noqa: E731
    matrix = lambda m, n: make_fake_tensor(Int32, (m, n), divisibility=1, leading_dim=None)  # noqa: E731
    tensors = (vector(b), matrix(b, p), make_fake_tensor(Int32, (rows, cols), divisibility=1),
               matrix(tail_rows, tail_cols), make_fake_tensor(Float32, (fill,), divisibility=1),
               vector(sym()), vector(sym()), vector(sym()), vector(sym()))
    return compile_launcher(_PagedMeta(spec.tail, spec.packed), tensors, scalars=(Int32(64), Int32(1), Int32(1)))
