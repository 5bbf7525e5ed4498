"""The NeMo AutoModel contract (CPU, kernels replaced by the fp64 stand-in): ``xattn.torch.fa4`` and
``xattn.torch.ffpa_attention`` are drop-ins for ``nemo_automodel.components.attention.fa4`` and
``...ffpa_attention``.

The expected signatures are written out here from the published API listings (CI has no copy of
them): every listed function exists with exactly the listed parameter names, order, kinds and
defaults, and every listed data name exists. Then every function is called as a NeMo caller writes it,
positionally and by the listed keywords, in the listed layouts (SDPA ``[batch, heads, sequence, dim]``
for the helpers and the low-level FFPA calls), with heads != sequence length so a transposed layout
cannot pass, and compared with the fp64 reference (forward and gradients).
"""

import inspect
import logging

import pytest
import torch

from tests.reference import attention as ref_attention, attention_bwd as ref_bwd, rel_err, \
    varlen_attention as ref_varlen
from xattn.torch import fa4, ffpa_attention as fa
from xattn.torch.hf import support

from . import stubs
from .fa4_reference import causal_mask, document_causal_mask, sdpa_reference

_P = inspect.Parameter
EMPTY = _P.empty
F64 = torch.float64


def arg(name, default=EMPTY):
    return name, _P.POSITIONAL_OR_KEYWORD, default


def star(name):
    return name, _P.VAR_POSITIONAL, EMPTY


def stars(name):
    return name, _P.VAR_KEYWORD, EMPTY


FA4_FUNCTIONS = {
    "_load_fa4": [],
    "_varlen_layout": [arg("q_doc_ids"), arg("kv_doc_ids"), arg("q_global_start")],
    "_varlen_segments": [arg("kv_doc_ids"), arg("q_length"), arg("q_global_start")],
    "causal_fa4_attention": [arg("query"), arg("key"), arg("value"), arg("scale")],
    "document_causal_fa4_attention": [arg("query"), arg("key"), arg("value"), arg("q_doc_ids"), arg("kv_doc_ids"),
                                      arg("q_global_start"), arg("scale")],
    "import_fa4_modules": [star("names")],
}
FA4_DATA = ("_LAYOUT_CACHE", "_LAYOUT_GENERATION", "_PAD_DOC_ID")

FFPA_FUNCTIONS = {
    "_ffpa_dense_bwd": [arg(n) for n in ("grad_out", "q", "k", "v", "out", "lse", "scale", "causal")],
    "_ffpa_dense_fwd": [arg(n) for n in ("q", "k", "v", "scale", "causal")],
    "_ffpa_low_level_ready": [],
    "_ffpa_varlen_bwd": [arg(n) for n in ("grad_out_pack", "q_pack", "k_pack", "v_pack", "out_pack", "lse_pack",
                                          "cu_q", "cu_k", "max_q", "max_k", "scale", "causal")],
    "_ffpa_varlen_fwd": [arg(n) for n in ("q_pack", "k_pack", "v_pack", "cu_q", "cu_k", "max_q", "max_k", "scale",
                                          "causal")],
    "_ffpa_varlen_ready": [],
    "_get_eager": [],
    "_get_ffpa_high_level": [],
    "_get_flex": [],
    "_get_sdpa": [],
    "_is_block_mask": [arg("mask")],
    "_warn_once": [arg("reason"), arg("message"), arg("target", "sdpa")],
    "ffpa_attention_forward": [arg("module"), arg("query"), arg("key"), arg("value"), arg("attention_mask"),
                               arg("dropout", 0.0), arg("scaling", None), arg("softcap", None), stars("kwargs")],
    "ffpa_mask": [arg("batch_size"), arg("q_length"), arg("kv_length"), arg("q_offset", 0), arg("kv_offset", 0),
                  arg("mask_function", None), arg("attention_mask", None), arg("dtype", torch.float32),
                  stars("kwargs")],
    "register_ffpa_attention": [],
    "setup_ffpa_backend": [arg("cp_size"), arg("has_packed_sequence")],
}
FFPA_DATA = ("_CUTEDSL_BACKEND", "_EAGER_FN", "_FALLBACK_WARNED", "_FFPA_FN", "_FFPA_HEAD_DIM", "_FFPA_LOW_LEVEL_READY",
             "_FLEX_FN", "_REGISTERED", "_SDPA_FN", "_VARLEN_WIN_NONE", "__all__", "logger")


