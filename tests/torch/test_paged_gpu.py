"""Paged KV caches on the H200 with the real kernels (issue #44): attention_with_kvcache(page_table=) against fp64
of the same keys laid out contiguously, for shuffled page tables with spare pages, a partly filled last page,
page sizes 16-256 (FA4: cp.async and, at its key tile, TMA; FFPA: multiples of its 64-row tile), GQA 1/4/8,
the split entries, the causal tail and a window; and the same call against the contiguous split-KV route."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention, poison_allocator, rel_err

pytestmark = pytest.mark.gpu


def _pool(lengths, max_pages, ps, hkv, d, g, spare=5):
    b = len(lengths)
    n = b * max_pages + spare
    k = torch.randn(n, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(n, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    order = torch.randperm(n, device="cuda", generator=g)[:b * max_pages]
    return k, v, order.view(b, max_pages).to(torch.int32)


def _contiguous(pool, table):
    return pool[table.long()].flatten(1, 2)


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("family, d, hq, hkv, nq, ps, max_pages, lengths, causal, window", [
    pytest.param("ffpa", 512, 32, 4, 1, 256, 40, [9000, 1, 777], True, None, id="ffpa-d512-g8-ps256"),
    pytest.param("ffpa", 512, 16, 4, 4, 64, 70, [4100, 3], True, None, id="ffpa-d512-g4-q4-tail-ps64"),
    pytest.param("ffpa", 384, 8, 8, 1, 128, 30, [3000, 0], False, None, id="ffpa-d384-mha-ps128"),
    pytest.param("fa4", 128, 32, 4, 1, 16, 700, [11000, 17, 5000], True, None, id="fa4-d128-g8-ps16"),
    pytest.param("fa4", 128, 32, 8, 3, 128, 90, [11000, 130], True, None, id="fa4-d128-g4-q3-ps128-as-tile-64"),
    pytest.param("fa4", 128, 32, 4, 1, 256, 45, [11000, 255, 257], True, None, id="fa4-d128-g8-ps256-as-tile-64"),
    pytest.param("fa4", 128, 32, 8, 4, 256, 30, [7001, 3], True, None, id="fa4-d128-g4-q4-ps256-as-tile-64"),
    pytest.param("fa4", 128, 32, 4, 1, 64, 180, [11000, 64, 1, 0], True, None, id="fa4-d128-g8-ps64-decode-tile"),
    pytest.param("fa4", 128, 16, 4, 2, 64, 100, [6000, 65], False, None, id="fa4-d128-g4-q2-ps64-decode-tile"),
    pytest.param("fa4", 256, 32, 16, 1, 64, 100, [6000, 64], False, None, id="fa4-d256-g2-ps64"),
    pytest.param("fa4", 96, 8, 4, 1, 128, 12, [1066, 1066, 900], False, None, id="fa4-d96-unmasked-ps128"),
    pytest.param("fa4", 96, 8, 4, 3, 16, 70, [1066, 900, 17], True, None, id="fa4-d96-q3-causal-split-ps16"),
    pytest.param("fa4", 256, 32, 16, 1, 256, 20, [5000, 900], False, (1023, 0), id="fa4-d256-window-ps256"),
])
def test_paged_vs_fp64(num_splits, family, d, hq, hkv, nq, ps, max_pages, lengths, causal, window):
    poison_allocator()
    g = torch.Generator(device="cuda").manual_seed(ps + max_pages + nq)
    k_pool, v_pool, table = _pool(lengths, max_pages, ps, hkv, d, g)
    q = torch.randn(len(lengths), nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    out, lse = xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens, causal=causal,
                                         window_size=window or (-1, -1), num_splits=num_splits,
                                         return_softmax_lse=True, page_table=table, family=family)
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    for i, n in enumerate(lengths):
        ref_out, ref_lse = ref_attention(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], scale=d ** -0.5,
                                         causal=causal, window=window or (None, None))
        if n == 0:
            assert torch.all(out[i] == 0) and torch.all(torch.isneginf(lse[i]))
            continue
        assert rel_err(out[i:i + 1], ref_out) < 1e-2, (i, n)
        seen = ~torch.isneginf(ref_lse)
        assert (lse[i:i + 1][seen].double() - ref_lse[seen]).abs().max() < 1e-3
    # the same keys contiguous, on the split-KV route: the two must agree within bf16 rounding
    flat = xt.attention_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                     window_size=window or (-1, -1), family=family)
    assert rel_err(out, flat.double()) < 1e-2


def test_paged_decode_steps_under_a_cuda_graph():
    """Captured once, replayed as a decode loop: each step appends one token through the table (device
    lengths, no sync) and reads it back."""
    g = torch.Generator(device="cuda").manual_seed(3)
    b, hq, hkv, d, ps, max_pages = 2, 32, 4, 512, 64, 64
    k_pool, v_pool, table = _pool([0, 0], max_pages, ps, hkv, d, g)
    seqlens = torch.tensor([1000, 3000], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    kn, vn = (torch.randn(b, 1, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    step = lambda: xt.attention_with_kvcache(q, k_pool, v_pool, kn, vn, cache_seqlens=seqlens,  # noqa: E731
                                             causal=True, page_table=table)
    step()
    seqlens += 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        q.normal_(generator=g)
        kn.normal_(generator=g)
        vn.normal_(generator=g)
        graph.replay()
        kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
        for i, n in enumerate((seqlens + 1).tolist()):
            ref, _ = ref_attention(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], scale=d ** -0.5, causal=True)
            assert rel_err(out[i:i + 1], ref) < 1e-2
        seqlens += 1


@pytest.mark.parametrize("family, d, hq, hkv, ps", [("ffpa", 512, 32, 4, 64), ("ffpa", 512, 32, 4, 256),
                                                     ("fa4", 128, 32, 8, 16), ("fa4", 256, 32, 16, 64)])
def test_paged_prefill_and_decode_mix_vs_fp64(family, d, hq, hkv, ps):
    """vLLM's varlen call over the pages: a 3000-token prefill, a decode step, an empty request and a 700-token
    chunk of a longer sequence, causal bottom-right on each sequence's keys; trailing rows read 0 / -inf."""
    g = torch.Generator(device="cuda").manual_seed(ps + d)
    lengths = [3000, 4097, 0, 2500]
    max_pages = -(-max(lengths) // ps)
    k_pool, v_pool, table = _pool(lengths, max_pages, ps, hkv, d, g)
    q_lens = [3000, 1, 0, 700]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]) + 5, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = xt.paged_attention(q, k_pool, v_pool, table, torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                                  cu_seqlens_q=cu, max_seqlen_q=3000, causal=True, return_softmax_lse=True,
                                  family=family)
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    bounds = cu.tolist()
    for i, (a, z) in enumerate(zip(bounds, bounds[1:])):
        if z == a:
            continue
        ref, ref_lse = ref_attention(q[None, a:z], kc[i:i + 1, :lengths[i]], vc[i:i + 1, :lengths[i]],
                                     scale=d ** -0.5, causal=True)
        assert rel_err(out[None, a:z], ref) < 1e-2, i
        assert (lse[:, a:z].double() - ref_lse[0]).abs().max() < 1e-3, i
    assert torch.all(out[bounds[-1]:] == 0) and torch.all(torch.isneginf(lse[:, bounds[-1]:]))


