"""The split-KV route's rule and plans (xattn.core.routes.forward_route, xattn.core.split_kv): pure Python."""

import pytest

from xattn.core import routes, split_kv
from xattn.core.routes import FwdProblem


def decode(family="ffpa", b=1, hkv=4, g=8, nq=1, nk=32768, **kw):
    return FwdProblem(family, b, hkv, g, nq, nk, **kw)


@pytest.mark.parametrize("problem, name, splits", [
    pytest.param(decode(), "split-kv", 32, id="d512-B1-32k: 4 CTAs -> 33 splits of 1024 keys -> 32 filled"),
    pytest.param(decode(b=8), "split-kv", 4, id="d512-B8: 32 CTAs -> 4 splits"),
    pytest.param(decode(b=8, nq=4, causal=True), "split-kv", 4, id="d512-B8-q4-causal"),
    pytest.param(decode("fa4", hkv=8, g=4, nk=131072), "split-kv", 16, id="d128-B1-128k"),
    pytest.param(decode("fa4", hkv=16, g=2, nk=8192), "split-kv", 8, id="d256-B1-8k"),
    pytest.param(decode(b=64), "fused", None, id="B64: the fused CTAs fill the GPU"),
    pytest.param(decode(nk=300), "fused", None, id="300 keys: too short to split"),
    pytest.param(decode(nq=17), "fused", None, id="17 queries: prefill"),
    pytest.param(decode("fa4", local=True), "fused", None, id="sliding window"),
    pytest.param(decode(varlen=True), "split-kv", 33, id="packed decoding: 33 splits, each document its chunk"),
    pytest.param(decode(varlen=True, nq=17), "fused", None, id="packed prefill"),
    pytest.param(decode(flat_kv=False), "fused", None, id="no common row stride"),
    pytest.param(decode(num_splits=1), "fused", None, id="num_splits=1"),
    pytest.param(decode(b=64, num_splits=3), "split-kv", 3, id="num_splits=3 overrides the rule"),
])
def test_forward_route_rule(problem, name, splits):
    route = routes.forward_route(problem, "auto")
    assert route.name == name, route.reason
    assert (route.plan.splits if route.plan else None) == splits
    assert route.plan is None or route.plan.tail == (problem.causal and problem.seqlen_q > 1)
    assert len(route.rejected()) == 1


def test_forced_forward_route(monkeypatch):
    assert routes.forward_route(decode(), "fused").name == "fused"
    assert routes.forward_route(decode(nk=300), "split-kv").plan.splits == 2  # forced: at least 2
    with pytest.raises(ValueError, match="at most 16"):
        routes.forward_route(decode(varlen=True, nq=17), "split-kv")
    assert routes.forward_route(decode(varlen=True), "split-kv").plan.chunk == 0  # each document's own chunk
    with pytest.raises(ValueError, match="XATTN_FWD_ROUTE"):
        routes.forward_route(decode(), "fastest")
    monkeypatch.setenv("XATTN_FWD_ROUTE", "fused")
    assert routes.forward_route(decode()).name == "fused"
    with routes.forced_forward("split-kv"):
        assert routes.forward_route(decode(b=64)).name == "split-kv"


@pytest.mark.parametrize("splits, causal, nq", [(2, False, 1), (5, True, 3), (33, False, 1), (4, True, 16)])
@pytest.mark.parametrize("lengths, rows", [([1], 1), ([0, 7], 7), ([1000, 5, 300], 1000), ([40, 2000], 8000)])
def test_split_cu_seqlens_cover_every_key_once(splits, causal, nq, lengths, rows):
    """Per sequence, the slots' keys are exactly its valid keys, each once; cu_seqlens never decrease and
    end inside the flat view; every query slot holds Nq rows."""
    if max(lengths) > rows:
        pytest.skip("a sequence longer than the row stride is not a flat view")
    plan = split_kv.plan_splits(splits, causal, nq, None)
    key_rows = rows * (len(lengths) - 1) + max(lengths)
    cu_q, cu_k, tail_q, tail_k = split_kv.split_cu_seqlens(plan, nq, rows, lengths, key_rows)
    p = plan.partials
    assert len(cu_q) == len(cu_k) == len(lengths) * (p + 1) + 1
    assert all(a <= b for a, b in zip(cu_k, cu_k[1:])) and cu_k[-1] <= key_rows
    assert cu_q[-1] == len(lengths) * p * nq
    for b, length in enumerate(lengths):
        docs = range(b * (p + 1), b * (p + 1) + p)
        seen = [k for j in docs for k in range(cu_k[j], cu_k[j + 1])]
        if plan.tail:
            j = 2 * b + 1
            assert tail_q[j + 1] - tail_q[j] == nq
            seen += list(range(tail_k[j], tail_k[j + 1]))
            assert tail_k[j + 1] - tail_k[j] == min(length, nq)
        assert sorted(seen) == list(range(b * rows, b * rows + length))
        assert all(cu_q[j + 1] - cu_q[j] == nq for j in docs)
    if plan.tail:
        assert all(a <= b for a, b in zip(tail_k, tail_k[1:])) and tail_q[-1] == len(lengths) * nq


