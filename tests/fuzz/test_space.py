"""The fuzz generator on the CPU: a small, supported launcher pool; deterministic, seed-addressable draws
that stay inside the pool and the size limits and cover every axis the fuzz promises."""

import importlib.util
import math
from collections import Counter
from pathlib import Path

import pytest

from xattn.core.spec import FA4_HEAD_DIMS, supports

from . import space
from .space import (FRONT_ENDS, GPU_LIMITS, POOL, config_seed, configs, draw, kvcache_launchers, launcher_pool,
                    paged_launchers, split_launchers)

N = 300


@pytest.fixture(scope="module")
def drawn():
    return {fe: configs(fe, n=N, base=space.DEFAULT_SEED, only=[]) for fe in FRONT_ENDS}


def test_pool_is_small_unique_and_supported():
    pool = launcher_pool()
    assert len(pool) == len(set(pool)) <= 60
    assert [s.short_name() for s in pool if supports(s) is not None] == []


def test_pool_covers_every_head_dim_dtype_gqa_and_mask():
    fa4 = [e for e in POOL if e.family == "fa4"]
    ffpa = [e for e in POOL if e.family == "ffpa"]
    assert {(e.head_dim, e.head_dim_v) for e in fa4} == set(FA4_HEAD_DIMS)
    assert {320, 384, 448, 512} <= {e.head_dim for e in ffpa}
    for family in (fa4, ffpa):
        assert {e.dtype for e in family} == {"bfloat16", "float16"}
        assert {e.g for e in family} >= {1, 2, 4, 8}
        assert {e.varlen for e in family} == {False, True}
        assert {e.causal for e in family} == {False, True}
    assert any(e.g not in (1, 2, 4, 8) for e in fa4)  # ratios that do not divide a tile
    windows = {e.window for e in fa4 if e.window != (None, None)}
    assert {(64, 0), (100, 37), (None, 128)} <= windows
    assert any(e.varlen and e.window != (None, None) for e in fa4)


def test_draws_are_deterministic_and_addressable_by_seed(drawn):
    again = configs("torch", n=20, base=space.DEFAULT_SEED, only=[])
    assert again == drawn["torch"][:20]
    for cfg in drawn["core"][:20]:
        assert draw("core", cfg.seed) == cfg
        assert cfg.id.startswith(f"s{cfg.seed}-")
    assert configs("core", n=5, base=1, only=[]) != configs("core", n=5, base=2, only=[])
    seeds = [config_seed(space.DEFAULT_SEED, fe, i) for fe in FRONT_ENDS for i in range(N)]
    assert len(set(seeds)) == len(seeds)


def test_environment_selects_seed_count_and_single_configurations(monkeypatch):
    monkeypatch.setenv("XATTN_FUZZ_SEED", "5")
    monkeypatch.setenv("XATTN_FUZZ_N", "7")
    monkeypatch.delenv("XATTN_FUZZ_ONLY", raising=False)
    cfgs = configs("jax")
    assert [c.seed for c in cfgs] == [config_seed(5, "jax", i) for i in range(7)]
    monkeypatch.setenv("XATTN_FUZZ_ONLY", f"s{cfgs[3].seed}, {cfgs[5].seed}")
    assert configs("jax") == [cfgs[3], cfgs[5]]


def test_every_configuration_is_in_the_pool_and_within_limits(drawn):
    lim = GPU_LIMITS
    for cfgs in drawn.values():
        for c in cfgs:
            assert c.entry in POOL and all(supports(s) is None for s in c.specs())
            assert c.heads_q == c.entry.g * c.heads_kv <= lim.max_heads_q
            assert c.total_q >= 1 and c.total_k >= 1 and c.scores() <= lim.max_scores
            assert 1 <= c.seqlen_q <= lim.max_n and 1 <= c.seqlen_k <= lim.max_n and c.scale > 0
            if c.varlen:
                assert len(c.lens_q) == len(c.lens_k) == c.batch <= lim.max_docs
                assert c.seqlen_q >= max(c.lens_q) and c.seqlen_k >= max(c.lens_k)  # max_seqlen: a bound
                assert (c.total_q, c.total_k) == (sum(c.lens_q) + c.extra_q, sum(c.lens_k) + c.extra_k)
                assert not c.opt("same_cu") or list(c.lens_q) == list(c.lens_k)
            else:
                assert 1 <= c.batch <= lim.max_batch and c.lens_q == c.lens_k == ()


