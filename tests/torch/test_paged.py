"""attention_with_kvcache(..., page_table=) on a paged KV cache, on the CPU stand-ins (issue #44): shuffled and
non-contiguous page tables, a partly filled last page, page sizes 16/64/256, GQA 1/4/8, both families, the
split entries and the causal tail, the append through the table, and the named errors of checked mode."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention
from xattn.core import split_kv
from xattn.core.paged import PageTableError

from . import stubs

CALLS = stubs.CALLS


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)


def _paged_cache(lengths, max_pages, page_size, hkv, d, g, spare=3):
    """A pool with every sequence's pages at shuffled places (and spare pages), its table, and the same keys
    laid out contiguously per sequence (the reference's view)."""
    b = len(lengths)
    num_pages = b * max_pages + spare
    k_pool = torch.randn(num_pages, page_size, hkv, d, generator=g, dtype=torch.float64)
    v_pool = torch.randn(num_pages, page_size, hkv, d, generator=g, dtype=torch.float64)
    order = torch.randperm(num_pages, generator=g)[:b * max_pages]
    table = order.view(b, max_pages).to(torch.int32)
    return k_pool, v_pool, table


def _contiguous(pool, table):
    return pool[table.long()].flatten(1, 2)  # [B, max_pages * page_size, Hkv, D]


def _expected(q, k_pool, v_pool, table, lengths, causal, window, scale):
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    outs, lses = zip(*(ref_attention(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], scale=scale, causal=causal,
                                     window=window) for i, n in enumerate(lengths)))
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("family, nq, hq, hkv, page_size, max_pages, lengths, new, causal, window", [
    pytest.param("ffpa", 1, 8, 1, 64, 9, [0, 300, 575], 1, True, (None, None), id="ffpa-decode-g8-ps64"),
    pytest.param("ffpa", 4, 8, 2, 256, 3, [700, 5], 4, True, (None, None), id="ffpa-speculative-tail-ps256"),
    pytest.param("ffpa", 3, 4, 4, 128, 5, [129, 640], 0, False, (None, None), id="ffpa-mha-full-table"),
    pytest.param("fa4", 1, 8, 2, 16, 40, [1, 639, 17], 1, True, (None, None), id="fa4-decode-g4-ps16"),
    pytest.param("fa4", 2, 4, 1, 64, 7, [400, 63], 2, True, (None, None), id="fa4-tail-g4-ps64"),
    pytest.param("fa4", 1, 8, 1, 16, 12, [150, 30], 1, False, (24, 0), id="fa4-window"),
])
def test_paged_matches_fp64(num_splits, family, nq, hq, hkv, page_size, max_pages, lengths, new, causal, window):
    g = torch.Generator().manual_seed(page_size + max_pages + nq)
    d = 16
    cap = max_pages * page_size
    lengths = [min(n, cap - new) for n in lengths]
    k_pool, v_pool, table = _paged_cache(lengths, max_pages, page_size, hkv, d, g)
    q = torch.randn(len(lengths), nq, hq, d, generator=g, dtype=torch.float64)
    k_new = torch.randn(len(lengths), new, hkv, d, generator=g, dtype=torch.float64) if new else None
    v_new = torch.randn_like(k_new) if new else None
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    untouched = [p for p in range(k_pool.shape[0]) if p not in set(table.flatten().tolist())]
    spare_before = k_pool[untouched].clone()
    if new:  # the reference: the new rows written into the contiguous view by hand
        kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
        for i, n in enumerate(lengths):
            kc[i, n:n + new], vc[i, n:n + new] = k_new[i], v_new[i]
    out, lse = xt.attention_with_kvcache(q, k_pool, v_pool, k_new, v_new, cache_seqlens=seqlens, causal=causal,
                                         window_size=window, num_splits=num_splits, return_softmax_lse=True,
                                         page_table=table, family=family, check_inputs=True)
    assert torch.equal(k_pool[untouched], spare_before)  # the append wrote through the table only
    total = [n + new for n in lengths]
    if new:
        assert torch.equal(_contiguous(k_pool, table)[0, :total[0]], kc[0, :total[0]])
    want_out, want_lse = _expected(q, k_pool, v_pool, table, total, causal, window, d ** -0.5)
    assert (out - want_out).abs().max() < 1e-6, (out - want_out).abs().max()  # fp32 partial lse: ~1e-7
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse[~torch.isneginf(lse)].double(), want_lse[~torch.isneginf(want_lse)], atol=1e-5)
    auto = split_kv.decode_splits(family, len(lengths), hkv, hq // hkv, nq, cap, 132)
    split = (num_splits or auto) > 1 and window == (None, None)
    assert (("combine", family) in CALLS) == split, (num_splits, auto)


def test_block_table_is_page_table_and_the_errors_are_named():
    g = torch.Generator().manual_seed(1)
    k_pool, v_pool, table = _paged_cache([40, 20], 3, 16, 2, 16, g)
    q = torch.randn(2, 1, 4, 16, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([40, 20], dtype=torch.int32)
    a = xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, family="fa4")
    b = xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table, family="fa4")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="give one"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, block_table=table)
    bad = table.clone()
    bad[1, 1] = k_pool.shape[0]  # past the pool, in a page sequence 1 uses (keys 16-19)
    with pytest.raises(PageTableError, match=r"page_table\[1, 1\] = 9: must lie in 0-8"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=bad, family="fa4",
                                  check_inputs=True)
    bad[1, 1], bad[0, 2] = table[1, 1], -1
    with pytest.raises(PageTableError, match=r"page_table\[0, 2\] = -1"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=bad, family="fa4",
                                  check_inputs=True)
    with pytest.raises(ValueError, match="int32"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table.long())
    with pytest.raises(ValueError, match="cache_seqlens\\[0\\] = 49"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=torch.tensor([49, 0], dtype=torch.int32),
                                  page_table=table, check_inputs=True)
    with pytest.raises(ValueError, match=r"v_cache: expected torch.float64"):
        xt.attention_with_kvcache(q, k_pool, v_pool.float(), cache_seqlens=seqlens, page_table=table)
    with pytest.raises(ValueError, match=r"k_cache: expected torch.float64"):
        xt.paged_attention(q[:, 0], k_pool.float(), v_pool, table, seqlens, cu_seqlens_q=torch.tensor(
            [0, 1, 2], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table, family="ffpa")
    strided = torch.randn(6, 2, 64, 16, dtype=torch.float64).transpose(1, 2)[:, :64]  # pages not one after another
    t2 = torch.arange(4, dtype=torch.int32).view(2, 2)
    with pytest.raises(ValueError, match="flat"):
        xt.attention_with_kvcache(q, strided, strided, cache_seqlens=seqlens, page_table=t2, family="ffpa")


@pytest.mark.parametrize("family, ps, hkv", [("ffpa", 64, 2), ("fa4", 16, 1), ("fa4", 64, 4)])
def test_paged_attention_packed_prefill_and_decode_mix(family, ps, hkv):
    """vLLM's call: packed queries (a 37-token prefill, a 1-token decode, an empty request, a 5-token chunk),
    each on its own paged keys, causal bottom-right; trailing rows past cu_seqlens_q[-1] read 0 / -inf."""
    g = torch.Generator().manual_seed(ps + hkv)
    d, hq, max_pages = 16, 4, 6
    lengths = [min(n, max_pages * ps) for n in (37, 200, 0, 60)]
    k_pool, v_pool, table = _paged_cache(lengths, max_pages, ps, hkv, d, g)
    q_lens = [min(37, lengths[0]), 1, 0, 5]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + 3, hq, d, generator=g, dtype=torch.float64)  # 3 trailing rows
    seqused = torch.tensor(lengths, dtype=torch.int32)
    out, lse = xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                                  causal=True, return_softmax_lse=True, family=family, check_inputs=True)
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    for i, (a, z) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if z == a:
            continue
        want, want_lse = ref_attention(q[None, a:z], kc[i:i + 1, :lengths[i]], vc[i:i + 1, :lengths[i]],
                                       scale=d ** -0.5, causal=True)
        assert (out[a:z] - want[0]).abs().max() < 1e-10
        assert (lse[:, a:z].double() - want_lse[0]).abs().max() < 1e-5
    assert torch.all(out[int(cu[-1]):] == 0) and torch.all(torch.isneginf(lse[:, int(cu[-1]):]))
    dense = xt.paged_attention(q[None, :1], k_pool, v_pool, table[:1], seqused[:1], family=family)  # the decode path
    want, _ = ref_attention(q[None, :1], kc[:1, :lengths[0]], vc[:1, :lengths[0]], scale=d ** -0.5)
    assert (dense - want).abs().max() < 1e-10
    with pytest.raises(ValueError, match="cu_seqlens_q: expected int32"):
        xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu[:-1])
    bad = cu.clone()
    bad[2] = bad[1] - 1
    with pytest.raises(ValueError, match="never decrease"):
        xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=bad, family=family, check_inputs=True)


