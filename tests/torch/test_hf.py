"""attn_implementation="ffpa" on the CPU: registration, masks, routing and fallbacks, and a tiny
random Gemma 4 against "sdpa" (the core is replaced by the fp64 reference stand-in; the GPU
tests run the real kernels)."""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import registry, support  # noqa: E402


from . import gemma, stubs  # noqa: E402


@pytest.fixture
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


def test_registration_is_idempotent_and_fills_both_registries():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    registry._REGISTERED = False
    assert fa.register_ffpa_attention() is True
    assert fa.register_ffpa_attention() is False  # idempotent; False when already registered, as NeMo's
    assert AttentionInterface._global_mapping["ffpa"] is fa.ffpa_attention_forward
    assert AttentionMaskInterface._global_mapping["ffpa"] is fa.ffpa_mask


def test_setup_checks():
    with pytest.raises(ValueError, match="cp_size"):
        fa.setup_ffpa_backend(0, False)
    with pytest.raises(ValueError, match="not initialised"):  # cp_size > 1 needs a process group of that size
        fa.setup_ffpa_backend(2, False)
    with pytest.raises(NotImplementedError, match="packed"):
        fa.setup_ffpa_backend(2, True)
    with pytest.raises(TypeError, match="has_packed_sequence"):
        fa.setup_ffpa_backend(1, "yes")
    assert fa.setup_ffpa_backend(1, True) is None  # packed sequences are accepted


def test_ffpa_mask_cases():
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    m = fa.ffpa_mask(2, 4, 4).plan
    assert m.causal and not m.varlen  # plain causal: planned (never None, see test_hf_masks)
    m = fa.ffpa_mask(2, 4, 4, attention_mask=torch.ones(2, 4, dtype=torch.long)).plan
    assert m.causal and not m.varlen  # all ones: no padding
    pad = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    m = fa.ffpa_mask(2, 4, 4, q_offset=1, kv_offset=1, attention_mask=pad).plan
    assert not m.varlen  # offset 1: the padded slot is outside the kv range
    m = fa.ffpa_mask(2, 5, 5, attention_mask=pad).plan
    assert m.varlen and m.cu_seqlens_q.tolist() == [0, 0, 5, 5, 5, 10, 10]
    assert m.cu_seqlens_k.tolist() == [0, 1, 5, 5, 5, 10, 10]
    truth = sdpa_mask(2, 5, 5, mask_function=causal_mask_function, attention_mask=pad.bool(),
                      allow_is_causal_skip=False)
    assert torch.equal(m.sdpa_mask(), truth)


def _hf_inputs(b=2, hq=4, hkv=2, n=6, d=512, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, n, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=g).to(dtype) for _ in range(2))
    return q, k, v


class _Module(torch.nn.Module):
    is_causal = True


def _sdpa_ref(q, k, v, mask4d, scale):
    g = q.shape[1] // k.shape[1]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1), attn_mask=mask4d,
        scale=scale)
    return o.transpose(1, 2)


def test_dense_causal_routes_to_the_kernel(kernels):
    q, k, v = _hf_inputs()
    out, none = fa.ffpa_attention_forward(_Module(), q, k, v, None, scaling=1.0)
    assert none is None and out.shape == (2, 6, 4, 512) and out.is_contiguous()
    assert ("fwd", "ffpa") in stubs.CALLS
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    torch.testing.assert_close(out.double(), _sdpa_ref(q, k, v, causal, 1.0), atol=2e-2, rtol=2e-2)


def test_padding_mask_unpads_and_repads(kernels):
    q, k, v = _hf_inputs()
    keep = torch.tensor([[False, False, True, True, True, True], [True] * 6])  # left padding
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, keep, scaling=0.05)
    assert (out[0, :2] == 0).all()
    mask4d = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    ref = _sdpa_ref(q, k, v, mask4d, 0.05)
    torch.testing.assert_close(out[:, 2:].double(), ref[:, 2:], atol=2e-2, rtol=2e-2)