def test_300_draws_cover_every_axis(drawn):
    for fe, cfgs in drawn.items():
        assert {c.entry for c in cfgs} == set(POOL), fe
        dense = [c for c in cfgs if not c.varlen]
        varlen = [c for c in cfgs if c.varlen]
        assert any(c.seqlen_q != c.seqlen_k for c in dense) and any(c.seqlen_q == c.seqlen_k for c in dense)
        assert any(1 in (c.seqlen_q, c.seqlen_k) for c in dense)
        assert any(c.seqlen_q > c.seqlen_k and c.entry.causal for c in dense)  # rows that see no key
        assert sum(c.seqlen_q % 16 != 0 for c in dense) > len(dense) // 2  # not a multiple of any tile
        assert {c.batch for c in dense} >= {1, 2, 3}
        assert {c.heads_kv for c in cfgs} >= {1, 2}
        assert any(0 in c.lens_q for c in varlen) and any(0 in c.lens_k for c in varlen)  # empty documents
        assert any(1 in c.lens_q for c in varlen) and any(1 in c.lens_k for c in varlen)
        assert any(len(c.lens_q) > 1 for c in varlen)
        assert any(c.scale != 1 / math.sqrt(c.entry.head_dim) for c in cfgs)
        kinds = Counter(kind.split(":")[0] for c in cfgs for _, kind in c.layouts)
        expected = {"swapped"} if fe == "jax" else {"swapped", "padded", "wide"}
        assert expected <= set(kinds), (fe, kinds)
    for fe in ("core", "core-jax", "torch", "jax"):  # every public window form, and refused forms
        forms = {(c.entry.causal, c.entry.window is not None and c.entry.window[1] == 0, c.opt("spelling"))
                 for c in drawn[fe] if c.opt("spelling")}
        assert any(s[1][0] == -1 or s[1][1] == -1 for *_, s in forms), fe  # FlashAttention-2's -1
        assert any(s[0] and s[1] != (None, None) for *_, s in forms), fe  # causal with a window spelled out
        refused = [c.opt("refuse") for c in drawn[fe] if c.opt("refuse")]
        assert {r[2] for r in refused} == {"ValueError", "TypeError", "NotImplementedError"}, fe
        assert any(c.entry.family == "ffpa" and c.opt("refuse")[2] == "NotImplementedError"
                   for c in drawn[fe] if c.opt("refuse")), fe
    assert {c.opt("stream") for c in drawn["core"]} == {"current", "explicit"}
    assert {c.opt("outputs") for c in drawn["core-jax"]} == {"torch", "tvm_ffi"}
    assert {c.opt("entry") for c in drawn["torch"]} == {"attention_with_lse", "flash_attn_func"}
    assert {c.opt("max_seqlen") for c in drawn["torch"] if c.varlen} == {"exact", "loose"}
    assert {c.opt("jit") for c in drawn["jax"]} == {False, True}
    assert len({(c.batch, c.seqlen_q, c.seqlen_k) for c in drawn["jax"] if not c.varlen}) < 150  # shape buckets


def test_prefill_script_lists_the_pool():
    path = Path(__file__).resolve().parents[2] / "scripts" / "prefill_gpu_cache.py"
    spec = importlib.util.spec_from_file_location("prefill_gpu_cache", path)
    prefill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prefill)
    with_pool = set(prefill.specs(fuzz=True))
    assert set(launcher_pool()) <= with_pool
    want = set(launcher_pool() + split_launchers() + paged_launchers() + kvcache_launchers())
    shipped = {s for s in want if not hasattr(s, "page_size") or supports(s) is None}  # paged: page sizes it runs
    assert with_pool - set(prefill.specs()) == shipped - set(prefill.specs())


