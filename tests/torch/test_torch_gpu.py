"""xattn.torch on the GPU with the real kernels: custom ops vs the fp64 reference (fwd + grads),
a tiny Gemma 4 with attn_implementation="ffpa" vs "sdpa", torch.compile fullgraph and CUDA-graph
replay. The FA4 helpers (xattn.torch.fa4) have their own file, test_fa4_helpers_gpu.py."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention, rel_err
from xattn.torch import ffpa_attention as fa

from . import gemma

pytestmark = pytest.mark.gpu


def _qkv(b, nq, nk, hq, hkv, d, dv=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    return mk(b, nq, hq, d), mk(b, nk, hkv, d), mk(b, nk, hkv, dv or d)


@pytest.mark.parametrize("d, dv, g, causal", [(512, 512, 4, True), (512, 512, 1, False), (128, 128, 4, True),
                                              (192, 128, 1, True), (256, 256, 2, False)])
def test_attention_op_vs_reference(d, dv, g, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(2, 200, 264, 2 * g, 2, d, dv))
    out = xt.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(q64, k64, v64, scale=d ** -0.5, causal=causal)
    ref.backward(dout.double())
    for name, a, b in (("out", out, ref), ("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert rel_err(a, b) < 1e-2, name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiny_gemma4_ffpa_vs_sdpa_logits_and_grads(dtype, monkeypatch):
    """4 layers (sliding d256 GQA 2 on FA4 local, full d512 on FFPA), a left-padded batch: ffpa
    is as close to an fp64 sdpa run of the same weights as sdpa itself (tests/torch/gemma.py)."""
    pytest.importorskip("transformers.models.gemma4")
    ids = torch.randint(0, 128, (2, 48), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    mask = torch.ones(2, 48, dtype=torch.long, device="cuda")
    mask[1, :7] = 0  # left padding
    errs, layers, calls = gemma.parity(monkeypatch, dict(hidden=128, layers=4, heads=8, kv_heads=4, vocab=128,
                                                 sliding_window=16), ids, mask, "cuda", dtype)
    print(gemma.summary(errs, layers, dtype))
    assert calls == {"truth": 0, "sdpa": 0, "ffpa": 4, "layer check": 4}
    gemma.assert_parity(errs, layers)


def test_packed_batch_equals_each_document_alone():
    q, k, v = (t.transpose(1, 2) for t in _qkv(1, 96, 96, 8, 2, 512))
    pos = torch.cat([torch.arange(40), torch.arange(56)])[None].cuda()
    out, _ = fa.ffpa_attention_forward(torch.nn.Module(), q, k, v, None, scaling=1.0, position_ids=pos)
    for a, b in ((0, 40), (40, 96)):
        alone, _ = fa.ffpa_attention_forward(torch.nn.Module(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None,
                                             scaling=1.0)
        assert rel_err(out[:, a:b], alone.double()) < 1e-2


def test_torch_compile_fullgraph_and_cuda_graph_replay():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 256, 256, 8, 2, 512))

    def step(q, k, v):
        return xt.attention(q, k, v, causal=True, softmax_scale=1.0).float().square().mean()
    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager = step(q, k, v)
    eager.backward()
    assert torch.allclose(loss, eager) and all(torch.equal(a, t.grad) for a, t in zip(grads, (q, k, v)))

    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up outside the capture (compiles, allocator)
        for _ in range(2):
            step(*static).backward()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    for t in static:
        t.grad = None
    with torch.cuda.graph(graph):
        gl = step(*static)
        gl.backward()
    for t, src in zip(static, (q, k, v)):
        t.data.copy_(src.detach() * 0.5)
    graph.replay()
    torch.cuda.synchronize()
    ref = [t.detach().clone().requires_grad_() for t in static]
    step(*ref).backward()
    assert torch.allclose(gl, step(*ref).detach()) and rel_err(static[0].grad, ref[0].grad.double()) < 1e-6
