"""The split-KV route's launches and its combine as one compiled host function
(:class:`~xattn.core.split_kv.SlotCallSpec`): a decode step is one TVM-FFI call, its slot views and partial buffers
made inside it (no torch views, no second call, no second stream: the host time of an eager step). One sequence
below; B > 1 sequences under "Batched".

Launcher signatures (glossary of :mod:`xattn.core.split_kv`; ``S`` splits of ``c`` keys, ``P`` partial slots)::

  no tail: q, k, v, out, lse, work, splits (S, Int32), scale              c = Nk / S, P = S
  tail   : q, k, v, tail_cu_q, tail_cu_k, out, lse, work, splits, scale   c = (Nk - Nq) / S (floor), P = S + 1

  q [1, Nq, Hq, D], k [1, Nk, Hkv, D], v [1, Nk, Hkv, Dv] (dtype, any strides with a unit last one),
  out [1, Nq, Hq, Dv] (dtype), lse [1, Hq, Nq] f32 (Nq stride 1), work [W] f32, tail_cu_q / tail_cu_k [3] int32

``work`` holds the partials: ``out_partial [P, Nq, Hq, Dv]`` (dtype, contiguous) from its start, then
``lse_partial [P, Hq, Nq]`` (f32, contiguous): ``W = P Nq Hq (Dv / 2 + 1)`` floats
(:func:`~xattn.core.split_kv.slot_work_floats`). Inside, in stream order: the family's dense forward of batch S
(:mod:`xattn.core.fa4_sm90` on the decode tile where :data:`~xattn.core.split_kv.SPLIT_TILES` names one,
:mod:`xattn.core.ffpa_sm90`) on ``q_slots [S, Nq, Hq, D]`` (batch stride 0) and ``k/v_slots [S, c, Hkv, D]`` (batch
stride ``c`` rows) into slots ``0..S-1``; with a tail, the family's causal varlen forward of the Nq queries on keys
``[S c, Nk)`` (``tail_cu_q = [0, 0, Nq]``, ``tail_cu_k = [0, S c, Nk]``: a first document without a query) into slot
S; then the combine (:mod:`xattn.core.combine_sm90`, with PDL) into out and lse. Writes every element of out and
lse. The caller's plan (:func:`~xattn.core.split_kv.slot_launch`) makes S divide Nk without a tail, and every tail
query see a key (Nk > Nq) with one: no partial needs a pre-fill.

**Batched** (``spec.batched``: B > 1 sequences of Nk keys each, FFPA): the splits cannot be a dense launch there (its
batch would be the nested mode (S, B), which the kernels' layouts do not take), so they run as the varlen launch of
:mod:`xattn.core.split_kv` step 1, its documents from ``cu_q`` / ``cu_k`` (:func:`~xattn.core.split_kv.split_cu_seqlens`
of the plan: P documents of Nq queries per sequence, the tail's without keys, then one without queries)::

  q, k, v, cu_q, cu_k, out, lse, work, splits (S, Int32), scale       [B (P + 1) + 1] int32 each

  q [B, Nq, Hq, D] (any strides with a unit last one), k/v [B, Nk, Hkv, D] (sequences R >= Nk whole rows apart),
  out [B, Nq, Hq, Dv], lse [B, Hq, Nq] f32 (Nq stride 1), work [W] f32, W = B P Nq Hq (D / 2 + Dv / 2 + 1)

``work`` holds ``q_split [B P Nq, Hq, D]`` (q copied once per split slot by a broadcast kernel here), ``out_partial
[B P Nq, Hq, Dv]`` and ``lse_partial [Hq, B P Nq]``. In stream order: the broadcast, the split launch on the flat key
view ``[R (B - 1) + Nk, Hkv, D]``, with a tail FFPA's dense causal forward of q on each sequence's last Nq keys into
slot S (rows of the partials, no copy), then the combine.
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from . import combine_sm90, fa4_sm90, ffpa_sm90  # noqa: E402
from .split_kv import SlotCallSpec  # noqa: E402
from .symbolic import CUTE_DTYPES, Dims, compile_launcher  # noqa: E402

__all__ = ["compile_slot_call"]


class _SlotCall:
    def __init__(self, forward, tail, merge, dtype):
        self.forward, self.tail, self.merge, self.dtype = forward, tail, merge, dtype

    def _run(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTailCuQ, mTailCuK, mO: cute.Tensor,
             mLSE: cute.Tensor, mWork: cute.Tensor, splits: Int32, softmax_scale: Float32, stream):
        nq, hq, d = mQ.shape[1], mQ.shape[2], mQ.shape[3]
        nk, hkv, dv = mK.shape[1], mK.shape[2], mV.shape[3]
        parts = splits
        chunk = nk // splits
        if self.tail is not None:  # (traced inline: plain Python)
            parts = splits + 1
            chunk = (nk - nq) // splits
        q_slots = cute.make_tensor(mQ.iterator, cute.make_layout(
            (splits, nq, hq, d), stride=(0, mQ.stride[1], mQ.stride[2], 1)))
        k_slots = cute.make_tensor(mK.iterator, cute.make_layout(
            (splits, chunk, hkv, d), stride=(chunk * mK.stride[1], mK.stride[1], mK.stride[2], 1)))
        v_slots = cute.make_tensor(mV.iterator, cute.make_layout(
            (splits, chunk, hkv, dv), stride=(chunk * mV.stride[1], mV.stride[1], mV.stride[2], 1)))
        rows = nq * hq  # one slot's query rows
        # offsets into work keep its 16-byte alignment in the pointers' types (Dv a multiple of 8: the combine's), as
        # the launchers' own arguments claim (the tail's fault was its out strides, below; not this alone)
        at = lambda floats: mWork.iterator + cute.assume(floats, divby=4)  # noqa: E731
        out_ptr = cute.recast_ptr(mWork.iterator, dtype=self.dtype)
        lse_ptr = at(parts * rows * (dv // 2))
        out_p = cute.make_tensor(out_ptr, cute.make_layout((splits, nq, hq, dv), stride=(rows * dv, hq * dv, dv, 1)))
        lse_p = cute.make_tensor(lse_ptr, cute.make_layout((splits, hq, nq), stride=(rows, nq, 1)))
        self.forward(q_slots, k_slots, v_slots, out_p, lse_p, softmax_scale, stream)
        if self.tail is not None:  # slot S: the varlen layouts of q's, k's and v's own rows
            rows_of = lambda t, n, h, e: cute.make_tensor(  # noqa: E731
                t.iterator, cute.make_layout((n, h, e), stride=(t.stride[1], t.stride[2], 1)))
            q_rows, k_rows, v_rows = rows_of(mQ, nq, hq, d), rows_of(mK, nk, hkv, d), rows_of(mV, nk, hkv, dv)
            # FFPA's varlen forward faults on an out layout with static or 32-bit strides (H100, session 31): give the
            # tail's slot the kind its own launcher takes, dynamic 64-bit strides divisible by 8
            wide = lambda x: cute.assume(cutlass.Int64(x), divby=8)  # noqa: E731
            out_t = cute.make_tensor(cute.recast_ptr(at(splits * rows * (dv // 2)), dtype=self.dtype),
                                     cute.make_layout((nq, hq, dv), stride=(wide(hq * dv), wide(hq * 0 + dv), 1)))
            lse_t = cute.make_tensor(lse_ptr + splits * rows, cute.make_layout((hq, nq), stride=(nq, 1)))
            self.tail(q_rows, k_rows, v_rows, mTailCuQ, mTailCuK, out_t, lse_t, softmax_scale, stream)
        # the combine's views: partials [P, 1, Nq, Hq, Dv] / [P, 1, Nq, Hq], lse [1, Nq, Hq] (Nq stride 1)
        out_c = cute.make_tensor(out_ptr, cute.make_layout(
            (parts, 1, nq, hq, dv), stride=(rows * dv, rows * dv, hq * dv, dv, 1)))
        lse_c = cute.make_tensor(lse_ptr, cute.make_layout((parts, 1, nq, hq), stride=(rows, rows, 1, nq)))
        lse_o = cute.make_tensor(mLSE.iterator, cute.make_layout(
            (1, nq, hq), stride=(mLSE.stride[0], 1, mLSE.stride[1])))
        self.merge(out_c, lse_c, mO, lse_o, Float32(0.0), stream)


class _Splits(_SlotCall):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mWork: cute.Tensor, splits: Int32, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, None, None, mO, mLSE, mWork, splits, softmax_scale, stream)


class _SplitsAndTail(_SlotCall):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mTailCuQ: cute.Tensor,
                 mTailCuK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, splits: Int32,
                 softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, mTailCuQ, mTailCuK, mO, mLSE, mWork, splits, softmax_scale, stream)


class _Broadcast:
    """q ``[B, Nq, Hq, D]`` -> slots ``0..S-1`` of ``q_split [B, P, Nq, Hq, D]``: a thread moves 16 bytes of a row."""

    def __init__(self, dtype, head_dim: int):
        self.dtype, self.lanes = dtype, head_dim // combine_sm90.VECTOR
        self.rows = max(128 // self.lanes, 1)  # rows per CTA

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQs: cute.Tensor, splits: Int32, stream):
        rows = mQ.shape[0] * splits * mQ.shape[1] * mQ.shape[2]
        self.kernel(mQ, mQs, splits).launch(grid=[cutlass.max(cute.ceil_div(rows, self.rows), 1), 1, 1],
                                            block=[self.rows * self.lanes, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQs: cute.Tensor, splits: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nb, nq, nh = mQ.shape[0], mQ.shape[1], mQ.shape[2]
        row = bidx * self.rows + tidx // self.lanes
        lane = tidx % self.lanes
        if row < nb * splits * nq * nh:
            h = row % nh
            t = row // nh
            n = t % nq
            t = t // nq
            s = t % splits
            b = t // splits
            width = combine_sm90.VECTOR
            vec = cute.make_rmem_tensor((width,), self.dtype)
            cute.autovec_copy(cute.tiled_divide(mQ[b, n, h, None], (width,))[None, lane], vec)
            cute.autovec_copy(vec, cute.tiled_divide(mQs[b, s, n, h, None], (width,))[None, lane])


class _BatchedCall:
    def __init__(self, broadcast, forward, tail, merge, dtype):
        self.broadcast, self.forward, self.tail, self.merge, self.dtype = broadcast, forward, tail, merge, dtype

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuQ: cute.Tensor, mCuK: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mWork: cute.Tensor, splits: Int32, softmax_scale: Float32,
                 stream):
        self._run(mQ, mK, mV, mCuQ, mCuK, mO, mLSE, mWork, splits, softmax_scale, stream)

    def _run(self, mQ, mK, mV, mCuQ, mCuK, mO, mLSE, mWork, splits, softmax_scale, stream):
        nb, nq, hq, d = mQ.shape[0], mQ.shape[1], mQ.shape[2], mQ.shape[3]
        nk, hkv, dv = mK.shape[1], mK.shape[2], mV.shape[3]
        parts = splits
        if self.tail is not None:  # (traced inline: plain Python)
            parts = splits + 1
        rows = nq * hq  # one sequence's query rows in a slot
        n = nb * parts * nq  # the split launch's query rows
        wide = lambda x: cute.assume(cutlass.Int64(x), divby=8)  # noqa: E731  (session 31's fault: see _SlotCall)
        at = lambda floats: mWork.iterator + cute.assume(floats, divby=4)  # noqa: E731  (16-byte aligned)
        q_ptr = cute.recast_ptr(mWork.iterator, dtype=self.dtype)
        out_ptr = cute.recast_ptr(at(n * hq * (d // 2)), dtype=self.dtype)
        lse_ptr = at(n * hq * (d // 2 + dv // 2))
        q_slots = cute.make_tensor(q_ptr, cute.make_layout(
            (nb, parts, nq, hq, d), stride=(wide(parts * rows * d), wide(rows * d), wide(hq * d), wide(hq * 0 + d), 1)))
        self.broadcast(mQ, q_slots, splits, stream)
        q_split = cute.make_tensor(q_ptr, cute.make_layout((n, hq, d), stride=(wide(hq * d), wide(hq * 0 + d), 1)))
        key_rows = (mK.stride[0] // mK.stride[1]) * (nb - 1) + nk  # the flat key view, R rows per sequence
        k_rows = cute.make_tensor(mK.iterator, cute.make_layout((key_rows, hkv, d), stride=(mK.stride[1],
                                                                                            mK.stride[2], 1)))
        v_rows = cute.make_tensor(mV.iterator, cute.make_layout((key_rows, hkv, dv), stride=(mV.stride[1],
                                                                                             mV.stride[2], 1)))
        out_s = cute.make_tensor(out_ptr, cute.make_layout((n, hq, dv), stride=(wide(hq * dv), wide(hq * 0 + dv), 1)))
        lse_s = cute.make_tensor(lse_ptr, cute.make_layout((hq, n), stride=(n, 1)))
        self.forward(q_split, k_rows, v_rows, mCuQ, mCuK, out_s, lse_s, softmax_scale, stream)
        if self.tail is not None:  # slot S of every sequence: the dense causal forward of q on its last Nq keys
            first = nk - nq
            last = lambda t, e: cute.make_tensor(  # noqa: E731
                t.iterator + cute.assume(cutlass.Int64(first) * t.stride[1], divby=8),
                cute.make_layout((nb, nq, hkv, e), stride=(t.stride[0], t.stride[1], t.stride[2], 1)))
            out_t = cute.make_tensor(out_ptr + cute.assume(splits * rows * dv, divby=8), cute.make_layout(
                (nb, nq, hq, dv), stride=(wide(parts * rows * dv), wide(hq * dv), wide(hq * 0 + dv), 1)))
            lse_t = cute.make_tensor(lse_ptr + splits * nq, cute.make_layout((nb, hq, nq), stride=(parts * nq, n, 1)))
            self.tail(mQ, last(mK, d), last(mV, dv), out_t, lse_t, softmax_scale, stream)
        # the combine's views: partials [P, B, Nq, Hq, Dv] / [P, B, Nq, Hq], lse [B, Nq, Hq] (Nq stride 1)
        out_c = cute.make_tensor(out_ptr, cute.make_layout(
            (parts, nb, nq, hq, dv), stride=(rows * dv, parts * rows * dv, hq * dv, dv, 1)))
        lse_c = cute.make_tensor(lse_ptr, cute.make_layout((parts, nb, nq, hq), stride=(nq, parts * nq, 1, n)))
        lse_o = cute.make_tensor(mLSE.iterator, cute.make_layout(
            (nb, nq, hq), stride=(mLSE.stride[0], 1, mLSE.stride[1])))
        self.merge(out_c, lse_c, mO, lse_o, Float32(0.0), stream)


def _forward(spec):
    """The family's forward launcher object of ``spec`` (dense or varlen; traced inline here, not compiled alone)."""
    if spec.family == "ffpa":
        return (ffpa_sm90._VarlenFwd if spec.varlen else ffpa_sm90._DenseFwd)(ffpa_sm90._fwd_kernel(spec))
    return (fa4_sm90._VarlenFwd if spec.varlen else fa4_sm90._DenseFwd)(fa4_sm90._fwd_kernel(spec), spec)


