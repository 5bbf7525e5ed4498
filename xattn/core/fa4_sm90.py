"""FlashAttention-4 (head_dim <= 256) sm90 launchers: fixed-signature ``@cute.jit`` wrappers
around the kernel classes of ``flash_attn.cute``, compiled once per :class:`KernelSpec`
with symbolic batch / sequence / head dims. Tile configs come from flash_attn's own
sm90 heuristics (``_tile_size_fwd_sm90`` / ``_tile_size_bwd_sm90``), except the split-KV launch's decode tile
(:class:`~xattn.core.split_kv.SplitFwdSpec`: its own ``tile_m x tile_n``, one MMA warpgroup per 64 rows).

Launcher signatures (glossary as in :mod:`xattn.core.api`; tensors first, then the
scale; window sizes are compile-time constants of the spec)::

  fwd dense : q k v out lse, scale
  fwd varlen: q k v cu_q cu_k out lse, scale
  bwd dense : dout q k v out lse dq dk dv dq_accum dpsum lse_log2 [dk_accum dv_accum], scale
  bwd varlen: dout q k v out lse cu_q cu_k dq dk dv dq_accum dpsum lse_log2 [dk_accum dv_accum], scale

(``dk_accum``/``dv_accum`` only when Hq > Hkv.) No output needs pre-initialisation.
Workspace: ``dq_accum``/``dpsum``/``lse_log2`` are written by the preprocess kernel;
``dk_accum``/``dv_accum`` (GQA) are atomically accumulated and must start at zero.
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from flash_attn.cute.flash_bwd_postprocess import FlashAttentionBackwardPostprocess  # noqa: E402
from flash_attn.cute.flash_bwd_preprocess import FlashAttentionBackwardPreprocess  # noqa: E402
from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.interface import _tile_size_bwd_sm90, _tile_size_fwd_sm90  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402

from .spec import KernelSpec  # noqa: E402
from .split_kv import SplitFwdSpec  # noqa: E402
from .symbolic import CUTE_DTYPES, Dims, compile_launcher  # noqa: E402

__all__ = ["compile_fa4"]

_SM90 = 90


def _bwd_config(spec: KernelSpec):
    cfg = _tile_size_bwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    hdim_multiple_of = 64 if cfg.dKV_swapAB else 32
    return cfg, hdim_multiple_of


def _window(launcher):
    """Window sizes as traced Int32 constants (None: unbounded side)."""
    return tuple(None if w is None else Int32(w) for w in (launcher.wl, launcher.wr))


class _Fwd:
    """Forward launcher; ``varlen`` picks the signature with cu_seqlens."""

    def __init__(self, kernel, spec: KernelSpec):
        self.kernel, self.wl, self.wr = kernel, spec.window_left, spec.window_right

    def _run(self, mQ, mK, mV, mO, mLSE, scale, cu_q, cu_k, stream):
        wl, wr = _window(self)
        self.kernel(mQ, mK, mV, mO, mLSE, scale, cu_q, cu_k, None, None, None, wl, wr, None, None,
                    AuxData(), None, None, stream)


class _DenseFwd(_Fwd):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, mO, mLSE, softmax_scale, None, None, stream)


class _VarlenFwd(_Fwd):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, mO, mLSE, softmax_scale, mCuSeqlensQ, mCuSeqlensK, stream)


class _Bwd:
    """preprocess -> main backward -> dQ postprocess [-> dK, dV postprocess under GQA]."""

    def __init__(self, spec: KernelSpec, pre, main, post_dq, post_dk, post_dv):
        self.wl, self.wr = spec.window_left, spec.window_right
        self.pre, self.main = pre, main
        self.post_dq, self.post_dk, self.post_dv = post_dq, post_dk, post_dv

    def _run(self, mdO, mQ, mK, mV, mO, mLSE, cu_q, cu_k, mdQ, mdK, mdV, mdQaccum, mdPsum,
             mLSElog2, mdKaccum, mdVaccum, scale, stream):
        wl, wr = _window(self)
        self.pre(mO, mdO, mdPsum, mLSE, mLSElog2, mdQaccum, cu_q, None, None, None, None, scale,
                 None, None, stream)
        gqa = self.post_dk is not None  # plain Python: this helper is traced inline
        self.main(mQ, mK, mV, mdO, mLSElog2, mdPsum, mdQaccum, mdKaccum if gqa else mdK,
                  mdVaccum if gqa else mdV, scale, cu_q, cu_k, None, None, wl, wr, None, None, None,
                  AuxData(), None, None, stream)
        self.post_dq(mdQaccum, mdQ, scale, cu_q, None, None, None, stream)
        if gqa:
            self.post_dk(mdKaccum, mdK, scale, cu_k, None, None, None, stream)
            self.post_dv(mdVaccum, mdV, Float32(1.0), cu_k, None, None, None, stream)


class _DenseBwd(_Bwd):
    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mdQaccum: cute.Tensor, mdPsum: cute.Tensor, mLSElog2: cute.Tensor,
                 softmax_scale: Float32, stream):
        self._run(mdO, mQ, mK, mV, mO, mLSE, None, None, mdQ, mdK, mdV, mdQaccum, mdPsum, mLSElog2,
                  None, None, softmax_scale, stream)


class _DenseBwdGqa(_Bwd):
    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mdQaccum: cute.Tensor, mdPsum: cute.Tensor, mLSElog2: cute.Tensor,
                 mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, softmax_scale: Float32, stream):
        self._run(mdO, mQ, mK, mV, mO, mLSE, None, None, mdQ, mdK, mdV, mdQaccum, mdPsum, mLSElog2,
                  mdKaccum, mdVaccum, softmax_scale, stream)


class _VarlenBwd(_Bwd):
    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mdQaccum: cute.Tensor, mdPsum: cute.Tensor, mLSElog2: cute.Tensor,
                 softmax_scale: Float32, stream):
        self._run(mdO, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mdQ, mdK, mdV, mdQaccum,
                  mdPsum, mLSElog2, None, None, softmax_scale, stream)


class _VarlenBwdGqa(_Bwd):
    @cute.jit
    def __call__(self, mdO: cute.Tensor, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mCuSeqlensK: cute.Tensor, mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mdQaccum: cute.Tensor, mdPsum: cute.Tensor, mLSElog2: cute.Tensor,
                 mdKaccum: cute.Tensor, mdVaccum: cute.Tensor, softmax_scale: Float32, stream):
        self._run(mdO, mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mdQ, mdK, mdV, mdQaccum,
                  mdPsum, mLSElog2, mdKaccum, mdVaccum, softmax_scale, stream)


def _fwd_kernel(spec: KernelSpec):
    cfg = _tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    tile_m, tile_n, threads = cfg.m_block_size, cfg.n_block_size, 384
    if isinstance(spec, SplitFwdSpec):  # the split launch's decode tile (checked when the key was made)
        tile_m, tile_n, threads = spec.tile_m, spec.tile_n, spec.num_threads
    return FlashAttentionForwardSm90(
        CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead,
        is_causal=spec.causal, is_local=spec.is_local, pack_gqa=spec.qhead_per_kvhead > 1,
        tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=threads,
        Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)


def _bwd_kernels(spec: KernelSpec):
    cfg, mult = _bwd_config(spec)
    dtype, d, dv, g = CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead
    pre = FlashAttentionBackwardPreprocess(
        dtype, d, dv, cfg.m_block_size, use_padded_offsets=True, nheads_major=False, pack_gqa=False,
        qhead_per_kvhead=1, nheads_kv=1, hdim_multiple_of=mult)
    main = FlashAttentionBackwardSm90(
        dtype, d, dv, g, spec.causal, is_local=spec.is_local, deterministic=False,
        tile_m=cfg.m_block_size, tile_n=cfg.n_block_size, Q_stage=cfg.num_stages_Q,
        dO_stage=cfg.num_stages_dO, PdS_stage=cfg.num_stages_PdS, SdP_swapAB=cfg.SdP_swapAB,
        dKV_swapAB=cfg.dKV_swapAB, dQ_swapAB=cfg.dQ_swapAB, AtomLayoutMSdP=cfg.AtomLayoutMSdP,
        AtomLayoutNdKV=cfg.AtomLayoutNdKV, AtomLayoutMdQ=cfg.AtomLayoutMdQ,
        num_threads=(cfg.num_wg + 1) * 128, V_in_regs=False, q_subtile_factor=2,
        dQ_single_wg=cfg.dQ_single_wg)
    post_dq = FlashAttentionBackwardPostprocess(
        dtype, d, _SM90, cfg.m_block_size, 128 if cfg.dQ_single_wg else cfg.num_wg * 128,
        cfg.AtomLayoutMdQ, cfg.dQ_swapAB, cluster_size=1, hdim_multiple_of=mult)
    post_dk = post_dv = None
    if g > 1:
        post_dk, post_dv = (FlashAttentionBackwardPostprocess(
            dtype, hd, _SM90, cfg.n_block_size, cfg.num_wg * 128, cfg.AtomLayoutNdKV,
            cfg.dKV_swapAB, cluster_size=1, hdim_multiple_of=mult) for hd in (d, dv))
    return pre, main, post_dq, post_dk, post_dv


def compile_fa4(spec: KernelSpec):
    """Compile the launcher for ``spec`` (family ``"fa4"``); returns a TVM-FFI function."""
    dims = Dims(spec)
    q, k, v = dims.qkv()
    out, lse = dims.out_lse()
    if spec.direction == "fwd":
        kernel = _fwd_kernel(spec)
        if spec.varlen:
            return compile_launcher(_VarlenFwd(kernel, spec), (q, k, v, *dims.cu_seqlens(), out, lse))
        return compile_launcher(_DenseFwd(kernel, spec), (q, k, v, out, lse))
    gqa = spec.qhead_per_kvhead > 1
    ws = [dims.scratch("q"), dims.scratch("q"), dims.scratch("q")]
    if gqa:
        ws += [dims.scratch("kv"), dims.scratch("kv")]
    head = [dims.like_out(), q, k, v, out, lse]
    if spec.varlen:
        head += list(dims.cu_seqlens())
    grads = [dims.like_q(), dims.like_k(), dims.like_v()]
    cls = {(False, False): _DenseBwd, (False, True): _DenseBwdGqa,
           (True, False): _VarlenBwd, (True, True): _VarlenBwdGqa}[(spec.varlen, gqa)]
    return compile_launcher(cls(spec, *_bwd_kernels(spec)), (*head, *grads, *ws))
