"""FA4's split-KV launch with a decode tile (:class:`~xattn.core.split_kv.SplitFwdSpec`): FlashAttention's sm90
forward (``FlashAttentionForwardSm90``) compiled with the spec's ``tile_m x tile_n`` instead of flash_attn's
heuristic tile, behind the varlen forward launcher of :mod:`xattn.core.fa4_sm90` (same signature:
``q k v cu_q cu_k out lse, scale``; same pre-fills).

One MMA warpgroup per 64 query rows (``tile_m // 64`` of them, plus the producer warpgroup).
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402

from .fa4_sm90 import _tile_size_fwd_sm90, _VarlenFwd  # noqa: E402
from .split_kv import SplitFwdSpec  # noqa: E402
from .symbolic import CUTE_DTYPES, Dims, compile_launcher  # noqa: E402

__all__ = ["compile_split_fwd"]


def compile_split_fwd(spec: SplitFwdSpec):
    """Compile the split launch of ``spec``; returns the TVM-FFI function."""
    if spec.tile_m not in (64, 128) or spec.tile_n % 16 or not 16 <= spec.tile_n <= 256:
        raise NotImplementedError(f"{spec.short_name()}: tile_m 64 or 128 and tile_n a multiple of 16 up to 256")
    cfg = _tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, False, False)  # the MMA options of the head dims
    g = spec.qhead_per_kvhead
    kernel = FlashAttentionForwardSm90(
        CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, g, is_causal=False, is_local=False,
        pack_gqa=g > 1, tile_m=spec.tile_m, tile_n=spec.tile_n, num_stages=2, num_threads=128 * (spec.tile_m // 64 + 1),
        Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    dims = Dims(spec)
    return compile_launcher(_VarlenFwd(kernel, spec), (*dims.qkv(), *dims.cu_seqlens(), *dims.out_lse()))