@pytest.mark.parametrize("family, d, hq, hkv, ps, q_lens", [("ffpa", 512, 32, 4, 64, [1, 1, 0, 1]),
                                                             ("ffpa", 512, 32, 4, 256, [4, 1, 3, 2]),
                                                             ("fa4", 128, 32, 8, 16, [1, 16, 1, 1])])
def test_paged_packed_decoding_split_vs_fp64(family, d, hq, hkv, ps, q_lens):
    """vLLM's decode step (packed queries, max_seqlen_q <= 16) on the split route over the pages, by the rule and
    forced, against fp64 and the single launch (max_seqlen_q not given)."""
    from xattn.core import routes

    poison_allocator()
    g = torch.Generator(device="cuda").manual_seed(ps + d + sum(q_lens))
    lengths = [9000, 2, 0, 4097]
    max_pages = -(-max(lengths) // ps) + 2
    k_pool, v_pool, table = _pool(lengths, max_pages, ps, hkv, d, g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]) + 2, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    seqused = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu, causal=True, return_softmax_lse=True, family=family)
    auto = xt.paged_attention(q, k_pool, v_pool, table, seqused, max_seqlen_q=max(q_lens), **kw)
    with routes.forced_forward("split-kv"):
        forced = xt.paged_attention(q, k_pool, v_pool, table, seqused, max_seqlen_q=max(q_lens), **kw)
    one_out, one_lse = xt.paged_attention(q, k_pool, v_pool, table, seqused, **kw)
    kc, vc = _contiguous(k_pool, table), _contiguous(v_pool, table)
    bounds = cu.tolist()
    for out, lse in (auto, forced):
        for i, (a, z) in enumerate(zip(bounds, bounds[1:])):
            if z == a:
                continue
            ref, ref_lse = ref_attention(q[None, a:z], kc[i:i + 1, :lengths[i]], vc[i:i + 1, :lengths[i]],
                                         scale=d ** -0.5, causal=True)
            assert rel_err(out[None, a:z], ref) < 2 * rel_err(one_out[None, a:z], ref) + 2e-3, i
            finite = torch.isfinite(ref_lse[0])
            assert torch.equal(torch.isfinite(lse[:, a:z]), finite), i
            if finite.any():  # (a document without keys: every lse -inf, checked above)
                assert (lse[:, a:z][finite].double() - ref_lse[0][finite]).abs().max() < 1e-3, i
        assert torch.all(out[bounds[-1]:] == 0) and torch.all(torch.isneginf(lse[:, bounds[-1]:]))