def test_the_fa4_shims_paged_varlen_call_runs_on_xattn():
    """flash_attn.cute's ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=..., seqused_k=...,
    page_table=...)`` (vLLM's call) is served by xattn's paged launchers, lse as flash_attn.cute returns it."""
    from xattn.torch import fa4_interface

    g = torch.Generator().manual_seed(5)
    k_pool, v_pool, table = _paged_cache([50, 9], 4, 16, 2, 16, g)
    seqused = torch.tensor([50, 9], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4], dtype=torch.int32)
    q = torch.randn(4, 4, 16, generator=g, dtype=torch.float64)
    out, lse = fa4_interface.flash_attn_varlen_func(q, k_pool, v_pool, cu_seqlens_q=cu, max_seqlen_q=3,
                                                    seqused_k=seqused, page_table=table, causal=True,
                                                    return_lse=True)
    want = xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, causal=True, family="fa4")
    assert torch.equal(out, want) and lse.shape == (4, 4) and ("paged", "fa4") in CALLS
    _, no_lse = fa4_interface.flash_attn_varlen_func(q, k_pool, v_pool, cu_seqlens_q=cu, seqused_k=seqused,
                                                     page_table=table, causal=True)
    assert no_lse is None


@pytest.mark.parametrize("family, ps, hq, hkv, q_lens, lengths, causal", [
    pytest.param("ffpa", 64, 8, 1, [1, 1, 0, 1], [600, 1, 0, 250], True, id="ffpa-decode-empty-request"),
    pytest.param("ffpa", 128, 4, 2, [4, 2, 3], [900, 1, 130], True, id="ffpa-speculative-tail-longer-than-keys"),
    pytest.param("fa4", 16, 8, 2, [16, 1], [700, 33], False, id="fa4-16-queries"),
    pytest.param("fa4", 64, 4, 4, [2, 1, 1], [511, 64, 65], True, id="fa4-ps64-mha"),
])
def test_paged_packed_decoding_on_the_split_route(family, ps, hq, hkv, q_lens, lengths, causal):
    """vLLM's decode step (packed queries, at most 16 per request, max_seqlen_q given) on the split route over the
    pages, forced: empty requests, fewer keys than queries, rows past cu_seqlens_q[-1]; out and lse vs fp64."""
    g = torch.Generator().manual_seed(ps + sum(lengths))
    d, max_pages = 16, -(-max(lengths) // ps) + 1
    k_pool, v_pool, table = _paged_cache(lengths, max_pages, ps, hkv, d, g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]) + 2, hq, d, generator=g, dtype=torch.float64)  # 2 trailing rows
    seqused = torch.tensor(lengths, dtype=torch.int32)
    from xattn.core import routes

    with routes.forced_forward("split-kv"):
        out, lse = xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                                      causal=causal, return_softmax_lse=True, family=family, check_inputs=True)
    assert ("combine", family) in CALLS, "the split route did not run"
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    for i, (a, z) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        if z == a:
            continue
        want, want_lse = ref_attention(q[None, a:z], kc[i:i + 1, :lengths[i]], vc[i:i + 1, :lengths[i]],
                                       scale=d ** -0.5, causal=causal)
        finite = torch.isfinite(want_lse[0])
        assert (out[a:z] - want[0]).abs().max() < 1e-6
        assert torch.equal(torch.isfinite(lse[:, a:z]), finite)
        torch.testing.assert_close(lse[:, a:z][finite].double(), want_lse[0][finite], atol=1e-5, rtol=1e-5)
    assert torch.all(out[int(cu[-1]):] == 0) and torch.all(torch.isneginf(lse[:, int(cu[-1]):]))


