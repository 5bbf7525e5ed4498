"""Determinism on the GPU with the real kernels (xattn.core.determinism says which launchers are):
every forward gives the same bits over 5 runs; the FFPA backward gives the same bits over 5 runs under
``torch.use_deterministic_algorithms(True)``; the FA4 backward raises there (warn_only: warns, runs)."""

import warnings

import pytest
import torch

import xattn.torch as xt
from tests.determinism_cases import ALERT, FA4, FFPA

pytestmark = pytest.mark.gpu

RUNS = 5


@pytest.fixture(autouse=True)
def restore_mode():
    on, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    yield
    torch.use_deterministic_algorithms(on, warn_only=warn_only)


def _inputs(d, g, varlen, seed=0):
    """Lengths that are no multiple of any tile; varlen with an empty and a one-token document."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hkv = 2
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    if varlen:
        lengths = [700, 0, 1, 531]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        t = sum(lengths)
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        return mk(t, g * hkv, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, g * hkv, d), kw
    return mk(2, 777, g * hkv, d), mk(2, 901, hkv, d), mk(2, 901, hkv, d), mk(2, 777, g * hkv, d), {}


def _grads(q, k, v, dout, causal, window, kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = xt.attention(q, k, v, causal=causal, window_size=window, **kw)
    out.backward(dout)
    return [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("d, g, causal, window, varlen", FFPA + FA4)
def test_forward_is_bitwise_reproducible(d, g, causal, window, varlen):
    q, k, v, _, kw = _inputs(d, g, varlen)
    torch.use_deterministic_algorithms(True)  # the forward never alerts
    first = xt.attention_with_lse(q, k, v, causal=causal, window_size=window, **kw)
    for _ in range(RUNS - 1):
        again = xt.attention_with_lse(q, k, v, causal=causal, window_size=window, **kw)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("d, g, causal, window, varlen", FFPA)
def test_ffpa_backward_is_bitwise_reproducible_under_deterministic_algorithms(d, g, causal, window, varlen):
    q, k, v, dout, kw = _inputs(d, g, varlen)
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = _grads(q, k, v, dout, causal, window, kw)
        for _ in range(RUNS - 1):
            again = _grads(q, k, v, dout, causal, window, kw)
            for name, a, b in zip(("dq", "dk", "dv"), first, again):
                assert torch.equal(a, b), name
    assert not [w for w in caught if "deterministic" in str(w.message)]


@pytest.mark.parametrize("d, g, causal, window, varlen", FA4)
def test_fa4_backward_alerts_under_deterministic_algorithms(d, g, causal, window, varlen):
    q, k, v, dout, kw = _inputs(d, g, varlen)
    torch.use_deterministic_algorithms(False)
    runs = [_grads(q, k, v, dout, causal, window, kw) for _ in range(RUNS)]
    differing = {n: sum(not torch.equal(r[i], runs[0][i]) for r in runs[1:]) for i, n in enumerate(("dq", "dk", "dv"))}
    print(f"FA4 backward, runs differing in the bits from run 1 (of {RUNS - 1}): {differing}")  # what the alert is for

    torch.use_deterministic_algorithms(True)
    with pytest.raises(RuntimeError, match=ALERT):
        _grads(q, k, v, dout, causal, window, kw)

    torch.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match=ALERT):
        grads = _grads(q, k, v, dout, causal, window, kw)
    for a, b in zip(grads, runs[0]):  # the same computation, up to the order of the fp32 adds
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
