"""xattn.torch.attention_with_kvcache (FlashAttention's flash_attn_with_kvcache) on the CPU stand-ins: the append
in place, per-sequence lengths (0 included), both routes (split-KV and the fused varlen forward), the causal tail,
windows, HF's cache layout, lse, and the named errors."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention

from . import stubs

CALLS = stubs.CALLS


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)


def _cache(b, nc, hkv, d, layout, g):
    if layout == "hf":
        return (torch.randn(b, hkv, nc, d, generator=g, dtype=torch.float64).transpose(1, 2),
                torch.randn(b, hkv, nc, d, generator=g, dtype=torch.float64).transpose(1, 2))
    return (torch.randn(b, nc, hkv, d, generator=g, dtype=torch.float64),
            torch.randn(b, nc, hkv, d, generator=g, dtype=torch.float64))


def _expected(q, k_cache, v_cache, lengths, causal, window, scale):
    outs, lses = [], []
    for i, n in enumerate(lengths):
        o, l_ = ref_attention(q[i:i + 1], k_cache[i:i + 1, :n], v_cache[i:i + 1, :n], scale=scale, causal=causal,
                              window=window)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("b, nq, hq, hkv, nc, new, seqlens, causal, window, family", [
    pytest.param(3, 1, 8, 2, 700, 1, [0, 350, 698], True, (None, None), "ffpa", id="decode-step-appends-1"),
    pytest.param(2, 4, 4, 4, 300, 4, [10, 200], True, (None, None), "ffpa", id="speculative-4-causal-tail"),
    pytest.param(2, 3, 4, 2, 500, 0, [2, 0], True, (None, None), "ffpa", id="no-append-empty-sequence"),
    pytest.param(2, 2, 4, 2, 400, 2, [50, 380], False, (None, None), "fa4", id="fa4-full"),
    pytest.param(2, 1, 4, 2, 400, 1, [100, 300], True, (16, 0), "fa4", id="fa4-sliding-window"),
])
def test_matches_fp64_on_the_valid_rows(layout, num_splits, b, nq, hq, hkv, nc, new, seqlens, causal, window, family):
    if window != (None, None) and num_splits > 1:
        num_splits = 0  # a window never splits; 0 lets the route say so
    g = torch.Generator().manual_seed(nc + nq + new)
    d = 16
    q = torch.randn(b, nq, hq, d, generator=g, dtype=torch.float64)
    k_cache, v_cache = _cache(b, nc, hkv, d, layout, g)
    k_new = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64) if new else None
    v_new = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64) if new else None
    before_k = k_cache.clone()
    cache_seqlens = torch.tensor(seqlens, dtype=torch.int32)
    out, lse = xt.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=cache_seqlens,
                                         causal=window == (None, None) and causal, window_size=window,
                                         num_splits=num_splits, return_softmax_lse=True, family=family,
                                         check_inputs=True)
    lengths = [n + new for n in seqlens]
    for i, n in enumerate(seqlens):  # the append: exactly the new rows changed, in place
        if new:
            torch.testing.assert_close(k_cache[i, n:n + new], k_new[i], atol=0, rtol=0)
        torch.testing.assert_close(k_cache[i, :n], before_k[i, :n], atol=0, rtol=0)
        torch.testing.assert_close(k_cache[i, n + new:], before_k[i, n + new:], atol=0, rtol=0)
    assert cache_seqlens.tolist() == seqlens  # FlashAttention leaves cache_seqlens as given
    ref_out, ref_lse = _expected(q, k_cache, v_cache, lengths, causal and window == (None, None), window, d ** -0.5)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-6, rtol=1e-5)
    split = ("combine", family) in CALLS
    assert split == (num_splits > 1), CALLS


def test_an_int_cache_seqlens_and_no_seqlens():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 1, 8, 16, generator=g, dtype=torch.float64)
    k_cache, v_cache = _cache(2, 600, 2, 16, "contiguous", g)
    out = xt.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=450, causal=True, family="ffpa")
    torch.testing.assert_close(out, _expected(q, k_cache, v_cache, [450, 450], True, (None, None), 0.25)[0],
                               atol=1e-6, rtol=1e-5)
    out = xt.attention_with_kvcache(q, k_cache, v_cache, causal=True, family="ffpa")
    torch.testing.assert_close(out, ref_attention(q, k_cache, v_cache, scale=0.25, causal=True)[0], atol=1e-6,
                               rtol=1e-5)


def test_named_errors():
    q = torch.randn(2, 1, 8, 16, dtype=torch.float64)
    k_cache = torch.randn(2, 64, 2, 16, dtype=torch.float64)
    kn = torch.randn(2, 1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache_seqlens"):
        xt.attention_with_kvcache(q, k_cache, k_cache, kn, kn, family="ffpa")
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 64"):
        xt.attention_with_kvcache(q, k_cache, k_cache, kn, kn, cache_seqlens=torch.tensor([3, 64]), family="ffpa",
                                  check_inputs=True)
    with pytest.raises(ValueError, match="cache_seqlens: expected"):
        xt.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=torch.tensor([3.0, 4.0]), family="ffpa")
    with pytest.raises(ValueError, match="give both"):
        xt.attention_with_kvcache(q, k_cache, k_cache, kn, None, cache_seqlens=3, family="ffpa")
    with pytest.raises(ValueError, match="num_splits"):
        xt.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=3, family="ffpa", num_splits=500)


@pytest.mark.parametrize("nq", [1, 3])
def test_hf_static_cache_decode_takes_the_split_route(monkeypatch, nq):
    """HF "ffpa" with a StaticCache (its fill a device tensor): the plan's per-row lengths reach the decoding
    route (xattn::fwd_lengths, split-KV here), the keys read in place from HF's [B, Hkv, Nc, D] cache; the output
    equals SDPA with HF's own mask."""
    from transformers import masking_utils as mu

    from xattn.torch import ffpa_attention as fa
    from xattn.torch.hf import support
    monkeypatch.setattr(support, "kernels_available", lambda: None)

    class Layer(torch.nn.Module):
        is_causal = True

    b, hq, hkv, nc, d, filled = 2, 8, 2, 1024, 128, 700
    g = torch.Generator().manual_seed(nq)
    q = torch.randn(b, hq, nq, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(b, hkv, nc, d, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = fa.ffpa_mask(b, nq, nc, q_offset=torch.tensor(filled - nq), mask_function=mu.causal_mask_function)
    assert mask.plan.lengths.tolist() == [filled] * b
    out, _ = fa.ffpa_attention_forward(Layer(), q, k, v, mask, scaling=d ** -0.5)
    assert ("combine", "fa4") in CALLS
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                                            v.double().repeat_interleave(4, 1),
                                                            attn_mask=mask.plan.sdpa_mask(), scale=d ** -0.5)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(30))
