"""What both sm90 GEMM launcher modules build on: the cluster shape, the scheduler options, the epilogue classes.

:mod:`xattn.core.gemm_sm90` (the dense route's launchers) and :mod:`xattn.core.gemm_segments_sm90` (the
packed route's) import these from here; the segments module never imports :mod:`xattn.core.gemm_sm90`,
whose :func:`~xattn.core.gemm_sm90.compile_gemm` hands it the ``seg_*`` kinds (one way). This file's bytes
are part of :func:`xattn.core.gemm_sm90.source_digest`, so a change here recompiles those launchers.
"""

from __future__ import annotations

from .symbolic import CUTE_DTYPES  # noqa: F401  (pins the DSL arch first)

from cutlass import Int32  # noqa: E402

__all__ = ["CLUSTER_MNK", "MAX_SWIZZLE", "epilogue_class", "scheduler_options"]

CLUSTER_MNK = (2, 1, 1)
MAX_SWIZZLE = 8


def scheduler_options(max_clusters):
    """quack's tile-scheduler options of every launcher: ``max_clusters`` persistent clusters (the
    launcher's ``max_active_clusters`` argument), swizzle up to :data:`MAX_SWIZZLE`."""
    from quack.tile_scheduler import TileSchedulerOptions

    return TileSchedulerOptions(max_active_clusters=max_clusters, max_swizzle_size=Int32(MAX_SWIZZLE),
                                tile_count_semaphore=None, ag=None, batch_idx_permute=None)


def epilogue_class(kind: str):
    """The quack GEMM class (epilogue mixin + GemmSm90) of ``kind`` (a dense kind of
    :data:`xattn.core.gemm_sm90.KINDS`)."""
    if kind in ("acc", "mm_dq", "mm_kv"):
        from quack.gemm_default_epi import GemmDefaultSm90

        return GemmDefaultSm90
    from quack.rounding import RoundingMode

    from . import gemm_bwd_epilogues as epi

    mod = {"probs_causal": epi.probs_causal, "probs_full": epi.probs_full, "grad_scores": epi.grad_scores}[kind]
    visit_sig = tuple((name, mod.ops[name].fn_port) for name in mod.operand_names)
    return mod._mint(visit_sig, 9, False, False, (), RoundingMode.RN, (), False)