def test_paged_packed_decoding_takes_the_rule_and_max_seqlen_q_is_checked():
    """auto: a one-token-per-request batch on long paged caches splits (given max_seqlen_q), one launch without it;
    checked mode names a request with more queries than max_seqlen_q."""
    g = torch.Generator().manual_seed(9)
    lengths = [3000, 2000]
    k_pool, v_pool, table = _paged_cache(lengths, 48, 64, 1, 16, g)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    q = torch.randn(2, 8, 16, generator=g, dtype=torch.float64)
    seqused = torch.tensor(lengths, dtype=torch.int32)
    split = xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, max_seqlen_q=1, causal=True,
                               family="ffpa")
    assert ("combine", "ffpa") in CALLS
    CALLS.clear()
    one = xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, causal=True, family="ffpa")
    assert CALLS == [("paged", "ffpa")]
    torch.testing.assert_close(split, one, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="max_seqlen_q=1: sequence 1 has 2 queries"):
        xt.paged_attention(torch.cat([q, q[:1]]), k_pool, v_pool, table, seqused,
                           cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32), max_seqlen_q=1, family="ffpa",
                           check_inputs=True)
    with pytest.raises(ValueError, match="max_seqlen_q: expected"):
        xt.paged_attention(q, k_pool, v_pool, table, seqused, cu_seqlens_q=cu, max_seqlen_q=1.0, family="ffpa")