def _signature(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _same_default(a, b):
    return a is b or (type(a) is type(b) and a == b)


@pytest.mark.parametrize("module, name, expected",
                         [pytest.param(fa4, n, e, id=f"fa4.{n}") for n, e in FA4_FUNCTIONS.items()]
                         + [pytest.param(fa, n, e, id=f"ffpa_attention.{n}") for n, e in FFPA_FUNCTIONS.items()])
def test_listed_function_signature(module, name, expected):
    fn = getattr(module, name, None)
    assert callable(fn), f"{module.__name__}.{name} is missing"
    got = _signature(fn)
    assert [(n, k) for n, k, _ in got] == [(n, k) for n, k, _ in expected], f"{name}{inspect.signature(fn)}"
    for (n, _, d), (_, _, want) in zip(got, expected):
        assert _same_default(d, want), f"{name}: {n} defaults to {d!r}, the listing says {want!r}"


@pytest.mark.parametrize("module, name", [pytest.param(fa4, n, id=f"fa4.{n}") for n in FA4_DATA]
                         + [pytest.param(fa, n, id=f"ffpa_attention.{n}") for n in FFPA_DATA])
def test_listed_data_name_exists(module, name):
    assert hasattr(module, name), f"{module.__name__}.{name} is missing"


def test_listed_data_values():
    assert fa4._PAD_DOC_ID == 0 and isinstance(fa4._LAYOUT_CACHE, dict)
    assert isinstance(fa4._LAYOUT_GENERATION, list) and len(fa4._LAYOUT_GENERATION) == 2
    assert fa._FFPA_HEAD_DIM == 512 and fa._VARLEN_WIN_NONE == -2 ** 31
    assert isinstance(fa._FALLBACK_WARNED, set) and isinstance(fa._REGISTERED, bool)
    assert list(fa.__all__) == ["ffpa_attention_forward", "ffpa_mask", "register_ffpa_attention", "setup_ffpa_backend",
                                "_ffpa_dense_fwd", "_ffpa_dense_bwd"]
    assert isinstance(fa.logger, logging.Logger)


# --- fa4: every function called as the listing writes it ------------------------------------------

@pytest.fixture
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa4._LAYOUT_CACHE.clear()
    fa4._LAYOUT_GENERATION[:] = [None, None]


def _rand(*shape, seed=0, dtype=F64, grad=False):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return t.requires_grad_(grad)


def _grads(out, inputs, dout):
    return torch.autograd.grad(out, inputs, dout)


def _assert_grads(got, want):
    for name, a, b in zip(("dq", "dk", "dv"), got, want):  # the core keeps lse in fp32
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("style", ["positional", "keyword"])
@pytest.mark.parametrize("hq, hkv, n, d, dv", [(6, 2, 5, 128, 128), (2, 2, 7, 192, 128), (3, 3, 9, 128, 128)])
def test_fa4_causal_as_listed(kernels, style, hq, hkv, n, d, dv):
    q, k, v = _rand(2, hq, n, d, seed=1, grad=True), _rand(2, hkv, n, d, seed=2, grad=True), \
        _rand(2, hkv, n, dv, seed=3, grad=True)
    if style == "positional":
        out = fa4.causal_fa4_attention(q, k, v, 0.11)
    else:
        out = fa4.causal_fa4_attention(query=q, key=k, value=v, scale=0.11)
    assert out.shape == (2, hq, n, dv)                                   # [batch, heads, sequence, v_head_dim]
    ref = sdpa_reference(q, k, v, causal_mask(2, n), 0.11)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    dout = _rand(*out.shape, seed=4)
    _assert_grads(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout))


