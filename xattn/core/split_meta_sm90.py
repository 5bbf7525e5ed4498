"""The index launcher of the contiguous split-KV route with device lengths (:class:`xattn.core.split_kv.SplitMetaSpec`):
one small kernel writes what the split and tail launches read, in place of 10-30 elementwise framework ops per
decode step (``attention_with_kvcache(cache_seqlens=)`` and the packed decode call ``cu_seqlens_q/k``).

Launcher signature (glossary of :mod:`xattn.core.split_kv`; P partial slots, S splits)::

  keys [B] or [B+1] i32, cu_k [B*(P+1)+1] i32, tail_k [2B+1] i32, lse_fill [F] f32,
  cu_seqlens_q [B+1] i32, q_rows [B*Nq] i32, out_rows [Tq] i32, zero [Z] i32,
  batch i32, rows i32, key_rows i32, seqlen_q i32, splits i32, chunk i32

Sequence b's keys: with ``rows >= 0`` they start at flat row ``b * rows`` and ``keys[b]`` are valid (a cache with
``cache_seqlens``); with ``rows < 0`` ``keys`` is ``cu_seqlens_k``: they start at ``keys[b]``, ``keys[b + 1] -
keys[b]`` of them (packed keys). Writes ``cu_k`` as :func:`xattn.core.split_kv.split_cu_seqlens` lays the split
launch's documents out (S splits of ``chunk`` keys, or with ``chunk`` 0 each sequence's own chunk, over the keys
before the causal tail; the tail slot empty; then the rows up to the next sequence; last ``key_rows``), with
``tail`` the tail launch's ``tail_k`` (a gap, then the last ``min(L, Nq)`` keys of each sequence), -inf into every
element of ``lse_fill``, and with ``packed`` the packed queries' gathers
(:func:`xattn.core.paged_meta_sm90.write_packed_rows`). Tensors a variant does not use are not touched (any int32
vectors). One thread per written element.
"""

from __future__ import annotations

from .symbolic import compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .paged_meta_sm90 import packed_count, write_packed_rows  # noqa: E402
from .split_kv import KEY_TILE, SplitMetaSpec  # noqa: E402

__all__ = ["compile_split_meta"]

_THREADS = 256


class _SplitMeta:
    def __init__(self, tail: bool, packed: bool):
        self.tail, self.packed = tail, packed

    @cute.jit
    def __call__(self, mKeys: cute.Tensor, mCuK: cute.Tensor, mTailK: cute.Tensor, mLse: cute.Tensor,
                 mCuQ: cute.Tensor, mQRows: cute.Tensor, mOutRows: cute.Tensor, mZero: cute.Tensor, batch: Int32,
                 rows: Int32, key_rows: Int32, seqlen_q: Int32, splits: Int32, chunk: Int32, stream):
        total = mCuK.shape[0] + mLse.shape[0]
        if cutlass.const_expr(self.tail):
            total = total + mTailK.shape[0]
        if cutlass.const_expr(self.packed):
            total = total + packed_count(mQRows, mOutRows, mZero)
        self.kernel(mKeys, mCuK, mTailK, mLse, mCuQ, mQRows, mOutRows, mZero, batch, rows, key_rows, seqlen_q,
                    splits, chunk).launch(
            grid=[cutlass.max(cute.ceil_div(total, _THREADS), 1), 1, 1], block=[_THREADS, 1, 1], stream=stream)

    @cute.jit
    def sequence(self, mKeys: cute.Tensor, b, rows: Int32, seqlen_q: Int32):
        """``(first row, valid keys, keys before the causal tail)`` of sequence b."""
        base = b * rows
        n = Int32(0)
        if rows < 0:
            base = mKeys[b]
            n = mKeys[b + 1] - base
        else:
            n = mKeys[b]
        full = n
        if cutlass.const_expr(self.tail):
            full = n - cutlass.min(n, seqlen_q)
        return base, n, full

    @cute.kernel
    def kernel(self, mKeys: cute.Tensor, mCuK: cute.Tensor, mTailK: cute.Tensor, mLse: cute.Tensor,
               mCuQ: cute.Tensor, mQRows: cute.Tensor, mOutRows: cute.Tensor, mZero: cute.Tensor, batch: Int32,
               rows: Int32, key_rows: Int32, seqlen_q: Int32, splits: Int32, chunk: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * _THREADS + tidx
        n_cu = mCuK.shape[0]
        if i < n_cu:  # the split launch's documents: (b, s < S) a split, then the tail slot (empty), then the gap
            value = key_rows
            if i < n_cu - 1:
                width = (n_cu - 1) // batch  # P + 1
                b = i // width
                c = i - b * width
                base, n, full = self.sequence(mKeys, b, rows, seqlen_q)
                value = base + full
                if c < splits:
                    step = chunk
                    if chunk == 0:  # each sequence its own chunk: whole key tiles, at least one
                        per = splits * KEY_TILE
                        step = cutlass.max((full + per - 1) // per, 1) * KEY_TILE
                    value = base + cutlass.min(c * step, full)
            mCuK[i] = value
        start = n_cu
        j = i - start
        if j >= 0 and j < mLse.shape[0]:  # the partials' lse pre-fill
            mLse[j] = Float32(float("-inf"))
        start = start + mLse.shape[0]
        if cutlass.const_expr(self.tail):  # the tail launch: a gap, then the tail keys of each sequence
            j = i - start
            if j >= 0 and j < mTailK.shape[0]:
                value = Int32(0)
                if j > 0:
                    b = (j - 1) // 2
                    base, n, full = self.sequence(mKeys, b, rows, seqlen_q)
                    value = base + full
                    if (j - 1) - 2 * b == 1:
                        value = base + n
                mTailK[j] = value
            start = start + mTailK.shape[0]
        if cutlass.const_expr(self.packed):
            write_packed_rows(i, start, batch, mCuQ, mQRows, mOutRows, mZero, seqlen_q)


def compile_split_meta(spec: SplitMetaSpec):
    """Compile the index launcher of ``spec``; returns the compiled TVM-FFI function."""
    vector = lambda: make_fake_tensor(Int32, (cute.sym_int(),), divisibility=1, leading_dim=None)  # noqa: E731
    tensors = (vector(), make_fake_tensor(Int32, (cute.sym_int(),), divisibility=1), vector(),
               make_fake_tensor(Float32, (cute.sym_int(),), divisibility=1), vector(), vector(), vector(), vector())
    return compile_launcher(_SplitMeta(spec.tail, spec.packed), tensors, scalars=(Int32(1),) * 6)
