"""GPU twins of test_nemo_unit.py: NeMo AutoModel's ``ffpa_attention`` and ``fa4`` unit cases on the real kernels,
each result against an fp32 reference of fresh random inputs (relative L2 error, bf16).

* ``fa4``: ``document_causal_fa4_attention`` on NeMo's document layouts at NeMo's sizes (512 keys, 4 heads,
  192/128 head dims): one document, packed documents with trailing padding, left padding, query shards at
  256, a shard of padding only, two rows with a one-token document; forward and dq, dk, dv.
* ``ffpa_attention``: the routes its hooks pick: head dims other than 512 on FA4 (NeMo sends them to SDPA),
  CPU tensors (SDPA), ``_ffpa_low_level_ready`` False (SDPA), a replaced ``_get_ffpa_high_level`` running
  NeMo's dense path on the kernels, ``_get_sdpa`` None (HF Gemma 4's eager), and a flex ``BlockMask`` at head
  dim 512 (NeMo's small FlexAttention tiles).
"""

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.reference import attention as ref_attention, rel_err  # noqa: E402
from xattn.torch import fa4, ffpa_attention as fa  # noqa: E402

from .fa4_reference import document_causal_mask, sdpa_reference  # noqa: E402
from .test_nemo_unit import NEMO_CASES, nemo_layout  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE, BF16, F32 = "cuda", torch.bfloat16, torch.float32
TOL = 1e-2  # relative L2 error of bf16 results vs fp32 (measured kernels: ~2.5e-3)


@pytest.fixture(autouse=True)
def fresh_warnings():
    fa._FALLBACK_WARNED.clear()
    yield
    fa._FALLBACK_WARNED.clear()


class _Layer(torch.nn.Module):
    """A bare attention layer as NeMo's tests build one (no ``num_key_value_groups``, no modeling file)."""

    def __init__(self, head_dim: int):
        super().__init__()
        self.head_dim, self.is_causal = head_dim, True
        self.eval()


def _inputs(*shapes, seed):
    """Fresh bf16 normals on the GPU, needing grad."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return tuple(torch.randn(*s, device=DEVICE, dtype=BF16, generator=g).requires_grad_() for s in shapes)


def _reference(q, k, v, scale, window=(None, None)):
    """fp32 causal (optionally windowed) reference of SDPA-layout q/k/v, as HF's output ``[B, N, H, D]``."""
    x = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out, _ = ref_attention(*(t.transpose(1, 2) for t in x), scale=scale, causal=True, window=window, dtype=F32)
    return out, x


def _check_forward_and_grads(out, q, k, v, ref, ref_inputs):
    dout = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    want = (ref, *torch.autograd.grad(ref, ref_inputs, dout.float()))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) < TOL, f"{name}: relative error {rel_err(a, b):.3g}"


def _reasons(caplog):
    return [r.reason for r in caplog.records if r.name == fa.logger.name]


@pytest.mark.parametrize("layout, start, local", [pytest.param(*c, id="-".join(map(str, c))) for c in NEMO_CASES])
def test_document_causal_layouts_of_nemos_cases(layout, start, local):
    kv_ids = nemo_layout(layout, 512).to(DEVICE)
    q_ids = kv_ids[:, start:start + local]
    b = kv_ids.shape[0]
    q, k, v = _inputs((b, 4, local, 192), (b, 4, 512, 192), (b, 4, 512, 128), seed=start + local)
    scale = 192 ** -0.5
    out = fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, scale)
    keep = q_ids > 0
    x = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = sdpa_reference(*x, document_causal_mask(q_ids, kv_ids, start), scale, dtype=F32, keep_queries=keep)
    if keep.any():
        _check_forward_and_grads(out, q, k, v, ref, x)
    assert torch.all(out.masked_select(~keep[:, None, :, None]) == 0)  # padding queries: exactly zero


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_other_than_512_run_on_fa4(caplog, d):
    q, k, v = _inputs((2, 8, 300, d), (2, 2, 300, d), (2, 2, 300, d), seed=d)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, weights = fa.ffpa_attention_forward(_Layer(d), q, k, v, None, scaling=d ** -0.5)
    assert not _reasons(caplog) and weights is None
    _check_forward_and_grads(out, q, k, v, *_reference(q, k, v, d ** -0.5))


