"""NeMo's ``ffpa_attention`` module as its source behaves (not only its API listing), on the CPU with the
kernels replaced by the fp64 stand-in: what its functions return, how it calls them, how it logs.
The mask factory's return contract and ``ffpa_sliding_attn_backend`` are in test_hf_masks.py."""

import logging

import numpy as np
import pytest
import torch

from tests.reference import attention as ref_attention, rel_err
from xattn.torch import ffpa_attention as fa
from xattn.torch.hf import support

from . import stubs

BF16 = torch.bfloat16


@pytest.fixture
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


def _rand(*shape, seed=0, dtype=BF16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(b=2, hq=4, hkv=2, nq=6, nk=6, d=512):
    return _rand(b, hq, nq, d, seed=1), _rand(b, hkv, nk, d, seed=2), _rand(b, hkv, nk, d, seed=3)


def test_high_level_function_is_called_as_upstream_calls_it(kernels):
    """NeMo: ``fn, backend = _get_ffpa_high_level()`` then ``fn(q, k, v, attn_mask=None, dropout_p=0.0,
    is_causal=True, scale=..., enable_gqa=True, backend=backend)`` -> ``[B, Hq, Nq, D]``."""
    fn, backend = fa._get_ffpa_high_level()
    q, k, v = _qkv()
    out = fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.05, enable_gqa=True, backend=backend)
    want, _ = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=0.05, causal=True)
    assert out.shape == (2, 4, 6, 512) and rel_err(out, want.transpose(1, 2)) < 1e-2
    assert fn(q, k, v, is_causal=True, scale=0.05, enable_gqa=True).shape == out.shape  # backend=None too
    with pytest.raises(ValueError, match="backend"):
        fn(q, k, v, is_causal=True, scale=0.05, enable_gqa=True, backend="cudnn")


def test_high_level_is_none_pair_without_kernels(monkeypatch):
    monkeypatch.setattr(support, "kernels_available", lambda: "no GPU")
    assert fa._get_ffpa_high_level() == (None, None)


def test_low_level_keyword_only_spelling(kernels):
    """Upstream's ``_ffpa_dense_fwd/_bwd`` take ``scale``/``causal`` keyword-only; those names work."""
    q, k, v = _qkv(nq=5, nk=7)
    out, lse = fa._ffpa_dense_fwd(q, k, v, scale=0.05, causal=True)
    dq, dk, dv = fa._ffpa_dense_bwd(torch.ones_like(out), q, k, v, out, lse, scale=0.05, causal=True)
    assert out.shape == (2, 4, 5, 512) and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("cp_size, packed", [(1, True), (1, False), (1, None), (1, 0), (None, False),
                                             (np.int64(1), 1)])
def test_setup_accepts_what_nemo_accepts(cp_size, packed):
    """Ints and None as NeMo takes them; packing is accepted (a superset: NeMo's "ffpa" cannot pack)."""
    assert fa.setup_ffpa_backend(cp_size, packed) is None
    assert fa.setup_ffpa_backend(cp_size=cp_size, has_packed_sequence=packed) is None


@pytest.mark.parametrize("cp_size, packed, error", [("2", False, TypeError), (1.0, False, TypeError),
                                                    (True, False, TypeError), (0, False, ValueError),
                                                    (-1, False, ValueError), (1, "yes", TypeError)])
def test_setup_refuses_other_types(cp_size, packed, error):
    with pytest.raises(error, match="cp_size|has_packed_sequence"):
        fa.setup_ffpa_backend(cp_size, packed)


class _Module(torch.nn.Module):
    is_causal = True
    training = False


def test_fallbacks_are_logged_as_upstream_logs_them(kernels, caplog):
    """Upstream: ``logger.warning("ffpa fallback to %s: %s (reason=%r)", target, message, reason)`` on the
    module's logger, once per reason; the record also carries ``reason``/``target`` attributes."""
    q, k, v = (t.float() for t in _qkv())
    with caplog.at_level(logging.WARNING, logger=fa.__name__):
        fa.ffpa_attention_forward(_Module(), q, k, v, None, scaling=0.05)
        fa.ffpa_attention_forward(_Module(), q, k, v, None, scaling=0.05)
    records = [r for r in caplog.records if r.name == fa.logger.name]
    assert len(records) == 1 and records[0].levelno == logging.WARNING
    assert records[0].getMessage() == "ffpa fallback to sdpa: torch.float32 is not float16/bfloat16 (reason='dtype')"
    assert records[0].reason == "dtype" and records[0].target == "sdpa"
    assert fa.logger.name == "xattn.torch.ffpa_attention"


def test_eager_fallback_returns_the_models_attention_weights(kernels):
    """softcap runs the model's own eager function; its attention weights come back, as under "eager"."""
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    config = gemma2.Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=512,
                                 attn_logit_softcapping=30.0, query_pre_attn_scalar=512)
    layer = gemma2.Gemma2Attention(config, layer_idx=0).eval()
    q, k, v = _qkv()
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    out, weights = fa.ffpa_attention_forward(layer, q, k, v, None, scaling=0.05, softcap=30.0)
    float_mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, torch.finfo(q.dtype).min)
    want_out, want_weights = gemma2.eager_attention_forward(layer, q, k, v, float_mask, dropout=0.0, scaling=0.05,
                                                            softcap=30.0)
    assert weights is not None and weights.shape == (2, 4, 6, 6)
    torch.testing.assert_close(weights, want_weights)
    torch.testing.assert_close(out, want_out.contiguous())