def test_packed_draws_cover_the_whole_varlen_contract(drawn):
    """Issue #42: the packed draws reach what the contract allows beyond the routes' own cases, in both front
    ends that choose routes: rows after cu[-1] on either side, Tq != Tk with one cu_seqlens object,
    max_seqlen_q above and below max_seqlen_k, max_seqlen looser than the longest document, empty and
    1-token documents; and the configurations with a choice of routes run every one of them."""
    from .harness import routes_of

    for front_end in ("torch", "jax"):
        packed = [c for c in drawn[front_end] if c.varlen]
        seen = {
            "trailing rows q": any(c.extra_q for c in packed),
            "trailing rows k": any(c.extra_k for c in packed),
            "one cu_seqlens, Tq != Tk": any(c.opt("same_cu") and c.total_q != c.total_k for c in packed),
            "max_seqlen_q > max_seqlen_k": any(c.seqlen_q > c.seqlen_k for c in packed),
            "max_seqlen_q < max_seqlen_k": any(c.seqlen_q < c.seqlen_k for c in packed),
            "loose max_seqlen": any(c.seqlen_q > max(c.lens_q) for c in packed),
            "empty document": any(0 in c.lens_q for c in packed),
            "1-token document": any(1 in c.lens_q for c in packed),
            "two cu_seqlens objects": any(not c.opt("same_cu") for c in packed),
        }
        assert all(seen.values()), (front_end, [k for k, v in seen.items() if not v])
        ffpa = [c for c in packed if c.entry.family == "ffpa"]
        ran = {r for c in ffpa for r in routes_of(c)}
        want = {"fused", "gemm-segments"} | ({"gemm-dense", "gemm-groups", "gemm-groups+fused"} if front_end == "torch"
                                            else {"gemm-padded", "gemm-segments|fused"})
        assert want <= ran, (front_end, want - ran)


def test_decoding_draws_force_the_split_route(drawn):
    """Issue #43: torch's dense draws force the split-KV forward where it can serve, in both families, with a
    causal tail (causal, 2-16 queries) and with heads-major (HF cache) storage of k and v. Issue #44: they also run
    the paged route (both families, windows, causal tails, several sequences)."""
    from .harness import routes_of

    split = [c for c in drawn["torch"] if "split-kv" in routes_of(c)]
    seen = {
        "ffpa": any(c.entry.family == "ffpa" for c in split),
        "fa4": any(c.entry.family == "fa4" for c in split),
        "one query": any(c.seqlen_q == 1 for c in split),
        "causal tail": any(c.entry.causal and c.seqlen_q > 1 for c in split),
        "heads-major k/v": any(c.layout("k") == "swapped" for c in split),
        "batch > 1": any(c.batch > 1 for c in split),
    }
    assert all(seen.values()), [k for k, v in seen.items() if not v]
    paged = [c for c in drawn["torch"] if "paged" in routes_of(c)]
    assert {c.entry.family for c in paged} == {"ffpa", "fa4"} and any(c.batch > 1 for c in paged) and \
        any(c.entry.window != (None, None) for c in paged) and any(c.entry.causal and c.seqlen_q > 1 for c in paged)
    from .harness import PAGE_SIZES, page_size

    for family, sizes in PAGE_SIZES.items():  # both page sizes of each family (FA4's 128: its TMA path at d64-128)
        assert {page_size(c) for c in paged if c.entry.family == family} == set(sizes), family
    packed_paged = [c for c in paged if c.varlen]  # vLLM's varlen call; decoding batches split over the pages
    assert {c.entry.family for c in packed_paged} == {"ffpa", "fa4"} and \
        any(c.seqlen_q <= 16 for c in packed_paged) and any(c.seqlen_q > 16 for c in packed_paged)
    for front_end in ("torch", "jax"):  # packed decoding batches (varlen, at most 16 queries per document)
        packed = [c for c in drawn[front_end] if c.varlen and "split-kv" in routes_of(c)]
        assert {c.entry.family for c in packed} == {"ffpa", "fa4"} and \
            any(c.entry.causal and c.seqlen_q > 1 for c in packed) and any(0 in c.lens_q for c in packed) and \
            any(c.extra_q for c in packed), front_end
    jax_paged = [c for c in drawn["jax"] if "paged" in routes_of(c)]  # Pallas' paged_attention call
    assert {c.entry.family for c in jax_paged} == {"ffpa", "fa4"} and any(c.batch > 1 for c in jax_paged)
    jax_split = [c for c in drawn["jax"] if "split-kv" in routes_of(c)]
    assert {c.entry.family for c in jax_split} == {"ffpa", "fa4"} and any(c.seqlen_q > 1 and c.entry.causal
                                                                          for c in jax_split)
