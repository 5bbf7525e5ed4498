"""Backward workspace layouts, without importing any kernel module (cold start stays cheap).

The tile sizes the layouts depend on mirror the kernels' own sm90 configs
(``ffpa_attn.cute._utils.SM90_BWD_TILE_M``, ``flash_attn.cute.interface._tile_size_bwd_sm90``);
``tests/core/test_workspace_tiles.py`` checks the mirror against those sources for every
supported head dim, causal and local setting, so a kernel upgrade cannot drift silently.
"""

from __future__ import annotations

from .spec import KernelSpec

__all__ = ["ffpa_bwd_tile_m", "fa4_bwd_tiles", "bwd_workspace_shapes", "round_up"]

_FFPA_BWD_TILE_M = 64


def ffpa_bwd_tile_m() -> int:
    """Query-row tile of the FFPA sm90 backward (rows of its workspace are padded to it)."""
    return _FFPA_BWD_TILE_M


def fa4_bwd_tiles(head_dim: int, causal: bool, local: bool) -> tuple[int, int, int]:
    """``(tile_m, tile_n, hdim_multiple_of)`` of FA4's sm90 backward for this config."""
    if head_dim <= 64:
        return 128, 128, 32
    if head_dim <= 96:
        return 64, 128, 32
    if head_dim <= 128:
        return (64 if causal or local else 80), 128, 32
    if head_dim <= 192:
        return 64, 96, 64
    return 64, 48, 64


def round_up(x: int, m: int) -> int:
    """``x`` rounded up to a multiple of ``m`` (the one helper: workspace tiles, GEMM blocks)."""
    return (x + m - 1) // m * m


def bwd_workspace_shapes(spec: KernelSpec, batch: int, seqlen_q: int, seqlen_k: int, total_q: int,
                         total_k: int, heads_q: int, heads_kv: int) -> list[tuple[str, tuple, str, float | None]]:
    """``[(name, shape, dtype, fill)]`` of ``spec``'s backward workspace, in launcher order.

    FFPA: dpsum, lse_log2 (fp32 ``[B, Hq, R]`` / ``[Hq, Rv]``, written by its preprocess).
    FA4: dq_accum, dpsum, lse_log2 (written by its preprocess) and, under GQA, dk_accum,
    dv_accum (atomically accumulated: ``fill`` 0). Rows are padded to the kernel's tile;
    varlen rows get one extra tile per sequence, as the kernels address them.
    """
    if spec.family == "ffpa":
        tm = tn = _FFPA_BWD_TILE_M
        mult = None
    else:
        tm, tn, mult = fa4_bwd_tiles(spec.head_dim, spec.causal, spec.is_local)
    if spec.varlen:
        rows_q = (heads_q, (total_q + (batch + 1) * tm - 1) // tm * tm)
        rows_k = (heads_kv, (total_k + (batch + 1) * tn - 1) // tn * tn)
    else:
        rows_q = (batch, heads_q, round_up(seqlen_q, tm))
        rows_k = (batch, heads_kv, round_up(seqlen_k, tn))
    if spec.family == "ffpa":
        return [("dpsum", rows_q, "float32", None), ("lse_log2", rows_q, "float32", None)]
    d_r, dv_r = round_up(spec.head_dim, mult), round_up(spec.head_dim_v, mult)

    def times(rows, n):
        return (*rows[:-1], rows[-1] * n)
    out = [("dq_accum", times(rows_q, d_r), "float32", None),
           ("dpsum", rows_q, "float32", None),
           ("lse_log2", rows_q, "float32", None)]
    if spec.qhead_per_kvhead > 1:
        out += [("dk_accum", times(rows_k, d_r), "float32", 0.0),
                ("dv_accum", times(rows_k, dv_r), "float32", 0.0)]
    return out