@pytest.mark.parametrize("family, tail, packed", [("ffpa", False, False), ("ffpa", True, False), ("fa4", False, False),
                                                  ("fa4", True, False), ("ffpa", True, True), ("fa4", False, True)])
def test_index_kernel_matches_the_host_rule(family, tail, packed):
    """The split route's index kernel (xattn.core.paged_meta_sm90) against the core's host rule (the CPU stand-in,
    xattn.core.paged.entry_bounds): every entry's keys and table columns, the tail's, and the lse fill, for empty,
    1-key, partial-page and full sequences, padded splits (S * pps past the table), page sizes 16-256, Nq 1-16,
    pool pages read as 2 or 3 tile pages (FA4's TMA), and a table that is a strided view (no copy); packed, the
    query gathers for sequences of 0 to Nq queries and trailing rows past cu_seqlens_q[-1]."""
    from tests.torch.stubs import _stub_paged_meta
    from xattn.core import paged
    from xattn.torch import ops

    g = torch.Generator(device="cuda").manual_seed(11 + tail + 2 * packed)
    host = _stub_paged_meta()
    for ps, nq, columns, splits, r in ((16, 1, 70, 9, 1), (64, 4, 33, 5, 1), (256, 16, 7, 3, 1), (64, 3, 40, 40, 1),
                                       (128, 2, 1, 1, 1), (128, 3, 9, 4, 2), (128, 1, 20, 7, 2), (80, 5, 6, 2, 3)):
        if not tail and nq > 1:
            nq = 1
        span = columns * ps * r  # keys the table holds
        lengths = [0, 1, ps - 1, ps, span, span - 5, min(nq, span), span // 2 + 3]
        wide = torch.randint(-1, 10 ** 6, (len(lengths), 2 * columns + 3), device="cuda", generator=g,
                             dtype=torch.int32)
        table = wide[:, 3::2]  # strided columns and rows
        plan = paged.plan_paged(splits, tail, nq if tail else 1, columns * r)
        lens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
        want = [torch.full((plan.splits * len(lengths), 1 + plan.pages_per_split), -7, dtype=torch.int32),
                torch.full((len(lengths), 1 + paged.tail_pages(ps, nq)), -7, dtype=torch.int32),
                torch.zeros(plan.partials * len(lengths) * 8 * nq)]
        gathers = None
        if packed:
            counts = torch.randint(0, nq + 1, (len(lengths),), generator=torch.Generator().manual_seed(ps + nq))
            cu = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
            tq = int(cu[-1]) + 3  # trailing rows
            gathers = [cu, torch.full((len(lengths) * nq,), -7, dtype=torch.int32),
                       torch.full((tq,), -7, dtype=torch.int32), torch.full((40,), -7, dtype=torch.int32)]
        got = [w.clone().cuda() for w in want]
        got_gathers = [t.clone().cuda() for t in gathers] if packed else None
        spec = paged.PagedMetaSpec(family, plan.tail, packed)
        tail_got = got[1] if plan.tail else got[0]
        ops.LAUNCH["paged_meta"](spec, lens, table, got[0], tail_got, got[2], got_gathers, page_size=ps, seqlen_q=nq,
                                 tiles_per_page=r)
        host(spec, lens.cpu(), table.cpu(), want[0], want[1] if plan.tail else want[0], want[2], gathers,
             page_size=ps, seqlen_q=nq, tiles_per_page=r)
        assert torch.equal(got[0].cpu(), want[0]), (ps, nq, columns, splits, r)
        if plan.tail:
            assert torch.equal(got[1].cpu(), want[1]), (ps, nq, columns, splits, r)
        for name, a, b in zip(("q_rows", "out_rows", "zero"), (got_gathers or [])[1:], (gathers or [])[1:]):
            assert torch.equal(a.cpu(), b), (name, ps, nq, a, b)
        assert torch.isneginf(got[2]).all()