KV_IDS = [[0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3, 0], [4, 4, 4, 4, 4, 5, 5, 6, 6, 6, 0, 0]]


@pytest.mark.parametrize("style", ["positional", "keyword"])
@pytest.mark.parametrize("start, nq, hq, hkv, d, dv", [(0, 12, 6, 2, 128, 128), (4, 8, 2, 2, 192, 128),
                                                       (8, 4, 3, 1, 128, 128)])
def test_fa4_document_causal_as_listed(kernels, style, start, nq, hq, hkv, d, dv):
    kv_ids = torch.tensor(KV_IDS)
    q_ids = kv_ids[:, start:start + nq]
    q, k, v = _rand(2, hq, nq, d, seed=1, grad=True), _rand(2, hkv, 12, d, seed=2, grad=True), \
        _rand(2, hkv, 12, dv, seed=3, grad=True)
    if style == "positional":
        out = fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, 0.09)
    else:
        out = fa4.document_causal_fa4_attention(query=q, key=k, value=v, q_doc_ids=q_ids, kv_doc_ids=kv_ids,
                                                q_global_start=start, scale=0.09)
    assert out.shape == (2, hq, nq, dv)
    pad = (q_ids == 0)[:, None, :, None].expand_as(out)
    assert bool(pad.any()) and torch.all(out[pad] == 0)                 # padding queries are zero
    ref = sdpa_reference(q, k, v, document_causal_mask(q_ids, kv_ids, start), 0.09, keep_queries=q_ids != 0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    dout = _rand(*out.shape, seed=4)
    _assert_grads(_grads(out, (q, k, v), dout), _grads(ref, (q, k, v), dout))


@pytest.mark.parametrize("style", ["positional", "keyword"])
def test_fa4_varlen_layout_and_segments_as_listed(kernels, style):
    kv_ids = torch.tensor(KV_IDS)
    q_ids = kv_ids[:, 4:9]
    if style == "positional":
        cu_q, cu_k, max_q, max_k = fa4._varlen_layout(q_ids, kv_ids, 4)
        q_lens, k_lens = fa4._varlen_segments(kv_ids, 5, 4)
    else:
        cu_q, cu_k, max_q, max_k = fa4._varlen_layout(q_doc_ids=q_ids, kv_doc_ids=kv_ids, q_global_start=4)
        q_lens, k_lens = fa4._varlen_segments(kv_doc_ids=kv_ids, q_length=5, q_global_start=4)
    # row 0: 0,0 | 1,1,1 | 2,2,2,2 | 3,3 | 0; row 1: 4x5 | 5,5 | 6,6 | 6 | 0,0 (cut at the shard end, 9)
    assert (q_lens, k_lens) == ([0, 1, 4, 0, 0, 1, 2, 2, 0, 0], [2, 3, 4, 2, 1, 5, 2, 2, 1, 2])
    for cu, lens in ((cu_q, q_lens), (cu_k, k_lens)):
        assert cu.dtype == torch.int32 and cu.device == kv_ids.device and cu.shape == (len(lens) + 1,)
        assert cu.tolist() == [0, *torch.tensor(lens).cumsum(0).tolist()]
    assert (max_q, max_k) == (4, 5)


def test_fa4_layout_is_never_stale(kernels):
    gen = torch.Generator().manual_seed(7)
    for step in range(60):  # each ids tensor dies before the next: CPython reuses its address
        kv_ids = torch.randint(0, 3, (2, 10), generator=gen)
        cu_q, cu_k, _, _ = fa4._varlen_layout(q_doc_ids=kv_ids[:, 3:], kv_doc_ids=kv_ids, q_global_start=3)
        q_lens, k_lens = fa4._varlen_segments(kv_ids, 7, 3)
        assert cu_k.tolist() == [0, *torch.tensor(k_lens).cumsum(0).tolist()], step
        assert cu_q.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()], step
        del kv_ids, cu_q, cu_k