def test_packed_position_ids_equal_documents_alone(kernels):
    q, k, v = _hf_inputs(b=1, n=7)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, None, scaling=0.05, position_ids=pos)
    for a, b in ((0, 3), (3, 7)):
        alone, _ = fa.ffpa_attention_forward(_Module(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None, scaling=0.05)
        torch.testing.assert_close(out[:, a:b], alone, atol=1e-2, rtol=1e-2)


def test_sliding_window_layer_uses_fa4_local(kernels):
    q, k, v = _hf_inputs(d=256)
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, None, scaling=1.0, sliding_window=3)
    assert ("fwd", "fa4") in stubs.CALLS
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    torch.testing.assert_close(out.double(), _sdpa_ref(q, k, v, (j <= i) & (j > i - 3), 1.0), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("reason, kw", [
    ("dtype", dict(dtype=torch.float32)),
    ("softcap", dict(softcap=30.0)),
    ("scaling", dict(scaling=None)),
    ("ffpa_unavailable", dict(d=40)),
])
def test_fallbacks_warn_once_per_reason(kernels, caplog, reason, kw):
    dtype, d = kw.pop("dtype", torch.bfloat16), kw.pop("d", 512)
    q, k, v = _hf_inputs(dtype=dtype, d=d)
    kw.setdefault("scaling", 0.05)
    with caplog.at_level(logging.WARNING, logger="xattn"):
        out1, _ = fa.ffpa_attention_forward(_Module(), q, k, v, None, **kw)
        out2, _ = fa.ffpa_attention_forward(_Module(), q, k, v, None, **kw)
    assert caplog.text.count(f"(reason={reason!r})") == 1
    assert not any(c[0] == "fwd" for c in stubs.CALLS)
    assert out1.shape == (2, 6, 4, d) and torch.isfinite(out1.float()).all()


def test_sdpa_fallback_with_hf_gqa_module_and_dead_rows(caplog):
    """The fallback leaves GQA to SDPA even when the module carries HF's num_key_value_groups,
    and a left-padded query row that sees no key gives zeros, not NaN."""
    fa._FALLBACK_WARNED.clear()
    module = _Module()
    module.num_key_value_groups = 2
    q, k, v = _hf_inputs(d=40)  # head_dim 40: no kernel family -> fallback
    keep = torch.tensor([[False, False, True, True, True, True], [True] * 6])
    with caplog.at_level(logging.WARNING, logger="xattn"):
        out, _ = fa.ffpa_attention_forward(module, q, k, v, keep, scaling=0.1)
    assert "ffpa fallback" in caplog.text
    assert torch.isfinite(out.float()).all() and (out[0, :2] == 0).all()
    mask4d = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    torch.testing.assert_close(out[:, 2:].double(), _sdpa_ref(q, k, v, mask4d, 0.1)[:, 2:], atol=2e-2, rtol=2e-2)


def test_tiny_gemma4_without_kernels_falls_back_and_matches_sdpa(monkeypatch, caplog):
    pytest.importorskip("transformers.models.gemma4")
    monkeypatch.setattr(support, "kernels_available", lambda: "no GPU (test)")
    fa._FALLBACK_WARNED.clear()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with caplog.at_level(logging.WARNING, logger="xattn"):
        errs, layers, calls = gemma.parity(monkeypatch, {}, ids, mask, "cpu")
    assert calls == {"truth": 0, "sdpa": 0, "ffpa": 0, "layer check": 0}
    assert caplog.text.count("(reason='ffpa_unavailable')") == 1
    gemma.assert_parity(errs, layers)


def test_tiny_gemma4_ffpa_matches_sdpa(kernels, monkeypatch):
    pytest.importorskip("transformers.models.gemma4")
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    errs, layers, calls = gemma.parity(monkeypatch, {}, ids, mask, "cpu")
    print(gemma.summary(errs, layers, torch.float16))
    # one sliding (FA4 local) + one full (FFPA) layer; the sdpa and fp64 models never enter xattn
    assert calls == {"truth": 0, "sdpa": 0, "ffpa": 2, "layer check": 2}
    assert ("fwd", "ffpa") in stubs.CALLS and ("fwd", "fa4") in stubs.CALLS
    gemma.assert_parity(errs, layers)



@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
@pytest.mark.parametrize("logits_to_keep", [1, 3])
def test_tiny_gemma4_kv_shared_layers_with_logits_to_keep(kernels, monkeypatch, padded, logits_to_keep):
    """Gemma 4 slices prepared masks along the query dim for its KV-shared layers when ``logits_to_keep``
    is set: "ffpa" crashed there ('KernelMask' object is not subscriptable). Sliding and full layers, all
    four after the first two sharing K/V; fp64 weights and stand-in kernels, so "ffpa" must equal "sdpa"."""
    pytest.importorskip("transformers.models.gemma4")
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(support, "_DTYPES", (torch.bfloat16, torch.float16, torch.float64))
    fa.register_ffpa_attention()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    if padded:
        mask[0, :3] = 0
    logits = {}
    for impl in ("sdpa", "ffpa"):
        config = gemma.tiny_gemma4_config(layers=4, sliding_window=3)
        config.num_kv_shared_layers = 2
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=impl).to(torch.float64)
        stubs.CALLS.clear()
        logits[impl] = model(input_ids=ids, attention_mask=mask, logits_to_keep=logits_to_keep).logits
    assert logits["ffpa"].shape == (2, logits_to_keep, 64)
    assert ("fwd", "ffpa") in stubs.CALLS and ("fwd", "fa4") in stubs.CALLS
    torch.testing.assert_close(logits["ffpa"], logits["sdpa"], atol=1e-9, rtol=1e-9)


