"""The combine launcher of the split-KV route: one pass per output row, every partial of a chunk in flight at once.

Launcher signature (glossary of :mod:`xattn.core.split_kv`; tensors are strided views)::

  out_partial [P, B, Nq, Hq, Dv] (dtype), lse_partial [P, B, Nq, Hq] f32 (Nq stride 1),
  out [B, Nq, Hq, Dv] (dtype), lse [B, Nq, Hq] f32 (Nq stride 1)

Writes every element of out and lse: ``lse = log(sum_s exp(lse_s))``, ``out = sum_s exp(lse_s - lse) out_s``; a
row whose partials all hold lse -inf gets out 0 and lse -inf (a partial with lse -inf is never read into out).
P <= :data:`~xattn.core.split_kv.MAX_PARTIALS`.

Each thread owns 8 consecutive Dv elements (16 bytes) of one row (b, n, h) and loads them from ``spec.chunk``
partials at once, with their lse, before it merges them (an online softmax across chunks): at P <= chunk the merge
costs one round trip to memory (:func:`~xattn.core.split_kv.combine_chunk`). FlashAttention's
``FlashAttentionForwardCombine`` (which this replaces) stages the lse through shared memory first, then streams the
partials with 3 in flight per CTA, so its cost grows with the split count (H100, d128: 2.3 us at 2 partials, 3.3
at 16, where cuDNN's reduction takes 3.0; docs/benchmarks.md, "Where d128's B1 gap to SDPA sits").

With ``pdl`` the kernel is launched with programmatic dependent launch: it may start while the kernel before it in
the stream (the split launch) drains, and waits on ``griddepcontrol`` before it reads a partial.
"""

from __future__ import annotations

import math

from .symbolic import CUTE_DTYPES, compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .split_kv import MAX_PARTIALS, CombineSpec  # noqa: E402

__all__ = ["compile_combine", "VECTOR", "PDL"]

VECTOR = 8  # Dv elements per thread (16 bytes of a 16-bit dtype)
_THREADS = 128  # about this many threads per CTA: whole rows of Dv / 8 threads each
_LOG2_E = math.log2(math.e)


class _Merge:
    def __init__(self, dtype, head_dim_v: int, pdl: bool, chunk: int):
        if head_dim_v % VECTOR or not 0 < head_dim_v <= 1024 * VECTOR:
            raise NotImplementedError(f"the combine kernel needs Dv a multiple of {VECTOR}, got {head_dim_v}")
        if not 1 <= chunk <= MAX_PARTIALS:
            raise ValueError(f"chunk: expected 1-{MAX_PARTIALS} partials, got {chunk}")
        self.dtype, self.dv, self.pdl, self.chunk = dtype, head_dim_v, pdl, chunk
        self.lanes = head_dim_v // VECTOR  # threads per row
        self.rows = max(_THREADS // self.lanes, 1)  # rows per CTA
        self.threads = self.rows * self.lanes

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor, unused: Float32,
                 stream):
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOp, mLp, mO, mL).launch(grid=[cutlass.max(cute.ceil_div(rows, self.rows), 1), 1, 1],
                                             block=[self.threads, 1, 1], stream=stream, use_pdl=self.pdl)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mL: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nb, nq, nh = mO.shape[0], mO.shape[1], mO.shape[2]
        parts = mOp.shape[0]
        row = bidx * self.rows + tidx // self.lanes
        lane = tidx % self.lanes
        cute.arch.griddepcontrol_wait()  # (a no-op unless launched with PDL)
        if row < nb * nq * nh:
            h = row % nh
            bn = row // nh
            n = bn % nq
            b = bn // nq
            vec = cute.make_rmem_tensor((VECTOR,), self.dtype)
            parts_o = cute.make_rmem_tensor((VECTOR, self.chunk), self.dtype)  # column-major: a partial's 8 contiguous
            parts_lse = cute.make_rmem_tensor((self.chunk,), Float32)
            acc = cute.make_rmem_tensor((VECTOR,), Float32)
            acc.fill(0.0)
            top = Float32(-math.inf)  # the running max of the lse (log2 units)
            total = Float32(0.0)  # sum of exp2(lse - top)
            for c in cutlass.range(cute.ceil_div(parts, self.chunk), unroll=1):
                for j in cutlass.range_constexpr(self.chunk):  # every load of the chunk first
                    s = c * self.chunk + j
                    parts_lse[j] = -Float32.inf
                    if s < parts:
                        parts_lse[j] = mLp[s, b, n, h] * _LOG2_E
                        src = cute.tiled_divide(mOp[s, b, n, h, None], (VECTOR,))[None, lane]
                        cute.autovec_copy(src, parts_o[None, j])
                chunk_top = parts_lse[0]
                for j in cutlass.range_constexpr(1, self.chunk):
                    chunk_top = cutlass.max(chunk_top, parts_lse[j])
                new_top = cutlass.max(top, chunk_top)
                if new_top != -Float32.inf:
                    keep = cute.math.exp2(top - new_top, fastmath=True)  # 0 while top is -inf
                    total = total * keep
                    for i in cutlass.range_constexpr(VECTOR):
                        acc[i] = acc[i] * keep
                    for j in cutlass.range_constexpr(self.chunk):
                        if parts_lse[j] != -Float32.inf:
                            w = cute.math.exp2(parts_lse[j] - new_top, fastmath=True)
                            total = total + w
                            for i in cutlass.range_constexpr(VECTOR):
                                acc[i] = acc[i] + w * parts_o[i, j].to(Float32)
                    top = new_top
            inv = Float32(0.0)
            lse = Float32(-math.inf)
            if total > 0.0:
                inv = 1.0 / total
                lse = (top + cute.math.log2(total, fastmath=True)) / _LOG2_E
            for i in cutlass.range_constexpr(VECTOR):
                vec[i] = (acc[i] * inv).to(self.dtype)
            dst = cute.tiled_divide(mO[b, n, h, None], (VECTOR,))[None, lane]
            cute.autovec_copy(vec, dst)
            if lane == 0:
                mL[b, n, h] = lse


PDL = True  # launch the combine with programmatic dependent launch (module docstring; measured in docs/benchmarks.md)


def compile_combine(spec: CombineSpec, pdl: bool | None = None):
    """Compile the combine launcher of ``spec`` (``spec.chunk`` partials in flight per thread; ``pdl``: launch with
    programmatic dependent launch, default :data:`PDL`); returns the compiled TVM-FFI function. Its trailing scalar
    is unused (every xattn launcher ends with one float: the launch path passes the softmax scale)."""
    dtype = CUTE_DTYPES[spec.dtype]
    dv = spec.head_dim_v
    sym = cute.sym_int
    p, b, n, h = sym(), sym(), sym(), sym()
    div = 128 // dtype.width
    tensors = (make_fake_tensor(dtype, (p, b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (p, b, n, h), divisibility=1, leading_dim=2),
               make_fake_tensor(dtype, (b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (b, n, h), divisibility=1, leading_dim=1))
    return compile_launcher(_Merge(dtype, dv, PDL if pdl is None else pdl, spec.chunk), tensors)
