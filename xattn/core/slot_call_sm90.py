"""The split-KV route's launches and its combine as one compiled host function
(:class:`~xattn.core.split_kv.SlotCallSpec`): a decode step is one TVM-FFI call, its slot views and partial buffers
made inside it (no torch views, no second call, no second stream: the host time of an eager step). One sequence
below; B > 1 sequences under "Batched".

Launcher signatures (glossary of :mod:`xattn.core.split_kv`; ``S`` slots ``c = Nk // S`` keys apart, P = S partials)::

  no tail: q, k, v, out, lse, work, splits (S, Int32), scale           S divides Nk
  tail   : q, k, v, bounds, out, lse, work, splits, scale              bounds int32 [2] = [c, S - 1]

  q [1, Nq, Hq, D], k [1, Nk, Hkv, D], v [1, Nk, Hkv, Dv] (dtype, any strides with a unit last one),
  out [1, Nq, Hq, Dv] (dtype), lse [1, Hq, Nq] f32 (Nq stride 1), work [W] f32

``work`` holds the partials: ``out_partial [S, Nq, Hq, Dv]`` (dtype, contiguous) from its start, then
``lse_partial [S, Hq, Nq]`` (f32, contiguous): ``W = S Nq Hq (Dv / 2 + 1)`` floats
(:func:`~xattn.core.split_kv.slot_work_floats`). Inside, in stream order: the family's dense forward of batch S
(:mod:`xattn.core.fa4_sm90` on the decode tile where :data:`~xattn.core.split_kv.SPLIT_TILES` names one,
:mod:`xattn.core.ffpa_sm90`) on ``q_slots [S, Nq, Hq, D]`` (batch stride 0) and ``k/v_slots [S, n, Hkv, D]`` (batch
stride ``c`` rows) into the slots, then the combine (:mod:`xattn.core.combine_sm90`, with PDL) into out and lse.
Without a tail n = c. With one (FFPA) every slot views the last slot's ``n = Nk - (S - 1) c`` keys and the forward
runs with a mask (:func:`_last_slot_causal`, ``bounds`` its aux tensor): slot b < S - 1 keeps its own c keys, the
last slot its n causally (bottom-right), so the causal tail costs no launch of its own. Writes every element of out
and lse; the caller's plan (:func:`~xattn.core.split_kv.slot_launch`) leaves every query a key in every slot (n >=
Nq): no partial needs a pre-fill.

**Batched** (``spec.batched``: B > 1 sequences of Nk keys each, both families): the splits cannot be a dense launch
there (its batch would be the nested mode (S, B), which the kernels' layouts do not take), so they run as the varlen
launch of :mod:`xattn.core.split_kv` step 1, its documents from ``cu_q`` / ``cu_k``
(:func:`~xattn.core.split_kv.split_cu_seqlens` of the plan: P documents of Nq queries per sequence, the tail's without
keys, then one without queries)::

  q, k, v, cu_q, cu_k, out, lse, work, splits (S, Int32), scale       [B (P + 1) + 1] int32 each

  q [B, Nq, Hq, D] (any strides with a unit last one; shared_q below),
  k/v [B, Nk, Hkv, D] (sequences R >= Nk whole rows apart),
  out [B, Nq, Hq, Dv], lse [B, Hq, Nq] f32 (Nq stride 1), work [W] f32, W = B P Nq Hq (D / 2 + Dv / 2 + 1)

``work`` holds ``q_split [B P Nq, Hq, D]`` (q copied once per split slot by a broadcast kernel here), ``out_partial
[B P Nq, Hq, Dv]`` and ``lse_partial [Hq, B P Nq]``. In stream order: the broadcast, the split launch on the flat key
view ``[R (B - 1) + Nk, Hkv, D]``, with a tail the family's dense causal forward of q on each sequence's last Nq keys
into slot S (rows of the partials, no copy), then the combine. Where ``spec.shared_q`` (FA4 on its decode tile, GQA:
:func:`~xattn.core.split_kv.shared_queries`) no broadcast runs: the split launch reads q as ``[B Nq, Hq, D]`` rows
(:mod:`xattn.core.split_q_sm90`; q's sequences Nq rows apart, ``stride(0) == Nq stride(1)``) and ``work``'s
``q_split`` stays unused.
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from ffpa_attn.cute import utils as ffpa_utils  # noqa: E402

from . import combine_sm90, fa4_sm90, ffpa_sm90, split_q_sm90  # noqa: E402
from .split_kv import SlotCallSpec  # noqa: E402
from .symbolic import CUTE_DTYPES, Dims, compile_launcher  # noqa: E402

__all__ = ["compile_slot_call"]


class _SlotCall:
    def __init__(self, forward, merge, dtype, tail: bool = False):
        self.forward, self.merge, self.dtype, self.tail = forward, merge, dtype, tail

    def _run(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBounds, mO: cute.Tensor,
             mLSE: cute.Tensor, mWork: cute.Tensor, splits: Int32, softmax_scale: Float32, stream):
        nq, hq, d = mQ.shape[1], mQ.shape[2], mQ.shape[3]
        nk, hkv, dv = mK.shape[1], mK.shape[2], mV.shape[3]
        chunk = nk // splits
        keys = chunk  # keys of a slot's view
        if self.tail:  # (traced inline: plain Python) every slot views the last one's keys
            keys = nk - (splits - 1) * chunk
        q_slots = cute.make_tensor(mQ.iterator, cute.make_layout(
            (splits, nq, hq, d), stride=(0, mQ.stride[1], mQ.stride[2], 1)))
        k_slots = cute.make_tensor(mK.iterator, cute.make_layout(
            (splits, keys, hkv, d), stride=(chunk * mK.stride[1], mK.stride[1], mK.stride[2], 1)))
        v_slots = cute.make_tensor(mV.iterator, cute.make_layout(
            (splits, keys, hkv, dv), stride=(chunk * mV.stride[1], mV.stride[1], mV.stride[2], 1)))
        rows = nq * hq  # one slot's query rows
        # offsets into work keep its 16-byte alignment in the pointers' types (Dv a multiple of 8: the combine's), as
        # the launchers' own arguments claim
        out_ptr = cute.recast_ptr(mWork.iterator, dtype=self.dtype)
        lse_ptr = mWork.iterator + cute.assume(splits * rows * (dv // 2), divby=4)
        out_p = cute.make_tensor(out_ptr, cute.make_layout((splits, nq, hq, dv), stride=(rows * dv, hq * dv, dv, 1)))
        lse_p = cute.make_tensor(lse_ptr, cute.make_layout((splits, hq, nq), stride=(rows, nq, 1)))
        if not self.tail:
            self.forward(q_slots, k_slots, v_slots, out_p, lse_p, softmax_scale, stream)
        else:  # the causal tail inside the split launch: its last slot, masked (_last_slot_causal)
            self.forward(q_slots, k_slots, v_slots, out_p, lse_p, mBounds, softmax_scale, stream)
        # the combine's views: partials [S, 1, Nq, Hq, Dv] / [S, 1, Nq, Hq], lse [1, Nq, Hq] (Nq stride 1)
        out_c = cute.make_tensor(out_ptr, cute.make_layout(
            (splits, 1, nq, hq, dv), stride=(rows * dv, rows * dv, hq * dv, dv, 1)))
        lse_c = cute.make_tensor(lse_ptr, cute.make_layout((splits, 1, nq, hq), stride=(rows, rows, 1, nq)))
        lse_o = cute.make_tensor(mLSE.iterator, cute.make_layout(
            (1, nq, hq), stride=(mLSE.stride[0], 1, mLSE.stride[1])))
        self.merge(out_c, lse_c, mO, lse_o, Float32(0.0), stream)


@cute.jit
def _last_slot_causal(batch, head, q_idx, kv_idx, seqlen, aux):
    """The slot launch's mask with its causal tail inside (``aux[0] = [c, S - 1]`` int32): slot b < S - 1 keeps its
    own ``c`` keys, the last slot its keys causally (query i: key j <= n - Nq + i of its n, bottom-right)."""
    bounds = aux[0]
    b, i, j = batch[0], q_idx[0], kv_idx[0]
    last = Int32(b == bounds[1])
    causal = Int32(j - i <= seqlen.seqlen_k - seqlen.seqlen_q)
    own = Int32(j < bounds[0])
    return ffpa_utils.scalar_to_ssa(cutlass.Boolean((last & causal) | ((1 - last) & own)), cutlass.Boolean)


class _Splits(_SlotCall):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mWork: cute.Tensor, splits: Int32, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, None, mO, mLSE, mWork, splits, softmax_scale, stream)


class _SplitsAndTail(_SlotCall):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBounds: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mWork: cute.Tensor, splits: Int32, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, mBounds, mO, mLSE, mWork, splits, softmax_scale, stream)


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
        """``broadcast`` None: the split launch reads q's own rows (``SlotCallSpec.shared_q``)."""
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
        if self.broadcast is not None:  # (traced inline: plain Python) q once per slot
            self.broadcast(mQ, q_slots, splits, stream)
            q_split = cute.make_tensor(q_ptr, cute.make_layout((n, hq, d), stride=(wide(hq * d), wide(hq * 0 + d),
                                                                                 1)))
        else:  # q's own B Nq rows (its sequences Nq rows apart: the caller's contract); the launch finds each one's
            q_split = cute.make_tensor(mQ.iterator, cute.make_layout((nb * nq, hq, d), stride=(
                mQ.stride[1], mQ.stride[2], 1)))
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
    """The family's forward launcher object of ``spec`` (dense or varlen, FA4's shared-q split launch; traced inline
    here, not compiled alone)."""
    if spec.family == "ffpa":
        return (ffpa_sm90._VarlenFwd if spec.varlen else ffpa_sm90._DenseFwd)(ffpa_sm90._fwd_kernel(spec))
    if getattr(spec, "shared_q", False):
        return split_q_sm90.shared_q_forward(spec)
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
    if not spec.tail:
        return compile_launcher(_Splits(_forward(launch), merge, dtype), (q, k, v, out, lse, work),
                                scalars=(Int32(1), Float32(1.0)))
    bounds = make_fake_tensor(Int32, (2,), divisibility=1)
    forward = ffpa_sm90._DenseFwdAux(ffpa_sm90._fwd_kernel(launch, mask_mod=_last_slot_causal))
    return compile_launcher(_SplitsAndTail(forward, merge, dtype, tail=True),
                            (q, k, v, bounds, out, lse, work), scalars=(Int32(1), Float32(1.0)))


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
    call = _BatchedCall(None if spec.shared_q else _Broadcast(dtype, spec.head_dim), _forward(launch),
                        None if tail is None else _forward(tail), merge, dtype)
    return compile_launcher(call, tensors, scalars=(Int32(1), Float32(1.0)))