def test_fa4_load_and_import_as_listed(kernels):
    dense, varlen = fa4._load_fa4()
    assert callable(dense) and callable(varlen) and fa4._load_fa4() == (dense, varlen)
    q, k, v = _rand(2, 5, 6, 128, seed=1), _rand(2, 5, 2, 128, seed=2), _rand(2, 5, 2, 128, seed=3)
    out, _ = dense(q, k, v, softmax_scale=0.2, causal=True)           # flash_attn.cute layout [B, N, H, D]
    torch.testing.assert_close(out, ref_attention(q, k, v, scale=0.2, causal=True)[0])
    assert fa4.import_fa4_modules() == ()
    (mod,) = fa4.import_fa4_modules("xattn.torch.fa4")
    assert mod is fa4
    with pytest.raises(ImportError, match="flash-attn-4==4.0.0b36"):
        fa4.import_fa4_modules("xattn.no_such_module", "xattn.no_such_other")


# --- ffpa_attention: the low-level SDPA-layout calls and the HF entry points ----------------------

BF16 = torch.bfloat16


def _sdpa_ref(q, k, v, scale, causal):
    """fp64 ``(out [B, Hq, Nq, D], lse [B, Hq, Nq])`` of SDPA-layout inputs."""
    out, lse = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale, causal=causal)
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("style", ["positional", "keyword"])
@pytest.mark.parametrize("nq, nk, causal", [(6, 6, True), (5, 7, False), (7, 7, False)])
def test_ffpa_dense_fwd_bwd_as_listed(kernels, style, nq, nk, causal):
    q, k, v = _rand(2, 4, nq, 512, seed=1, dtype=BF16), _rand(2, 2, nk, 512, seed=2, dtype=BF16), \
        _rand(2, 2, nk, 512, seed=3, dtype=BF16)
    if style == "positional":
        out, lse = fa._ffpa_dense_fwd(q, k, v, 0.05, causal)
    else:
        out, lse = fa._ffpa_dense_fwd(q=q, k=k, v=v, scale=0.05, causal=causal)
    ref, ref_lse = _sdpa_ref(q, k, v, 0.05, causal)
    assert out.shape == (2, 4, nq, 512) and lse.shape == (2, 4, nq) and lse.dtype == torch.float32
    assert rel_err(out, ref) < 1e-2 and rel_err(lse, ref_lse) < 1e-5
    dout = _rand(*out.shape, seed=4, dtype=BF16)
    if style == "positional":
        grads = fa._ffpa_dense_bwd(dout, q, k, v, out, lse, 0.05, causal)
    else:
        grads = fa._ffpa_dense_bwd(grad_out=dout, q=q, k=k, v=v, out=out, lse=lse, scale=0.05, causal=causal)
    t = [x.transpose(1, 2) for x in (dout, q, k, v, out)]
    want = ref_bwd(*t, lse, scale=0.05, causal=causal)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.shape == x.shape, name                                  # SDPA layout, dk/dv on the Hkv heads
        assert rel_err(g, w.transpose(1, 2)) < 1e-2, name


@pytest.mark.parametrize("style", ["positional", "keyword"])
def test_ffpa_varlen_fwd_bwd_as_listed(kernels, style):
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q, k, v = _rand(8, 4, 512, seed=1, dtype=BF16), _rand(11, 2, 512, seed=2, dtype=BF16), \
        _rand(11, 2, 512, seed=3, dtype=BF16)
    if style == "positional":
        out, lse = fa._ffpa_varlen_fwd(q, k, v, cu_q, cu_k, 5, 5, 0.05, True)
    else:
        out, lse = fa._ffpa_varlen_fwd(q_pack=q, k_pack=k, v_pack=v, cu_q=cu_q, cu_k=cu_k, max_q=5, max_k=5,
                                       scale=0.05, causal=True)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = ref_varlen(q64, k64, v64, cu_q, cu_k, scale=0.05, causal=True)
    assert out.shape == (8, 4, 512) and lse.shape == (4, 8)
    assert rel_err(out, ref) < 1e-2 and rel_err(lse, ref_lse) < 1e-5
    dout = _rand(*out.shape, seed=4, dtype=BF16)
    args = (dout, q, k, v, out, lse, cu_q, cu_k, 5, 5, 0.05, True)
    if style == "positional":
        grads = fa._ffpa_varlen_bwd(*args)
    else:
        grads = fa._ffpa_varlen_bwd(**dict(zip([n for n, _, _ in FFPA_FUNCTIONS["_ffpa_varlen_bwd"]], args)))
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.shape == w.shape and rel_err(g, w) < 1e-2, name


