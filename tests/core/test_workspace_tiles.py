"""xattn.core.workspace mirrors the kernels' backward tiles without importing them; this keeps
the mirror honest against the installed ffpa-attn / flash-attn-4 sources."""

import pytest

import xattn.core  # noqa: F401  (pins the DSL target before the kernel packages load)
from xattn.core import workspace
from xattn.core.spec import FA4_HEAD_DIMS


def test_ffpa_tile_matches_ffpa_attn():
    from ffpa_attn.cute._utils import SM90_BWD_TILE_M, SM90_BWD_TILE_N

    assert workspace.ffpa_bwd_tile_m() == SM90_BWD_TILE_M == SM90_BWD_TILE_N


@pytest.mark.parametrize("d, dv", FA4_HEAD_DIMS)
@pytest.mark.parametrize("causal, local", [(False, False), (True, False), (False, True)])
def test_fa4_tiles_match_flash_attn(d, dv, causal, local):
    from flash_attn.cute.interface import _tile_size_bwd_sm90

    cfg = _tile_size_bwd_sm90(d, dv, causal, local)
    expected = (cfg.m_block_size, cfg.n_block_size, 64 if cfg.dKV_swapAB else 32)
    assert workspace.fa4_bwd_tiles(d, causal, local) == expected
