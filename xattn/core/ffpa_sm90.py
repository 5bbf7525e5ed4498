"""FFPA (head_dim 320-512) sm90 launchers: fixed-signature ``@cute.jit`` wrappers around
the kernel classes of ``ffpa_attn.cute``, compiled once per :class:`KernelSpec` with
symbolic batch / sequence / head dims.

Launcher signatures (tensors first, then scalars; the stream comes from the TVM-FFI
environment). Glossary: B batch, Nq/Nk sequence lengths, Tq/Tk packed tokens,
Hq/Hkv heads, D head dim, R = round_up(Nq, 64), Rv = round_up(Tq + (B+1)*64 - 1, 64)::

  fwd dense : q[B,Nq,Hq,D] k[B,Nk,Hkv,D] v[B,Nk,Hkv,D] out[B,Nq,Hq,D] lse[B,Hq,Nq] f32, scale
  fwd varlen: q[Tq,Hq,D] k[Tk,Hkv,D] v[Tk,Hkv,D] cu_q[B+1] cu_k[B+1] i32, out[Tq,Hq,D] lse[Hq,Tq], scale
  bwd dense : dout q k v out lse dq dk dv dpsum[B,Hq,R] lse_log2[B,Hq,R], scale
  bwd varlen: dout q k v out lse cu_q cu_k dq dk dv dpsum[Hq,Rv] lse_log2[Hq,Rv], scale

Pre-initialisation (the FFPA kernels skip fully masked tiles):
  fwd: ``out`` = 0 and ``lse`` = -inf before causal or varlen calls.
  bwd: ``dq``, ``dk``, ``dv`` = 0 before every call. Workspace needs no init.
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402

from ffpa_attn.cute._bwd_preprocess import FFPAAttnBwdPreprocess
from ffpa_attn.cute._dkdv_d384_sm90 import FFPAAttnBwdDKDVSm90SplitDD384
from ffpa_attn.cute._dkdv_d512_sm90 import FFPAAttnBwdDKDVSm90SplitD
from ffpa_attn.cute._dkdv_generic_sm90 import FFPAAttnBwdDKDVSm90SplitDGeneric
from ffpa_attn.cute._dq_d384_sm90 import FFPAAttnBwdDQSm90SplitDD384
from ffpa_attn.cute._dq_d512_sm90 import FFPAAttnBwdDQSm90SplitD
from ffpa_attn.cute._dq_generic_sm90 import FFPAAttnBwdDQSm90SplitDGeneric
from ffpa_attn.cute._fwd_d384_sm90 import D384_AWARE_HEAD_DIM, FFPAAttnFwdSm90SplitDD384Aware
from ffpa_attn.cute._fwd_d512_sm90 import FFPAAttnFwdSm90SplitD
from ffpa_attn.cute._fwd_generic_sm90 import FFPAAttnFwdSm90SplitDGeneric
from ffpa_attn.cute._utils import SM90_BWD_TILE_M, SM90_BWD_TILE_N, SM90_FWD_TILE_M, SM90_FWD_TILE_N

from .spec import KernelSpec
from .symbolic import CUTE_DTYPES, Dims, compile_launcher

__all__ = ["compile_ffpa"]


class _DenseFwd:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, None, stream)


class _DenseFwdAux:
    """The dense forward with ``aux_tensors`` (the kernel's ``mask_mod`` reads them): q k v out lse aux, scale."""

    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mAux: cute.Tensor, softmax_scale: Float32, stream):
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, None, None, [mAux], stream)


class _VarlenFwd:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32,
                 stream):
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, None, None, None,
                    stream)


class _DenseBwd:
    def __init__(self, pre, dkdv, dq):
        self.pre, self.dkdv, self.dq = pre, dkdv, dq

    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mdPsum: cute.Tensor, mLSElog2: cute.Tensor,
                 softmax_scale: Float32, stream):
        self.pre(mO, mdO, mdPsum, mLSE, mLSElog2, None, None, None, None, stream)
        self.dkdv(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdK, mdV, softmax_scale, None, None, stream)
        self.dq(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQ, softmax_scale, None, None, stream)