def compile_slot_call(spec: SlotCallSpec):
    """Compile the slot call of ``spec`` (module docstring); returns the TVM-FFI function."""
    if not isinstance(spec, SlotCallSpec):
        raise ValueError(f"compile_slot_call: expected a SlotCallSpec, got {type(spec).__name__}")
    launch = spec.launch_spec()
    dims = Dims(launch)
    dtype = CUTE_DTYPES[spec.dtype]
    if spec.batched:
        return _compile_batched(spec, launch, dims, dtype)
    one = 1
    q = make_fake_tensor(dtype, (one, dims.nq, dims.hq, spec.head_dim), divisibility=dims.div)
    k = make_fake_tensor(dtype, (one, dims.nk, dims.hkv, spec.head_dim), divisibility=dims.div)
    v = make_fake_tensor(dtype, (one, dims.nk, dims.hkv, spec.head_dim_v), divisibility=dims.div)
    out = make_fake_tensor(dtype, (one, dims.nq, dims.hq, spec.head_dim_v), divisibility=dims.div)
    lse = make_fake_tensor(Float32, (one, dims.hq, dims.nq), divisibility=1)
    work = make_fake_tensor(Float32, (cute.sym_int(),), divisibility=4)
    merge = combine_sm90._Merge(dtype, spec.head_dim_v, combine_sm90.PDL, spec.chunk)
    tail = spec.tail_spec()
    if tail is None:
        return compile_launcher(_Splits(_forward(launch), None, merge, dtype), (q, k, v, out, lse, work),
                                scalars=(Int32(1), Float32(1.0)))
    cu = (make_fake_tensor(Int32, (3,), divisibility=1), make_fake_tensor(Int32, (3,), divisibility=1))
    return compile_launcher(_SplitsAndTail(_forward(launch), _forward(tail), merge, dtype),
                            (q, k, v, *cu, out, lse, work), scalars=(Int32(1), Float32(1.0)))


def _compile_batched(spec: SlotCallSpec, launch, dims: Dims, dtype):
    """The batched slot call of ``spec`` (module docstring)."""
    b, nq, nk, hq, hkv = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    half = lambda *shape: make_fake_tensor(dtype, shape, divisibility=dims.div)  # noqa: E731
    docs = cute.sym_int()  # B (P + 1) + 1
    tensors = (half(b, nq, hq, spec.head_dim), half(b, nk, hkv, spec.head_dim), half(b, nk, hkv, spec.head_dim_v),
               make_fake_tensor(Int32, (docs,), divisibility=1), make_fake_tensor(Int32, (docs,), divisibility=1),
               half(b, nq, hq, spec.head_dim_v), make_fake_tensor(Float32, (b, hq, nq), divisibility=1),
               make_fake_tensor(Float32, (cute.sym_int(),), divisibility=4))
    merge = combine_sm90._Merge(dtype, spec.head_dim_v, combine_sm90.PDL, spec.chunk)
    tail = spec.tail_spec()
    call = _BatchedCall(_Broadcast(dtype, spec.head_dim), _forward(launch), None if tail is None else _forward(tail),
                        merge, dtype)
    return compile_launcher(call, tensors, scalars=(Int32(1), Float32(1.0)))
