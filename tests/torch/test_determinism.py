"""torch.use_deterministic_algorithms and the xattn backward, on the CPU stand-ins (tests/torch/stubs.py):
the FA4 backward (fp32 reduce-adds, see xattn.core.determinism) alerts through torch's own mechanism
(RuntimeError, or a UserWarning under warn_only); the FFPA backward and every forward never do.
Every front end reaches the alert: eager autograd.Function, the custom op, the HF function."""

import warnings

import pytest
import torch

import xattn.torch as xt
from xattn.torch import ops

from . import stubs

ALERT = r"xattn backward \(FA4 sm90 .* does not have a deterministic implementation"


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)
    on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(on, warn_only=warn_only)


def _mode(mode):
    torch.use_deterministic_algorithms(mode != "off", warn_only=mode == "warn_only")


# (family-deciding head dims, GQA ratio, causal, window, varlen, nondeterministic)
CONFIGS = [
    pytest.param(512, 1, False, (None, None), False, False, id="ffpa-d512-mha"),
    pytest.param(512, 4, True, (None, None), False, False, id="ffpa-d512-gqa4-causal"),
    pytest.param(512, 8, False, (None, None), True, False, id="ffpa-d512-gqa8-varlen"),
    pytest.param(128, 1, True, (None, None), False, True, id="fa4-d128-mha-causal"),
    pytest.param(128, 4, True, (None, None), True, True, id="fa4-d128-gqa4-causal-varlen"),
    pytest.param(256, 2, False, (63, 0), False, True, id="fa4-d256-gqa2-window"),
]


def _inputs(d, g, varlen):
    gen = torch.Generator().manual_seed(0)
    shape_q, shape_k = ((14, 2 * g, d), (14, 2, d)) if varlen else ((2, 7, 2 * g, d), (2, 7, 2, d))
    q, k, v = (torch.randn(s, generator=gen, requires_grad=True) for s in (shape_q, shape_k, shape_k))
    kw = {}
    if varlen:
        cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=9, max_seqlen_k=9)
    return q, k, v, kw


def _fwd_bwd(d, g, causal, window, varlen, route="eager"):
    q, k, v, kw = _inputs(d, g, varlen)
    if route == "eager":
        out = xt.attention(q, k, v, causal=causal, window_size=window, **kw)
    else:  # the xattn::fwd custom op, its registered autograd and the xattn::bwd op
        wl, wr = (-1 if w is None else w for w in window)
        out, _ = ops.fwd(q, k, v, "ffpa" if d > 256 else "fa4", d ** -0.5, causal, wl, wr, kw.get("cu_seqlens_q"),
                         kw.get("cu_seqlens_k"), kw.get("max_seqlen_q", 0), kw.get("max_seqlen_k", 0))
    out.square().sum().backward()
    return out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("route", ["eager", "custom op"])
@pytest.mark.parametrize("d, g, causal, window, varlen, nondet", CONFIGS)
def test_deterministic_mode_raises_for_the_fa4_backward_only(d, g, causal, window, varlen, nondet, route):
    _mode("on")
    if nondet:
        with pytest.raises(RuntimeError, match=ALERT):
            _fwd_bwd(d, g, causal, window, varlen, route)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _fwd_bwd(d, g, causal, window, varlen, route)
    assert stubs.CALLS[0][0] == "fwd"  # the forward ran (it is deterministic); the FA4 backward did not
    assert any(c[0] == "bwd" for c in stubs.CALLS) is not nondet


@pytest.mark.parametrize("d, g, causal, window, varlen, nondet", CONFIGS)
def test_warn_only_warns_and_gives_the_same_result(d, g, causal, window, varlen, nondet):
    _mode("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, grads = _fwd_bwd(d, g, causal, window, varlen)
    _mode("warn_only")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out2, grads2 = _fwd_bwd(d, g, causal, window, varlen)
    alerts = [w for w in caught if "deterministic implementation" in str(w.message)]
    assert len(alerts) == nondet
    if nondet:
        assert alerts[0].category is UserWarning and "warn_only=True" in str(alerts[0].message)
        assert ("dK/dV over the GQA group" in str(alerts[0].message)) == (g > 1)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))


def test_forward_only_never_alerts():
    _mode("on")
    q, k, v, _ = _inputs(128, 4, False)
    with torch.no_grad():
        xt.attention(q, k, v, causal=True)
    xt.attention(q, k, v, causal=True)  # graph built, no backward run


def test_hf_function_alerts_on_fa4_sliding_layers_only(monkeypatch):
    pytest.importorskip("transformers")
    from xattn.torch import ffpa_attention as fa
    from xattn.torch.hf import support

    monkeypatch.setattr(support, "kernels_available", lambda: None)

    class Layer(torch.nn.Module):
        is_causal = True

    def step(d, **kw):
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(1, 4, 6, d, generator=gen).bfloat16().requires_grad_()
        k, v = (torch.randn(1, 2, 6, d, generator=gen).bfloat16().requires_grad_() for _ in range(2))
        out, _ = fa.ffpa_attention_forward(Layer(), q, k, v, None, scaling=1.0, **kw)
        out.float().square().sum().backward()

    _mode("on")
    step(512)  # a global Gemma 4 layer: FFPA, deterministic
    with pytest.raises(RuntimeError, match=ALERT):
        step(256, sliding_window=3)  # a sliding layer: FA4 local