def test_drawn_from_the_whole_contract(seed):
    """Random calls over the documented contract: lengths from 0 to the full capacity (after the append), 0-4 new
    rows, 1-16 queries, causal or not or an FA4 window, both cache layouts, GQA 1-8, every route (auto, fused,
    split-kv where it serves), against fp64 of each sequence's valid rows."""
    import random

    from xattn.core import routes
    r = random.Random(seed)
    family = r.choice(["ffpa", "fa4"])
    b, nq, hkv, g = r.randint(1, 3), r.choice([1, 1, 2, 5, 16]), r.choice([1, 2]), r.choice([1, 2, 4, 8])
    new = r.choice([0, 1, 4])
    nc = r.randint(max(new, 1), 900)
    seqlens = [r.choice([0, r.randint(0, nc - new), nc - new]) for _ in range(b)]
    window = (r.randint(0, 40), 0) if family == "fa4" and r.random() < 0.3 else (None, None)
    causal = window == (None, None) and r.random() < 0.7
    route = r.choice(["auto", "fused", "split-kv"] if window == (None, None) else ["auto", "fused"])
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hkv * g, 16, generator=gen, dtype=torch.float64)
    k_cache, v_cache = _cache(b, nc, hkv, 16, r.choice(["contiguous", "hf"]), gen)
    k_new = torch.randn(b, new, hkv, 16, generator=gen, dtype=torch.float64) if new else None
    v_new = torch.randn(b, new, hkv, 16, generator=gen, dtype=torch.float64) if new else None
    with routes.forced_forward(route):
        out, lse = xt.attention_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=torch.tensor(seqlens),
                                             causal=causal, window_size=window, return_softmax_lse=True,
                                             family=family, check_inputs=True)
    ref_out, ref_lse = _expected(q, k_cache, v_cache, [n + new for n in seqlens], causal, window, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-6, rtol=1e-5)
