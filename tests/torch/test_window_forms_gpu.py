"""GPU twins of test_window_forms.py and test_hf_padding_widths.py (issue #22 cases 1-3) on the real kernels:
every window spelling at FA4 and FFPA head dims, and 2D padding masks narrower and wider than the keys,
against fp64 (fwd and grads); FFPA windows refused before any launch."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention, rel_err

from .test_hf_padding_widths import CASES as WIDTH_CASES, _expected, _Module
from .test_window_forms import SPELLINGS

pytestmark = pytest.mark.gpu


def _qkv(d, nq=200, nk=264, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()  # noqa: E731
    return mk(2, nq, 4, d), mk(2, nk, 2, d), mk(2, nk, 2, d)


def _check(out, q, k, v, causal, window, scale):
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = ref_attention(q64, k64, v64, scale=scale, causal=causal, window=window)
    want = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *want)):
        if not bool(b.any()):  # e.g. dq of the window (0, 0): one key per row, so exactly 0
            assert a.abs().max().item() < 1e-3, name
            continue
        assert rel_err(a, b) < 1e-2, name


@pytest.mark.parametrize("causal, window, want_causal, want_window", SPELLINGS)
def test_fa4_spellings_on_the_kernels(causal, window, want_causal, want_window):
    q, k, v = _qkv(128)
    out = xt.attention(q, k, v, causal=causal, window_size=window, softmax_scale=0.1)
    _check(out, q, k, v, want_causal, want_window, 0.1)


@pytest.mark.parametrize("causal, window, want_causal, want_window",
                         [p for p in SPELLINGS if p.values[3] == (None, None)])
def test_ffpa_spellings_on_the_kernels(causal, window, want_causal, want_window):
    q, k, v = _qkv(512, nq=264)
    out = xt.attention(q, k, v, causal=causal, window_size=window, softmax_scale=0.05)
    _check(out, q, k, v, want_causal, want_window, 0.05)


@pytest.mark.parametrize("causal, window", [(False, (3, 0)), (True, (3, None)), (True, (16, -1)), (False, (16, 16))])
def test_ffpa_window_refused_and_the_context_lives(causal, window):
    q, k, v = _qkv(512)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        xt.attention(q, k, v, causal=causal, window_size=window)
    out = xt.attention(q, k, v, causal=True)  # the next good call is right
    _check(out, q, k, v, True, (None, None), 512 ** -0.5)


@pytest.mark.parametrize("nq, nk, width, pads", WIDTH_CASES)
@pytest.mark.parametrize("d, sliding_window", [(512, None), (256, 16)])
def test_hf_2d_mask_of_any_width_on_the_kernels(nq, nk, width, pads, d, sliding_window):
    from xattn.torch import ffpa_attention as fa

    nq, nk, width = (nq if nq == 1 else nq * 24), nk * 24, width * 24  # the CPU cases x 24: tiles are crossed
    pads = tuple(p * 24 for p in pads)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 4, nq, d, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, nk, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    if width < nk:
        k[:, :, width:] = float("nan")
        v[:, :, width:] = float("nan")
    mask = torch.ones(2, width, dtype=torch.long, device="cuda")
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    kw = {} if sliding_window is None else dict(sliding_window=sliding_window)
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, mask, scaling=d ** -0.5, **kw)
    assert not torch.isnan(out).any()
    want = _expected(q, k, v, mask, d ** -0.5, sliding_window)
    assert rel_err(out, want) < 1e-2
