"""xattn.torch custom ops on the CPU: the core calls are replaced (in the test only) by a reference
that honours the same destination-passing contract, so schema, fake kernels, autograd and
torch.compile(fullgraph=True) are exercised for real without a GPU."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import xattn.torch as xt
from xattn.core.checks import Memo
from tests.reference import attention as ref_attention

from . import stubs

@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)


CALLS = stubs.CALLS


def _qkv(b=2, nq=12, nk=16, hq=4, hkv=2, d=512, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, nq, hq, d, generator=g, dtype=dtype, requires_grad=True),
            torch.randn(b, nk, hkv, d, generator=g, dtype=dtype, requires_grad=True),
            torch.randn(b, nk, hkv, d, generator=g, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("d, causal", [(512, True), (512, False), (128, True)])
def test_autograd_through_the_op(d, causal):
    q, k, v = _qkv(d=d)
    out = xt.attention(q, k, v, causal=causal)
    out.square().sum().backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(q2, k2, v2, scale=d ** -0.5, causal=causal, dtype=torch.float32)
    ref.square().sum().backward()
    for a, b in ((out, ref), (q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert ("fwd", "ffpa" if d > 256 else "fa4") in CALLS and any(c[0] == "bwd" for c in CALLS)


@pytest.mark.parametrize("varlen", [False, True])
def test_eager_path_and_custom_op_give_the_same_values_and_grads(varlen, monkeypatch):
    """Plain eager tensors skip the custom-op dispatch (host cost); the result must not change."""
    from xattn.torch import ops

    q, k, v = _qkv(b=1, d=512)
    kw = {}
    if varlen:
        q, k, v = (t.detach()[0].requires_grad_() for t in (q, k, v))
        cu_q, cu_k = torch.tensor([0, 5, 12], dtype=torch.int32), torch.tensor([0, 9, 16], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=9)
    dout = torch.randn(q.shape)
    results = []
    for route in ("eager", "custom op"):
        calls = []
        monkeypatch.setattr(ops._EagerAttention, "apply", _recording(ops._EagerAttention.apply, calls))
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        if route == "eager":
            out, lse = xt.attention_with_lse(qq, kk, vv, causal=True, **kw)
        else:
            out, lse = torch.ops.xattn.fwd(qq, kk, vv, "ffpa", 512 ** -0.5, True, -1, -1, kw.get("cu_seqlens_q"),
                                           kw.get("cu_seqlens_k"), kw.get("max_seqlen_q", 0), kw.get("max_seqlen_k", 0))
        out.backward(dout)
        assert bool(calls) == (route == "eager") and not lse.requires_grad
        results.append((out, lse, qq.grad, kk.grad, vv.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _recording(fn, calls):
    def wrapped(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)
    return wrapped


def test_varlen_op_and_lse_not_differentiable():
    q = torch.randn(30, 4, 128, requires_grad=True)
    k, v = torch.randn(40, 2, 128), torch.randn(40, 2, 128)
    cu_q, cu_k = torch.tensor([0, 10, 10, 30], dtype=torch.int32), torch.tensor([0, 5, 25, 40], dtype=torch.int32)
    out, lse = xt.attention_with_lse(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=20, max_seqlen_k=20)
    assert out.shape == (30, 4, 128) and lse.shape == (4, 30) and not lse.requires_grad
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with pytest.raises(ValueError, match="max_seqlen"):
        xt.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_fake_kernels_give_shapes():
    with FakeTensorMode():
        q, k, v = torch.empty(2, 7, 8, 192, dtype=torch.bfloat16), torch.empty(2, 9, 2, 192, dtype=torch.bfloat16), \
            torch.empty(2, 9, 2, 128, dtype=torch.bfloat16)
        out, lse = torch.ops.xattn.fwd(q, k, v, "fa4", 0.1, True, -1, -1, None, None, 0, 0)
        assert out.shape == (2, 7, 8, 128) and lse.shape == (2, 8, 7) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.xattn.bwd(out, q, k, v, out, lse, "fa4", 0.1, True, -1, -1, None, None, 0, 0)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_opcheck():
    q, k, v = _qkv(b=1, nq=8, nk=8, hq=2, hkv=1, d=128)
    torch.library.opcheck(torch.ops.xattn.fwd.default, (q, k, v, "fa4", 0.1, True, -1, -1, None, None, 0, 0))


def test_torch_compile_fullgraph_no_graph_break():
    q, k, v = _qkv(b=1, nq=8, nk=8, hq=2, hkv=1, d=512)

    def step(q, k, v):
        return xt.attention(q * 2, k, v, causal=True).float().square().mean()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    step(q2, k2, v2).backward()
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=1e-5)


def test_fake_backward_strides_equal_the_real_ones():
    """HF passes permuted [B, H, N, D] -> [B, N, H, D] views: the fake kernel must promise the real
    (contiguous) gradient strides, or Inductor reads gradients with the wrong strides."""
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(d=128))  # permuted views
    out, lse = xt.attention_with_lse(q, k, v, causal=True)
    args = (out.detach().contiguous(), q, k, v, out.detach(), lse, "fa4", 0.1, True, -1, -1, None, None, 0, 0)
    real = torch.ops.xattn.bwd(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = torch.ops.xattn.bwd(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert [t.stride() for t in fake] == [t.stride() for t in real]
    assert q.stride() != real[0].stride()  # the case that used to differ


def test_zero_query_backward_gives_zero_key_grads(monkeypatch):
    """With no query row the core launches nothing; dk/dv must still be 0, not uninitialised memory."""
    from xattn.torch import ops

    monkeypatch.setitem(ops.LAUNCH, "bwd", lambda *a, **kw: None)  # the core's early return for total_q == 0
    q, k, v = _qkv(nq=0, d=128)
    out = xt.attention(q, k, v)
    out.sum().backward()
    assert k.grad.abs().sum() == 0 and v.grad.abs().sum() == 0 and q.grad.numel() == 0


def test_double_backward_raises_instead_of_detaching():
    q, k, v = _qkv(d=128)
    out = xt.attention(q, k, v, causal=True)
    (dq,) = torch.autograd.grad(out.square().sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate"):
        torch.autograd.grad(dq.sum(), (q,))


@pytest.mark.parametrize("no_grad", ["no_grad", "inputs_without_grad", "inference_mode"])
def test_forward_without_autograd_skips_the_function_and_gives_the_same_bits(no_grad, monkeypatch):
    """Where no gradient can be asked for (decode), the forward runs without the autograd.Function (host
    cost); outputs are bitwise those of the differentiable path and carry no graph."""
    from xattn.torch import ops

    q, k, v = _qkv(b=1, d=512)
    want, want_lse = xt.attention_with_lse(q, k, v, causal=True)
    calls = []
    monkeypatch.setattr(ops._EagerAttention, "apply", _recording(ops._EagerAttention.apply, calls))
    plain = [t.detach() for t in (q, k, v)]
    if no_grad == "no_grad":
        with torch.no_grad():
            out, lse = xt.attention_with_lse(q, k, v, causal=True)
    elif no_grad == "inference_mode":
        with torch.inference_mode():
            out, lse = xt.attention_with_lse(*[t.clone() for t in plain], causal=True)
    else:
        out, lse = xt.attention_with_lse(*plain, causal=True)
    assert not calls and out.grad_fn is None and not out.requires_grad
    assert torch.equal(out, want.detach()) and torch.equal(lse, want_lse)
    out2 = xt.attention(q, k, v, causal=True)  # inputs that require grad: the differentiable path
    assert calls and out2.requires_grad


def test_forward_checks_run_once_per_signature(monkeypatch):
    """The core's validator runs once per (shapes, dtype, flags); a refused call is refused every time
    (never cached), and another shape is checked anew."""
    from xattn.torch import ops

    checked = []
    monkeypatch.setattr(ops, "validate", _recording(ops.validate, checked))
    monkeypatch.setattr(ops, "_CHECKED", Memo())
    monkeypatch.setattr(ops, "_FWD_SETUPS", Memo())
    q, k, v = (t.detach() for t in _qkv(b=1, nq=5, nk=7, d=128))
    for _ in range(3):
        xt.attention(q, k, v, causal=True)
    assert len(checked) == 1
    xt.attention(q, k, v, causal=False)
    xt.attention(q[:, :3], k, v, causal=True)
    assert len(checked) == 3
    for _ in range(2):  # rank 3 without cu_seqlens: refused by the shape checks, each time
        with pytest.raises(ValueError, match="expected rank 4"):
            xt.attention(q[0], k[0], v[0])
    assert len(checked) == 5 and len(ops._FWD_SETUPS) == 3
