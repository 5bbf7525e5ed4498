"""On the GPU with the real kernels: a tiny Gemma 4 with its real layer mix (5 sliding : 1 full, sliding
GQA d256 window 16 < documents, full d512 one KV head k == v, q_norm x 0.1) on packed batches (both
routes) and a left-padded batch vs each document alone in fp64; and the sliding layer under both
``XATTN_SLIDING_BACKEND`` settings vs an fp64 reference, with and without padding, fwd + grads."""

import pytest
import torch

from tests.reference import rel_err
from xattn.torch import ffpa_attention as fa
from xattn.torch.hf import mask_factory, routing

from . import gemma_packed as gp

pytestmark = pytest.mark.gpu
pytest.importorskip("transformers.models.gemma4")

SIZES = dict(hidden=128, heads=8, kv_heads=4, vocab=256, sliding_window=16)
LENGTHS = [40, 57, 31]  # not tile multiples, all longer than the window


@pytest.fixture
def families(monkeypatch):
    """Kernel calls of the "ffpa" model by family (sliding layers -> fa4, full -> ffpa)."""
    seen = []
    inner = routing.attention

    def counting(*args, family=None, **kwargs):
        seen.append(family)
        return inner(*args, family=family, **kwargs)
    monkeypatch.setattr(routing, "attention", counting)
    fa._FALLBACK_WARNED.clear()
    return seen


def _ids(shape, seed=1):
    return torch.randint(0, 256, shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens"])
def test_packed_gemma4_equals_documents_alone(route, dtype, families, caplog):
    ids = _ids((1, sum(LENGTHS)))
    errs = gp.compare(gp.packed_runs(ids, LENGTHS, route, "cuda"), gp.packed_runs(ids, LENGTHS, "position_ids", "cuda"),
                      gp.alone_runs(ids, LENGTHS, "cuda"), "cuda", dtype, sum(LENGTHS), **SIZES)
    print(gp.summary(errs, f"packed ({route}, {str(dtype)[6:]})"))
    assert "ffpa fallback" not in caplog.text
    assert families.count("fa4") == 5 and families.count("ffpa") == 1  # one forward of the ffpa model
    gp.assert_no_worse(errs)


@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens"])
def test_packed_gemma4_on_the_gemm_backward(route, families, monkeypatch, caplog):
    """The same packed batch with the full layer's backward on the chunked-GEMM route (its table
    lowered so these short documents take it): per-document blocks, same accuracy as sdpa."""
    from xattn.core import routes
    from xattn.torch import gemm_bwd

    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))
    calls = []
    real = gemm_bwd.gemm_backward_varlen
    monkeypatch.setattr(gemm_bwd, "gemm_backward_varlen", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = _ids((1, sum(LENGTHS)))
    errs = gp.compare(gp.packed_runs(ids, LENGTHS, route, "cuda"), gp.packed_runs(ids, LENGTHS, "position_ids", "cuda"),
                      gp.alone_runs(ids, LENGTHS, "cuda"), "cuda", torch.bfloat16, sum(LENGTHS), **SIZES)
    print(gp.summary(errs, f"packed ({route}, GEMM backward)"))
    assert "ffpa fallback" not in caplog.text
    assert calls == [1]  # the one full layer's backward
    gp.assert_no_worse(errs)


@pytest.mark.parametrize("backend", ["fa4", "flex"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_left_padded_gemma4_equals_rows_alone(dtype, backend, families, monkeypatch, caplog):
    monkeypatch.setattr(mask_factory, "SLIDING_BACKEND", backend)
    ids = _ids((3, 150))
    keep = torch.ones(3, 150, dtype=torch.bool, device="cuda")
    keep[1, :23] = False
    keep[2, :51] = False
    errs = gp.compare(gp.padded_runs(ids, keep), gp.padded_runs(ids, keep), gp.padded_alone_runs(ids, keep, "cuda"),
                      "cuda", dtype, int(keep.sum()), **SIZES)
    print(gp.summary(errs, f"left-padded ({str(dtype)[6:]}, sliding on {backend})"))
    assert "ffpa fallback" not in caplog.text
    assert families.count("fa4") == (5 if backend == "fa4" else 0) and families.count("ffpa") == 1
    gp.assert_no_worse(errs)


def _sliding_reference(q, k, v, mask4d, scale):
    g = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(g, 1).transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~mask4d, float("-inf")), -1).nan_to_num(0.0)
    return torch.matmul(p, v.repeat_interleave(g, 1)).transpose(1, 2)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
@pytest.mark.parametrize("backend", ["fa4", "flex"])
def test_sliding_layer_both_settings_vs_fp64(backend, padded, monkeypatch):
    """The HF function on a sliding-window causal layer (d256, GQA 2, window 16) as a model calls it:
    mask from the factory, then the attention function; fwd and grads vs fp64."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    monkeypatch.setattr(mask_factory, "SLIDING_BACKEND", backend)
    b, n, hq, hkv, d, w = 2, 150, 8, 4, 256, 16
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
               for h in (hq, hkv, hkv))
    keep = torch.ones(b, n, dtype=torch.bool, device="cuda")
    if padded:
        keep[1, :37] = False
    fn = sliding_window_causal_mask_function(w)
    args = dict(batch_size=b, q_length=n, kv_length=n, mask_function=fn, attention_mask=keep if padded else None,
                device="cuda")
    mask = fa.ffpa_mask(**args)
    assert fa._is_block_mask(mask) == (backend == "flex")
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = hq // hkv, True
    out, _ = fa.ffpa_attention_forward(module, q, k, v, mask, scaling=d ** -0.5, sliding_window=w)
    truth4d = sdpa_mask(**args, allow_is_causal_skip=False)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _sliding_reference(q64, k64, v64, truth4d, d ** -0.5)
    dout = torch.randn_like(ref)
    out.backward(dout.to(out.dtype))
    ref.backward(dout)
    for name, a, r in (("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert rel_err(a, r) < 1e-2, (name, rel_err(a, r))
