"""Paged decoding plans and the page-table rules (xattn.core.paged): pure Python."""

import random
import re

import pytest

from xattn.core import paged


def _draws(n=300, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        page_size = rng.choice([16, 64, 128, 256])
        length = rng.choice([0, 1, page_size - 1, page_size, page_size + 1, rng.randrange(0, 40 * page_size)])
        max_pages = -(-length // page_size) + rng.choice([0, 0, 1, 7])
        yield (rng.choice([1, 2, 3, 8, 33, 127]), rng.random() < 0.5, rng.choice([1, 2, 4, 16]), length,
               page_size, max(max_pages, 1))


@pytest.mark.parametrize("splits, causal, nq, length, page_size, max_pages", list(_draws()))
def test_entries_cover_every_key_once_within_the_table(splits, causal, nq, length, page_size, max_pages):
    """Split entries start on their own pages and hold at most their pages' keys; with the tail they cover
    keys 0..L-1 exactly once; no entry reads a column past the table; the tail starts no later than the
    first key some query cannot see (L - Nq), so the splits may run without a mask."""
    plan = paged.plan_paged(splits, causal, nq, max_pages)
    assert plan.splits <= splits and plan.splits * plan.pages_per_split >= max_pages
    assert plan.padded == (plan.splits * plan.pages_per_split != max_pages)
    assert (plan.splits - 1) * plan.pages_per_split < max_pages  # no split starts past the table
    entries = paged.entry_bounds(plan, length, nq, page_size)
    assert len(entries) == plan.partials
    seen = []
    for i, (col, keys) in enumerate(entries):
        if i < plan.splits:
            assert col == i * plan.pages_per_split and keys <= plan.pages_per_split * page_size
        assert col + -(-keys // page_size) <= max_pages
        seen += range(col * page_size, col * page_size + keys)
    assert sorted(seen) == list(range(length))
    if plan.tail:
        tail_start = entries[-1][0] * page_size
        assert tail_start <= max(length - nq, 0) and entries[-1][1] < page_size + nq


def test_plan_shrinks_to_the_table_and_pads_when_it_must():
    assert paged.plan_paged(32, False, 1, 128) == paged.PagedPlan(32, 4, False, False)
    assert paged.plan_paged(32, False, 1, 130) == paged.PagedPlan(26, 5, False, False)
    assert paged.plan_paged(32, False, 1, 131) == paged.PagedPlan(27, 5, False, True)
    assert paged.plan_paged(8, False, 1, 3) == paged.PagedPlan(3, 1, False, False)
    assert paged.plan_paged(4, True, 4, 16).tail and not paged.plan_paged(4, True, 1, 16).tail
    with pytest.raises(ValueError, match="num_splits"):
        paged.plan_paged(0, False, 1, 4)


@pytest.mark.parametrize("table, lengths, message", [
    ([[3, 1, 0]], [40], None),
    ([[3, -1, -1]], [16], None),  # columns past the last page are never read: vLLM's padding is fine
    ([[3, 1, -1]], [17], None),
    ([[3, 4, 0]], [17], r"page_table\[0, 1\] = 4: must lie in 0-3"),
    ([[0, 1], [2, -1]], [32, 17], r"page_table\[1, 1\] = -1"),
    ([[0, 1]], [33], r"cache_seqlens\[0\] = 33: must lie in 0-32"),
    ([[0, 1]], [-1], r"cache_seqlens\[0\] = -1"),
])
def test_page_table_problem_names_the_first_bad_entry(table, lengths, message):
    got = paged.page_table_problem(table, lengths, num_pages=4, page_size=16)
    if message is None:
        assert got is None
    else:
        assert got is not None and re.search(message, got), got


@pytest.mark.parametrize("family, d, page_size, why", [
    ("ffpa", 512, 256, None),
    ("ffpa", 512, 64, None),
    ("ffpa", 512, 16, "multiple of 64"),
    ("fa4", 128, 16, None),
    ("fa4", 128, 8, "16-256"),
    ("fa4", 128, 512, "16-256"),
])
def test_paged_specs_say_which_page_sizes_each_family_reads(family, d, page_size, why):
    from xattn.core.spec import KernelSpec, supports

    spec = KernelSpec(family, "fwd", "bfloat16", d, d, 2, page_size=page_size)
    got = supports(spec)
    assert (got is None) if why is None else (why in got), got
    assert f"paged{page_size}" in spec.short_name()
    assert "page" in supports(KernelSpec(family, "bwd", "bfloat16", d, d, 2, page_size=64))
    assert supports(KernelSpec(family, "fwd", "bfloat16", d, d, 2, True, True, page_size=64)) is None  # prefill
    assert spec.output_fill() == ({"out": 0.0, "lse": float("-inf")} if family == "ffpa" else {})


def test_heads_first_pools_are_a_paged_layout_only():
    from xattn.core.spec import KernelSpec, supports

    assert supports(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, kv_heads_first=True)).startswith("kv_heads_first")
    spec = KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, 8, page_size=64, kv_heads_first=True)
    assert supports(spec) is None and spec.short_name().endswith("paged64h_sm_90a")


def test_fa4_key_tiles_are_flash_attns_own():
    """FA4_KEY_TILE (xattn.core.paged.tma_page_rows' table) is flash_attn.cute's sm90 forward tile, causal and not,
    and no other head dim has one tile for both."""
    pytest.importorskip("flash_attn.cute")
    from xattn.core.device import prepare_dsl_environment

    prepare_dsl_environment()
    from flash_attn.cute.interface import _tile_size_fwd_sm90

    shared = {}
    for d in (64, 96, 128, 192, 256):
        tiles = {_tile_size_fwd_sm90(d, d, causal, False).n_block_size for causal in (False, True)}
        if len(tiles) == 1:
            shared[d] = tiles.pop()
    assert paged.FA4_KEY_TILE == shared


@pytest.mark.parametrize("family, d, dv, page_size, rows", [
    ("fa4", 128, 128, 256, 64), ("fa4", 64, 64, 256, 128), ("fa4", 128, 128, 128, 64), ("fa4", 128, 128, 64, 64),
    ("fa4", 128, 128, 192, 64), ("fa4", 128, 128, 16, 16), ("fa4", 64, 64, 128, 128),
    ("fa4", 256, 256, 256, 256), ("fa4", 256, 256, 160, 80), ("fa4", 192, 128, 256, 256), ("ffpa", 512, 512, 256, 256),
    ("fa4", 96, 96, 256, 256)])
def test_tma_page_rows(family, d, dv, page_size, rows):
    assert paged.tma_page_rows(family, d, dv, page_size) == rows