def test_cpu_tensors_run_on_the_fallback(caplog):
    """NeMo's unit tests hand CPU tensors to the layer: on this GPU machine they run on SDPA, warned once."""
    q, k, v = (t.detach().cpu() for t in _inputs((2, 8, 40, 64), (2, 2, 40, 64), (2, 2, 40, 64), seed=5))
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, _ = fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.125)
    assert _reasons(caplog) == ["ffpa_unavailable"] and out.device.type == "cpu"
    assert rel_err(out, _reference(q, k, v, 0.125)[0]) < TOL


def test_low_level_ready_hook_false_runs_sdpa(monkeypatch, caplog):
    monkeypatch.setattr(fa, "_ffpa_low_level_ready", lambda: False)
    q, k, v = _inputs((2, 8, 256, 512), (2, 2, 256, 512), (2, 2, 256, 512), seed=1)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, _ = fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05)
    assert _reasons(caplog) == ["ffpa_unavailable"]
    _check_forward_and_grads(out, q, k, v, *_reference(q, k, v, 0.05))


def test_dense_ffpa_through_a_replaced_high_level(monkeypatch):
    """A caller's ``_get_ffpa_high_level`` wrapping xattn's own: NeMo's dense call reaches the FFPA kernels."""
    own, calls = fa._get_ffpa_high_level, []

    def high_level():
        fn, backend = own()

        def recorded(*args, **kwargs):
            calls.append(kwargs)
            return fn(*args, **kwargs)
        return recorded, backend

    monkeypatch.setattr(fa, "_get_ffpa_high_level", high_level)
    q, k, v = _inputs((1, 8, 384, 512), (1, 2, 384, 512), (1, 2, 384, 512), seed=2)
    out, _ = fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05)
    assert len(calls) == 1 and calls[0]["is_causal"] and calls[0]["enable_gqa"] and calls[0]["scale"] == 0.05
    _check_forward_and_grads(out, q, k, v, *_reference(q, k, v, 0.05))


def test_sdpa_unavailable_degrades_to_gemma4_eager(monkeypatch):
    pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    monkeypatch.setattr(fa, "_get_sdpa", lambda: None)
    monkeypatch.setattr(fa, "_ffpa_low_level_ready", lambda: False)
    q, k, v = _inputs((2, 8, 256, 512), (2, 2, 256, 512), (2, 2, 256, 512), seed=3)
    out, weights = fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=512 ** -0.5)
    assert weights is not None and weights.shape == (2, 8, 256, 256)  # the eager function's probabilities
    _check_forward_and_grads(out, q, k, v, *_reference(q, k, v, 512 ** -0.5))


class _FlexConfig:
    model_type = "gemma4_text"
    ffpa_sliding_attn_backend = "flex"


def test_flex_block_mask_at_head_dim_512():
    """A sliding layer's BlockMask (``ffpa_sliding_attn_backend="flex"``) at head dim 512: FlexAttention with NeMo's
    small tiles (its default ones do not fit in shared memory), forward against the windowed reference."""
    from transformers import masking_utils as mu

    window = 64
    mask = fa.ffpa_mask(batch_size=1, q_length=256, kv_length=256, mask_function=mu.sliding_window_causal_mask_function(
        window), attention_mask=None, device=DEVICE, config=_FlexConfig())
    assert fa._is_block_mask(mask)
    q, k, v = (t.detach() for t in _inputs((1, 4, 256, 512), (1, 2, 256, 512), (1, 2, 256, 512), seed=4))
    out, _ = fa.ffpa_attention_forward(_Layer(512), q, k, v, mask, scaling=0.05)
    ref, _ = _reference(q, k, v, 0.05, window=(window - 1, 0))
    assert rel_err(out, ref) < TOL