def test_paged_decode_follows_the_forward_route_request():
    """The paged decode asks xattn.core.routes like the contiguous one: XATTN_FWD_ROUTE=fused gives one launch,
    split-kv forced on a short cache splits, and forced with a window raises naming the window."""
    from xattn.core import routes

    g = torch.Generator().manual_seed(11)
    k_pool, v_pool, table = _paged_cache([3000, 100], 48, 64, 1, 16, g)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64)
    seqlens = torch.tensor([3000, 100], dtype=torch.int32)
    call = lambda **kw: xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, page_table=table,  # noqa
                                                  family=kw.pop("family", "ffpa"), **kw)
    want = call()
    assert ("combine", "ffpa") in CALLS, CALLS  # the rule splits 3000 keys at B 2
    CALLS.clear()
    with routes.forced_forward("fused"):
        torch.testing.assert_close(call(), want, atol=1e-6, rtol=1e-5)
    assert CALLS == [("paged", "ffpa")]
    short = table[:, :2]
    with routes.forced_forward("split-kv"):
        xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=torch.tensor([100, 3], dtype=torch.int32),
                                  page_table=short, family="ffpa")
        assert ("combine", "ffpa") in CALLS
        with pytest.raises(ValueError, match="window"):
            call(family="fa4", window_size=(8, 0))


def test_fa4_d96_unmasked_paged_kernel_is_supported_and_causal_decode_splits():
    """FA4's d96 paged forward without a mask failed the H200 fuzz with its 144-row key tile; xattn builds it with
    the causal config's 128-row tile (tests/core/test_compile_sm90.py), so the support matrix takes it again and a
    causal d96 decode takes the split route (unmasked split launches), matching fp64."""
    from xattn.core.spec import KernelSpec, supports

    for causal, window in ((False, (None, None)), (True, (None, None)), (False, (64, 0))):
        assert supports(KernelSpec("fa4", "fwd", "float16", 96, 96, 2, causal, False, *window, page_size=128)) is None
    g = torch.Generator().manual_seed(96)
    lengths = [1066, 1066, 900]
    k_pool, v_pool, table = _paged_cache(lengths, 9, 128, 4, 96, g)
    q = torch.randn(3, 3, 8, 96, generator=g, dtype=torch.float64)
    seqlens = torch.tensor(lengths, dtype=torch.int32)
    for causal in (True, False):
        CALLS.clear()
        out = xt.paged_attention(q, k_pool, v_pool, table, seqlens, causal=causal, num_splits=3, family="fa4")
        assert ("combine", "fa4") in CALLS, CALLS
        want, _ = _expected(q, k_pool, v_pool, table, lengths, causal, (None, None), 96 ** -0.5)
        torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family, nq, b, packed", [("ffpa", 1, 1, False), ("ffpa", 4, 1, False), ("fa4", 1, 1, False),
                                                   ("ffpa", 1, 3, False), ("ffpa", 1, 1, True), ("fa4", 4, 3, True)])