@pytest.mark.parametrize("splits, nq, nk", [(2, 2, 300), (5, 3, 1000), (33, 4, 32768), (4, 16, 17)])
def test_tail_in_place_layout_covers_every_key_once(splits, nq, nk):
    """One sequence, Nk > Nq: the split launch (its splits alone, on the keys before the tail) ends its
    queries at S Nq rows, where the tail slot starts; with the tail launch every key is seen once."""
    plan = split_kv.plan_splits(splits, True, nq, nk)
    assert plan.filled and plan.tail_in_place(1) and not plan.prefill(1)
    assert not plan.tail_in_place(2) and plan.prefill(2)
    cu_q, cu_k, _, _ = split_kv.split_cu_seqlens(split_kv.splits_only(plan), nq, nk, [nk - nq], nk)
    _, _, tail_q, tail_k = split_kv.split_cu_seqlens(plan, nq, nk, [nk], nk)
    assert cu_q[-1] == plan.splits * nq == (plan.partials - 1) * nq and tail_q == [0, 0, nq]
    seen = [k for j in range(plan.splits) for k in range(cu_k[j], cu_k[j + 1])]
    assert all(cu_k[j + 1] > cu_k[j] for j in range(plan.splits))  # no empty split: no row left unwritten
    assert sorted(seen + list(range(tail_k[1], tail_k[2]))) == list(range(nk))
    assert not split_kv.plan_splits(splits, True, nq, nq).filled  # no key before the tail: pre-filled


def test_split_bounds_are_key_tile_multiples():
    plan = split_kv.plan_splits(33, False, 1, 32768)
    bounds = split_kv.split_bounds(plan, 32768, 1)
    assert all(lo % split_kv.KEY_TILE == 0 for lo, _ in bounds) and bounds[-1][1] == 32768
    with pytest.raises(ValueError, match="num_splits"):
        split_kv.plan_splits(split_kv.MAX_PARTIALS, False, 1, 10)


def test_combine_chunk_holds_every_partial_up_to_the_largest_chunk():
    assert [split_kv.combine_chunk(p) for p in (1, 2, 4, 5, 8, 9, 16, 17, 33, split_kv.MAX_PARTIALS)] == \
        [4, 4, 4, 8, 8, 16, 16, 16, 16, 16]
    assert split_kv.CombineSpec("fa4", "bfloat16", 128).chunk == max(split_kv.COMBINE_CHUNKS)
    names = {split_kv.CombineSpec("fa4", "bfloat16", 128, c).short_name() for c in split_kv.COMBINE_CHUNKS}
    assert len(names) == len(split_kv.COMBINE_CHUNKS)  # one disk entry per chunk


def test_combine_spec_names_a_disk_cache_entry():
    import re

    from xattn.core import disk_cache
    stem = disk_cache.entry_stem(split_kv.CombineSpec("ffpa", "bfloat16", 512))
    assert re.match(disk_cache._STEM, stem), stem


