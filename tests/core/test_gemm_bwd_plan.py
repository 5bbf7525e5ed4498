"""The chunked-GEMM backward's framework-neutral part: route choice, blocks, memory bound."""

import pytest

from xattn.core import gemm_bwd as gb


def test_route_table_follows_the_measurements(monkeypatch):
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    assert gb.choose("ffpa", 512, 512, 8, True, seqlen_k=2048).route == "gemm"
    assert gb.choose("ffpa", 512, 512, 8, True, seqlen_k=1024).route == "ffpa"
    assert gb.choose("ffpa", 512, 512, 1, True, seqlen_k=4096).route == "ffpa"
    assert gb.choose("ffpa", 512, 512, 1, False, seqlen_k=8192).route == "gemm"
    assert "varlen" in gb.choose("ffpa", 512, 512, 8, True, varlen=True, seqlen_k=1 << 16).reason
    assert gb.choose("ffpa", 512, 512, 8, False, window=(128, 0), seqlen_k=1 << 16).route == "ffpa"
    assert gb.choose("fa4", 128, 128, 8, True, seqlen_k=1 << 16).route == "fa4"


def test_forced_routes(monkeypatch):
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    assert gb.choose("ffpa", 512, 512, 1, True, seqlen_k=64).route == "gemm"
    with pytest.raises(ValueError, match="varlen"):
        gb.choose("ffpa", 512, 512, 1, True, varlen=True, seqlen_k=64)
    with pytest.raises(ValueError, match="fa4 keeps"):
        gb.choose("fa4", 128, 128, 1, True, seqlen_k=64)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    assert gb.choose("ffpa", 512, 512, 8, True, seqlen_k=1 << 16).route == "ffpa"
    monkeypatch.setenv("XATTN_BWD_ROUTE", "fastest")
    with pytest.raises(ValueError, match="XATTN_BWD_ROUTE='fastest'"):
        gb.choose("ffpa", 512, 512, 8, True, seqlen_k=1 << 16)


@pytest.mark.parametrize("raw", ["0", "-3", "lots"])
def test_bad_budget_is_named(monkeypatch, raw):
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", raw)
    with pytest.raises(ValueError, match="XATTN_GEMM_BWD_BUDGET_MIB"):
        gb.plan(1, 4096, 4096, 8, True)


@pytest.mark.parametrize("nq, nk, causal", [(1000, 1000, True), (700, 1000, True), (1000, 300, True),
                                            (999, 1001, False)])
def test_blocks_cover_every_row_and_stop_at_the_causal_limit(nq, nk, causal):
    p = gb.plan(1, nq, nk, 4, causal, rows=128)
    assert p.num_blocks * p.rows == p.padded_q >= nq > p.padded_q - p.rows
    assert p.keys_stride % gb.ROW_ALIGN == 0 and p.keys_stride >= nk
    for c, (start, kend) in enumerate(p.blocks):
        assert start == c * p.rows
        last_row = min(start + p.rows, nq) - 1
        want = min(nk, max(0, start + p.rows + nk - nq)) if causal else nk
        assert kend == want
        if causal and kend:  # every key the block's last real row may see is inside [0, kend)
            assert last_row + nk - nq < kend or kend == nk


def test_rows_follow_the_budget():
    mib = 1 << 20
    assert gb.plan(1, 8192, 8192, 32, True, budget=2048 * mib).rows == 1024
    assert gb.plan(1, 8192, 8192, 32, True, budget=256 * mib).rows == 128
    assert gb.plan(1, 8192, 8192, 32, True, budget=1).rows == gb.MIN_BLOCK_ROWS
    assert gb.plan(1, 100, 8192, 32, True, budget=2048 * mib).rows == 128  # never past the query length


def test_causal_blocks_stay_short_noncausal_follow_the_budget():
    """The diagonal square of a causal block is computed whole: blocks stop at CAUSAL_MAX_ROWS."""
    mib = 1 << 20
    assert gb.plan(1, 8192, 8192, 16, True, budget=2048 * mib).rows == gb.CAUSAL_MAX_ROWS == 1024
    assert gb.plan(1, 8192, 8192, 16, False, budget=2048 * mib).rows == 2048
    assert gb.plan(1, 8192, 8192, 4, True, budget=2048 * mib).rows == 1024
    assert gb.plan(1, 8192, 8192, 4, False, budget=2048 * mib).rows == 8192


def test_workspace_bound_counts_every_buffer():
    b, nq, nk, hq, hkv, d = 1, 8192, 8192, 32, 4, 512
    p = gb.plan(b, nq, nk, hq, True, budget=2048 << 20)
    got = gb.workspace_bytes(b, nq, nk, hq, hkv, d, True, budget=2048 << 20)
    scores = 8 * b * hq * p.rows * p.keys_stride
    assert scores <= 2048 << 20
    keys = 2 * 2 * b * hkv * p.keys_stride * d
    assert got >= scores + 8 * b * hkv * nk * d + 3 * 2 * b * hq * p.padded_q * d + keys + gb.DELTA_SLICE_BYTES


def test_info_lists_the_route_table():
    lines = gb.route_table()
    assert any("GQA group >= 8" in x for x in lines) and any("XATTN_BWD_ROUTE" in x for x in lines)