def test_left_padded_batch_decodes_on_the_packed_split_route(kernels, monkeypatch):
    """HF decoding of a left-padded batch (rows of different pad lengths run as packed documents) takes the packed
    split-KV route each step (#43; the tiny cache splits once MIN_KEYS_PER_SPLIT is lowered as a 32k cache would):
    its logits are as close to fp32 sdpa of the same weights as the fused route's. Fixed tokens fed step by step
    (DynamicCache), so both routes see the same inputs; fp16 weights on the fp64 stand-ins."""
    pytest.importorskip("transformers.models.gemma4")
    from xattn.core import routes, split_kv
    from xattn.core.checks import Memo
    from xattn.torch import ops, split_kv as torch_split_kv

    from . import decode

    ids = torch.cat([decode.prompt("cpu", 40), decode.prompt("cpu", 41)[:, :40]])
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # the second row left-padded: the rows' caches differ in length
    tokens = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3))

    def logits(net):
        return decode.padded_step_logits(net, ids, mask, tokens)

    truth = logits(decode.model("sdpa", "cpu", dtype=torch.float32))
    net = decode.model("ffpa", "cpu", dtype=torch.float16)
    with routes.forced_forward("fused"):
        fused = logits(net)
    packed = []
    real = torch_split_kv.packed_split_forward
    monkeypatch.setattr(torch_split_kv, "packed_split_forward", lambda *a, **k: packed.append(1) or real(*a, **k))
    monkeypatch.setattr(split_kv, "MIN_KEYS_PER_SPLIT", 8)
    monkeypatch.setattr(ops, "_FWD_ROUTES", Memo())  # route decisions memoised under the real constant
    split = logits(net)
    assert len(packed) >= 6 * 2, "the decode steps did not take the packed split route"  # 6 steps x 2 full layers
    err_fused, err_split = (fused - truth).abs().max().item(), (split - truth).abs().max().item()
    assert err_split <= 1.5 * err_fused + 1e-3, (err_split, err_fused)