def test_fa4_d128_split_launch_takes_the_decode_tile_and_nothing_else_does():
    import dataclasses
    import re

    from xattn.core import disk_cache
    from xattn.core.spec import KernelSpec

    base = KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, varlen=True)
    tiled = split_kv.split_launch_spec(base)
    assert isinstance(tiled, split_kv.SplitFwdSpec) and (tiled.tile_m, tiled.tile_n) == split_kv.SPLIT_TILES[128, 128]
    assert tiled != base and hash(tiled) != hash(base) and tiled.output_fill() == base.output_fill()
    assert tiled.short_name() == "fa4_fwd_bfloat16_d128x128_g4_full_varlen_t64x64_sm_90a"
    assert tiled.target_name() != base.target_name()
    stems = {disk_cache.entry_stem(s) for s in (base, tiled)}
    assert len(stems) == 2 and all(re.match(disk_cache._STEM, x) for x in stems)
    assert split_kv.split_launch((base, "problem")) == (tiled, "problem")
    dense = split_kv.split_launch_spec(dataclasses.replace(base, varlen=False))  # the slot launch's (one sequence)
    assert isinstance(dense, split_kv.SplitFwdSpec) and not dense.varlen and not dense.shared_q
    assert dense.short_name() == "fa4_fwd_bfloat16_d128x128_g4_full_dense_t64x64_sm_90a"
    for other in (dataclasses.replace(base, causal=True), dataclasses.replace(base, varlen=False, causal=True),
                  dataclasses.replace(base, family="ffpa", head_dim=512, head_dim_v=512),
                  dataclasses.replace(base, head_dim=256, head_dim_v=256), dataclasses.replace(base, window_left=64),
                  dataclasses.replace(base, page_size=64), dataclasses.replace(base, direction="bwd"), tiled,
                  dataclasses.replace(base, varlen=False, page_size=128),
                  dataclasses.replace(base, varlen=False, page_size=64, causal=True)):
        assert split_kv.split_launch_spec(other) is other, other.short_name()
    for heads_first in (False, True):  # the paged split launch over pages of exactly the tile's keys (TMA)
        paged = dataclasses.replace(base, varlen=False, page_size=64, kv_heads_first=heads_first)
        tiled_paged = split_kv.split_launch_spec(paged)
        assert isinstance(tiled_paged, split_kv.SplitFwdSpec) and tiled_paged.page_size == 64
        assert tiled_paged.kv_heads_first == heads_first and tiled_paged.num_threads == 256
        assert tiled_paged.short_name().endswith("_t64x64_sm_90a") and tiled_paged != paged


def test_the_contiguous_decode_tile_reads_q_as_it_is_only_when_asked():
    """shared_q: torch's contiguous FA4 d128 split launch (its own key and entry); JAX's and the paged one keep q
    once per slot; a paged or dense key cannot take it."""
    import dataclasses

    from xattn.core import disk_cache
    from xattn.core.spec import KernelSpec

    base = KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, varlen=True)
    shared, copied = split_kv.split_launch_spec(base, shared_q=True), split_kv.split_launch_spec(base)
    assert shared.shared_q and not copied.shared_q and shared != copied
    assert shared.short_name() == "fa4_fwd_bfloat16_d128x128_g4_full_varlen_t64x64_sq_sm_90a"
    assert disk_cache.entry_stem(shared) != disk_cache.entry_stem(copied)
    assert split_kv.split_launch((base, "problem"), True) == (shared, "problem")
    paged = dataclasses.replace(base, varlen=False, page_size=64)
    assert not split_kv.split_launch_spec(paged, shared_q=True).shared_q
    assert split_kv.split_launch_spec(dataclasses.replace(base, head_dim=256, head_dim_v=256), True).__class__ is \
        KernelSpec
    assert split_kv.shared_queries("fa4", 128, 128, 4) and not split_kv.shared_queries("fa4", 256, 256, 4)
    assert not split_kv.shared_queries("ffpa", 512, 512, 8)
    assert not split_kv.shared_queries("fa4", 128, 128, 1)  # an unpacked q: FlashAttention loads it by TMA only
    g1 = KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 1, varlen=True)
    assert not split_kv.split_launch_spec(g1, shared_q=True).shared_q
    fields = {f: getattr(paged, f) for f in KernelSpec.__dataclass_fields__}
    with pytest.raises(ValueError, match="shared_q"):
        split_kv.SplitFwdSpec(**fields, shared_q=True)


@pytest.mark.parametrize("tile", [(32, 64), (192, 64), (64, 8), (64, 72), (64, 512)])
def test_a_decode_tile_the_kernel_cannot_take_is_refused_when_its_key_is_made(tile):
    from xattn.core.spec import KernelSpec

    base = KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, varlen=True)
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    with pytest.raises(ValueError, match=f"{tile[0]}x{tile[1]}"):
        split_kv.SplitFwdSpec(**fields, tile_m=tile[0], tile_n=tile[1])
    assert split_kv.SplitFwdSpec(**fields, tile_m=128, tile_n=128).num_threads == 384


def test_info_lists_the_forward_route_rule(monkeypatch):
    lines = routes.forward_table()
    assert any("split-kv" in x for x in lines) and any("XATTN_FWD_ROUTE=auto" in x for x in lines)
    monkeypatch.setenv("XATTN_FWD_ROUTE", "fastest")
    with pytest.raises(ValueError, match="fastest"):
        routes.forward_table()
