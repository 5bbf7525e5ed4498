"""FA4's contiguous split launch reading q as it is (:class:`~xattn.core.split_kv.SplitFwdSpec` with ``shared_q``):
the split-KV route's launch without a copy of q per slot (:func:`~xattn.core.split_kv.shared_queries`).

The launch's documents are the route's (:func:`~xattn.core.split_kv.split_cu_seqlens`: ``B * (P + 1)``, P slots of
Nq queries then one without); document ``i = (b, s)`` writes out rows ``cu_q[i]..`` of ``[B*P*Nq]`` and loads its Nq
queries from row ``b * Nq`` of q ``[B*Nq, Hq, D]``: ``b = cu_q[i] // (P Nq)``, ``P Nq = cu_q[-1] / B``, ``B = B (P + 1)
- cu_q[-1] / Nq`` (the launch's own documents and rows). The kernel is FlashAttention's sm90 forward with the
producer's q offset changed and q loaded by predicated copies, not TMA: the launcher hands FlashAttention a view of q
as long as out (its tile scheduler sizes the grid from q's rows), and the predicates keep every read inside the
document's Nq rows.

Launcher signature (:mod:`xattn.core.fa4_sm90`'s varlen forward, q's rows its own)::

  q [B*Nq, Hq, D], k, v, cu_q, cu_k [B*(P+1)+1] int32, out [B*P*Nq, Hq, Dv], lse [Hq, B*P*Nq] f32, scale
"""

from __future__ import annotations

import dataclasses
import inspect

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from . import fa4_sm90  # noqa: E402
from .split_kv import SplitFwdSpec  # noqa: E402
from .symbolic import Dims, compile_launcher  # noqa: E402

__all__ = ["compile_shared_q", "shared_q_forward"]

_SEQLEN_ARG = list(inspect.signature(FlashAttentionForwardSm90.load).parameters).index("SeqlenInfoCls") - 1


class SharedQueryForwardSm90(FlashAttentionForwardSm90):
    """FlashAttention's sm90 forward whose producer loads document i's queries from its sequence's rows of q (module
    docstring), by predicated copies (no TMA for q: its descriptor would span the longer view)."""

    @property
    def use_tma_Q(self):
        return False

    @use_tma_Q.setter
    def use_tma_Q(self, value):  # FlashAttention's __call__ sets it from the GQA packing
        pass

    def load(self, *args, **kwargs):
        args = list(args)
        own = args[_SEQLEN_ARG]  # functools.partial(SeqlenInfoQK.create, ...) built by the kernel

        def shared(batch_idx):
            info = own(batch_idx)
            cu_q = own.keywords["mCuSeqlensQ"]
            total = cu_q[cu_q.shape[0] - 1]  # B P Nq
            slots = total // info.seqlen_q  # B P (every document with queries holds Nq)
            seqs = (cu_q.shape[0] - 1) - slots  # B: the documents are B (P + 1)
            return dataclasses.replace(info, offset_q=info.offset_q // (total // seqs) * info.seqlen_q)

        args[_SEQLEN_ARG] = shared
        return FlashAttentionForwardSm90.load(self, *args, **kwargs)


class _SharedVarlenFwd:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        # FlashAttention sizes its grid from q's rows: hand it q as long as out (no read leaves q's rows)
        mQ_long = cute.make_tensor(mQ.iterator, cute.make_layout((mO.shape[0], *mQ.shape[1:]), stride=mQ.stride))
        self.kernel(mQ_long, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, None, None, None, None,
                    None, None, None, AuxData(), None, None, stream)


def shared_q_forward(spec: SplitFwdSpec) -> _SharedVarlenFwd:
    """The shared-q split launcher object of ``spec`` (module docstring's signature), uncompiled: compiled alone by
    :func:`compile_shared_q`, traced inline by :mod:`xattn.core.slot_call_sm90`'s batched call."""
    if not (isinstance(spec, SplitFwdSpec) and spec.shared_q and spec.family == "fa4"):
        raise ValueError(f"shared_q_forward: expected FA4's SplitFwdSpec with shared_q, got {spec.short_name()}")
    kernel = fa4_sm90._fwd_kernel(spec)  # FlashAttention's own config of the decode tile
    kernel.__class__ = SharedQueryForwardSm90  # FlashAttention's object, its q load changed
    return _SharedVarlenFwd(kernel)


def compile_shared_q(spec: SplitFwdSpec):
    """Compile the shared-q split launcher of ``spec`` (module docstring); returns the TVM-FFI function."""
    forward = shared_q_forward(spec)
    dims = Dims(spec)
    _, k, v = dims.qkv()
    q = make_fake_tensor(dims.dtype, (cute.sym_int(), dims.hq, spec.head_dim), divisibility=dims.div)
    return compile_launcher(forward, (q, k, v, *dims.cu_seqlens(), *dims.out_lse()))