class _VarlenBwd:
    def __init__(self, pre, dkdv, dq):
        self.pre, self.dkdv, self.dq = pre, dkdv, dq

    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mdPsum: cute.Tensor, mLSElog2: cute.Tensor, softmax_scale: Float32, stream):
        self.pre(mO, mdO, mdPsum, mLSE, mLSElog2, None, mCuSeqlensQ, None, None, stream)
        self.dkdv(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdK, mdV, softmax_scale, mCuSeqlensQ,
                  mCuSeqlensK, stream)
        self.dq(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQ, softmax_scale, mCuSeqlensQ, mCuSeqlensK,
                stream)


def fwd_class(d: int):
    """FFPA's sm90 forward kernel class for head dim ``d``."""
    if d == 512:
        return FFPAAttnFwdSm90SplitD
    if d <= D384_AWARE_HEAD_DIM:
        return FFPAAttnFwdSm90SplitDD384Aware
    return FFPAAttnFwdSm90SplitDGeneric


def _fwd_kernel(spec: KernelSpec, cls=None, mask_mod=None):
    """FFPA's forward kernel object of ``spec``; ``mask_mod`` (non-causal ``spec`` only): FlexAttention's mask
    ``(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors) -> keep``, its aux tensors passed at the call."""
    d = spec.head_dim
    cls = cls or fwd_class(d)
    return cls(CUTE_DTYPES[spec.dtype], d, spec.head_dim_v, spec.qhead_per_kvhead,
               is_causal=spec.causal, is_local=False, pack_gqa=spec.qhead_per_kvhead > 1,
               tile_m=SM90_FWD_TILE_M, tile_n=SM90_FWD_TILE_N, kv_same=False,
               mask_mod=mask_mod, score_mod=None, has_aux_tensors=mask_mod is not None)


def _bwd_kernels(spec: KernelSpec):
    d = spec.head_dim
    if d == 512:
        dkdv_cls, dq_cls = FFPAAttnBwdDKDVSm90SplitD, FFPAAttnBwdDQSm90SplitD
    elif d <= 384:
        dkdv_cls, dq_cls = FFPAAttnBwdDKDVSm90SplitDD384, FFPAAttnBwdDQSm90SplitDD384
    else:
        dkdv_cls, dq_cls = FFPAAttnBwdDKDVSm90SplitDGeneric, FFPAAttnBwdDQSm90SplitDGeneric
    dtype = CUTE_DTYPES[spec.dtype]
    kw = dict(head_dim_v=spec.head_dim_v, is_causal=spec.causal,
              qhead_per_kvhead=spec.qhead_per_kvhead, tile_m=SM90_BWD_TILE_M, tile_n=SM90_BWD_TILE_N)
    pre = FFPAAttnBwdPreprocess(dtype, d, spec.head_dim_v, SM90_BWD_TILE_M)
    return pre, dkdv_cls(dtype, d, **kw), dq_cls(dtype, d, **kw)


def compile_ffpa(spec: KernelSpec):
    """Compile the launcher for ``spec`` (family ``"ffpa"``); returns a TVM-FFI function."""
    dims = Dims(spec)
    if spec.direction == "fwd":
        kernel = _fwd_kernel(spec)
        if spec.varlen:
            args = (*dims.qkv(), *dims.cu_seqlens(), *dims.out_lse())
            return compile_launcher(_VarlenFwd(kernel), args)
        return compile_launcher(_DenseFwd(kernel), (*dims.qkv(), *dims.out_lse()))
    kernels = _bwd_kernels(spec)
    q, k, v = dims.qkv()
    out, lse = dims.out_lse()
    dout = dims.like_out()
    grads = (dims.like_q(), dims.like_k(), dims.like_v())
    ws = dims.scratch("q"), dims.scratch("q")
    if spec.varlen:
        args = (dout, q, k, v, out, lse, *dims.cu_seqlens(), *grads, *ws)
        return compile_launcher(_VarlenBwd(*kernels), args)
    return compile_launcher(_DenseBwd(*kernels), (dout, q, k, v, out, lse, *grads, *ws))