def test_a_split_decode_step_is_the_index_kernel_the_launches_and_the_combine(family, nq, b, packed, monkeypatch):
    """A decode step on the paged split route (lengths and table already int32 on the device) launches the index
    kernel, the split (and causal tail) launches and the combine, and no framework kernel but the queries' one
    broadcast copy at B > 1 (the index arithmetic, table copies and fills of the torch version were 4-14 kernels,
    each a launch on the decode step's critical path); vLLM's packed call adds three gathers (q in, out and lse
    back: 13 more kernels before)."""
    from xattn.core import routes

    from .framework_kernels import counting

    g = torch.Generator().manual_seed(5)
    k_pool, v_pool, table = _paged_cache([3000] * b, 48, 64, 2, 8, g)
    q = torch.randn(b, nq, 8, 8, generator=g, dtype=torch.float64)
    seqlens = torch.full((b,), 3000, dtype=torch.int32)
    cu = torch.arange(b + 1, dtype=torch.int32) * nq
    with routes.forced_forward("split-kv"):
        if packed:
            step = lambda: xt.paged_attention(q.flatten(0, 1), k_pool, v_pool, table, seqlens,  # noqa: E731
                                              cu_seqlens_q=cu, max_seqlen_q=nq, causal=True, family=family)
        else:
            step = lambda: xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,  # noqa: E731
                                                     page_table=table, causal=True, family=family)
        want = step()
        CALLS.clear()
        with counting(monkeypatch) as kernels:
            got = step()
    torch.testing.assert_close(got, want)
    assert sorted(kernels) == (["clone"] if b > 1 else []) + ["index_select"] * 3 * packed, kernels
    launches = [c[0] for c in CALLS]
    assert launches == ["paged_meta"] + ["paged"] * (1 + (nq > 1)) + ["combine"], launches



@pytest.mark.parametrize("page_size", [64, 128, 256])
def test_fa4_d128_paged_split_launch_reads_tile_pages_on_the_decode_tile(page_size, monkeypatch):
    """FA4 d128's paged split launch runs the core's decode tile (split_kv.SPLIT_TILES, 64 keys) on pages of 64 rows
    (a pool page of 128 or 256 read as 2 or 4 of them, the table mapped by the index kernel: TMA on the GPU); the
    causal tail keeps FlashAttention's own tile on the same pages; the result is the fp64 reference's."""
    from xattn.core import routes
    from xattn.core.spec import KernelSpec
    from xattn.core.split_kv import SplitFwdSpec
    from xattn.torch import ops

    specs, launch = [], ops.LAUNCH["paged"]
    monkeypatch.setitem(ops.LAUNCH, "paged", lambda spec, *a, **kw: (specs.append(spec), launch(spec, *a, **kw))[1])
    g = torch.Generator().manual_seed(page_size)
    lengths = [700, 65, 3]
    k_pool, v_pool, table = _paged_cache(lengths, -(-700 // page_size) + 1, page_size, 2, 128, g)
    q = torch.randn(3, 4, 8, 128, generator=g, dtype=torch.float64)
    with routes.forced_forward("split-kv"):
        out = xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                        page_table=table, causal=True, family="fa4")
    split, tail = [s for s in specs if not s.causal], [s for s in specs if s.causal]
    assert len(split) == 1 and isinstance(split[0], SplitFwdSpec) and split[0].page_size == 64
    assert (split[0].tile_m, split[0].tile_n) == split_kv.SPLIT_TILES[128, 128]
    assert len(tail) == 1 and type(tail[0]) is KernelSpec and tail[0].page_size == 64
    want, _ = _expected(q, k_pool, v_pool, table, lengths, True, (None, None), 128 ** -0.5)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
