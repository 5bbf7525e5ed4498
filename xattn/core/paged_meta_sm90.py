"""The index launcher of the paged split route (:class:`xattn.core.paged.PagedMetaSpec`): one small kernel writes
what the route's split and tail launches read, in place of a dozen elementwise framework ops per decode step.

Launcher signature (glossary of :mod:`xattn.core.paged`; S splits of ``pps`` pages, W tail pages)::

  lengths [B] i32, page_table [B, P] i32 (any strides), kv_meta [S*B, 1+pps] i32, tail_meta [B, 1+W] i32,
  lse_fill [F] f32, page_size i32, seqlen_q i32, tiles_per_page i32

The kernel sees the table through ``tiles_per_page`` = r: pool page p of ``r * page_size`` rows as the r pages
``p r .. p r + r - 1`` of ``page_size`` rows (:func:`xattn.core.paged.tma_page_rows`: FA4 loads a page of its key
tile by TMA), so column c of the table it reads is ``page_table[b, c // r] * r + c % r``, of ``P r`` columns.
Writes, for entry ``s * B + b`` of ``kv_meta``: column 0 its keys (:func:`xattn.core.paged.entry_bounds`), then the
columns ``s * pps ..`` of sequence b (0 past the table); with ``tail``, row b of ``tail_meta``: the tail's keys,
then the columns from the page holding key ``L - min(L, Nq)`` (clamped to the last column); every element of
``lse_fill`` = -inf (the partials' pre-fill). Without ``tail``, ``tail_meta`` is not touched (any int32 tensor).
One thread per written element.
"""

from __future__ import annotations

from .symbolic import compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .paged import PagedMetaSpec  # noqa: E402

__all__ = ["compile_paged_meta"]

_THREADS = 256


class _PagedMeta:
    def __init__(self, tail: bool):
        self.tail = tail

    @cute.jit
    def __call__(self, mLengths: cute.Tensor, mTable: cute.Tensor, mMeta: cute.Tensor, mTail: cute.Tensor,
                 mLse: cute.Tensor, page_size: Int32, seqlen_q: Int32, tiles_per_page: Int32, stream):
        total = mMeta.shape[0] * mMeta.shape[1] + mLse.shape[0]
        if cutlass.const_expr(self.tail):
            total = total + mTail.shape[0] * mTail.shape[1]
        self.kernel(mLengths, mTable, mMeta, mTail, mLse, page_size, seqlen_q, tiles_per_page).launch(
            grid=[cutlass.max(cute.ceil_div(total, _THREADS), 1), 1, 1], block=[_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mLengths: cute.Tensor, mTable: cute.Tensor, mMeta: cute.Tensor, mTail: cute.Tensor,
               mLse: cute.Tensor, page_size: Int32, seqlen_q: Int32, tiles_per_page: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * _THREADS + tidx
        r = tiles_per_page
        batch, columns = mTable.shape[0], mTable.shape[1] * tiles_per_page
        width = mMeta.shape[1]  # 1 + pps
        n_meta = mMeta.shape[0] * width
        n_fill = mLse.shape[0]
        if i < n_meta:
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
        elif i < n_meta + n_fill:
            mLse[i - n_meta] = Float32(float("-inf"))
        else:
            if cutlass.const_expr(self.tail):
                j = i - n_meta - n_fill
                tail_width = mTail.shape[1]
                if j < mTail.shape[0] * tail_width:
                    b = j // tail_width
                    col = j - b * tail_width
                    n = mLengths[b]
                    first = (n - cutlass.min(n, seqlen_q)) // page_size
                    if col == 0:
                        mTail[b, col] = n - first * page_size
                    else:
                        c = cutlass.min(first + col - 1, columns - 1)
                        mTail[b, col] = mTable[b, c // r] * r + c % r


def compile_paged_meta(spec: PagedMetaSpec):
    """Compile the index launcher of ``spec``; returns the compiled TVM-FFI function."""
    sym = cute.sym_int
    b, p, rows, cols, tail_rows, tail_cols, fill = sym(), sym(), sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(Int32, (b,), divisibility=1),
               make_fake_tensor(Int32, (b, p), divisibility=1, leading_dim=None),
               make_fake_tensor(Int32, (rows, cols), divisibility=1),
               make_fake_tensor(Int32, (tail_rows, tail_cols), divisibility=1, leading_dim=None),
               make_fake_tensor(Float32, (fill,), divisibility=1))
    return compile_launcher(_PagedMeta(spec.tail), tensors, scalars=(Int32(64), Int32(1), Int32(1)))