def test_ffpa_readiness_and_getters_as_listed(kernels):
    assert isinstance(fa._ffpa_low_level_ready(), bool) and isinstance(fa._ffpa_varlen_ready(), bool)
    for getter in (fa._get_eager, fa._get_flex, fa._get_sdpa):
        fn = getter()
        assert fn is None or callable(fn), getter.__name__
    high = fa._get_ffpa_high_level()
    assert isinstance(high, tuple) and len(high) == 2 and (high[0] is None or callable(high[0]))


def test_ffpa_is_block_mask_and_warn_once_as_listed(caplog):
    from torch.nn.attention.flex_attention import create_block_mask

    block = create_block_mask(lambda b, h, i, j: i >= j, None, None, 128, 128, device="cpu")
    assert fa._is_block_mask(block) and fa._is_block_mask(mask=block)
    assert not fa._is_block_mask(None) and not fa._is_block_mask(torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with caplog.at_level(logging.WARNING):
        fa._warn_once("seed-contract-reason", "first")
        fa._warn_once(reason="seed-contract-reason", message="second", target="eager")
        fa._warn_once("seed-contract-other", "third", "flex")
    texts = [r.getMessage() for r in caplog.records]
    assert sum("first" in t for t in texts) == 1 and not any("second" in t for t in texts)
    assert any("third" in t for t in texts)


class _Layer(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize("style", ["positional", "keyword"])
def test_ffpa_attention_forward_and_mask_as_listed(kernels, style):
    mu = pytest.importorskip("transformers.masking_utils")
    q, k, v = _rand(2, 4, 6, 512, seed=1, dtype=BF16), _rand(2, 2, 6, 512, seed=2, dtype=BF16), \
        _rand(2, 2, 6, 512, seed=3, dtype=BF16)
    if style == "positional":
        mask = fa.ffpa_mask(2, 6, 6, 0, 0, mu.causal_mask_function, None, torch.float32)
        out, weights = fa.ffpa_attention_forward(_Layer(), q, k, v, mask, 0.0, 0.05, None)
    else:
        mask = fa.ffpa_mask(batch_size=2, q_length=6, kv_length=6, q_offset=0, kv_offset=0,
                            mask_function=mu.causal_mask_function, attention_mask=None, dtype=torch.float32)
        out, weights = fa.ffpa_attention_forward(module=_Layer(), query=q, key=k, value=v, attention_mask=mask,
                                                 dropout=0.0, scaling=0.05, softcap=None)
    assert weights is None and out.shape == (2, 6, 4, 512) and out.is_contiguous()   # HF: [B, N, H, D]
    assert rel_err(out, _sdpa_ref(q, k, v, 0.05, True)[0].transpose(1, 2)) < 1e-2


def test_ffpa_register_and_setup_as_listed(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fa.register_ffpa_attention()
    assert fa.register_ffpa_attention() is False   # idempotent: False once registered, as NeMo's
    assert "ffpa" in AttentionInterface._global_mapping and "ffpa" in AttentionMaskInterface._global_mapping
    assert fa.setup_ffpa_backend(1, False) is None
    assert fa.setup_ffpa_backend(cp_size=1, has_packed_sequence=False) is None
