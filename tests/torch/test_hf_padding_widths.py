"""``ffpa_attention_forward`` with a caller's 2D padding mask whose width differs from the key length
(issue #22 case 3), against fp64 with the mask read as HF's FlashAttention path and NeMo read it:

* narrower than the keys (static cache): the mask covers the first ``W`` keys, the other cache slots
  are empty (NaN here: a kernel that read them would show it) and the queries are the last ``Nq`` of
  the ``W`` keys;
* wider than the keys (sliding-window cache): the last ``Nk`` columns cover the keys.

Heads != sequence lengths everywhere; FFPA (d512, causal) and FA4 (d256, sliding window) layers.
"""

import pytest
import torch

pytest.importorskip("transformers")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import fallback, support  # noqa: E402
from xattn.torch.hf.kernel_mask import window_mask  # noqa: E402

from . import stubs  # noqa: E402


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


class _Module(torch.nn.Module):
    is_causal = True


def _inputs(nq, nk, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, nq, d, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, nk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def _expected(q, k, v, mask2d, scale, sliding_window=None):
    """fp64 attention with the FA2/NeMo reading of a 2D mask; rows that see no key are 0."""
    nq, nk, width = q.shape[2], k.shape[2], mask2d.shape[1]
    if width < nk:
        k, v, keep = k[:, :, :width], v[:, :, :width], mask2d.bool()
    else:
        keep = mask2d[:, width - nk:].bool()
    n = k.shape[2]
    left = None if sliding_window is None else sliding_window - 1
    visible = window_mask(nq, n, n - nq, (left, 0), q.device)[None, None] & keep[:, None, None, :]
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return (p @ vv).transpose(1, 2)


CASES = [  # (Nq, Nk, mask width, left padding per row)
    pytest.param(1, 16, 9, (2, 0), id="static-cache-decode"),
    pytest.param(5, 16, 9, (2, 0), id="static-cache-prefill-chunk"),
    pytest.param(9, 16, 9, (3, 1), id="static-cache-prefill"),
    pytest.param(1, 8, 13, (6, 0), id="sliding-cache-decode"),
    pytest.param(3, 8, 13, (6, 2), id="sliding-cache-chunk"),
    pytest.param(7, 7, 7, (2, 0), id="same-width"),
]


@pytest.mark.parametrize("nq, nk, width, pads", CASES)
@pytest.mark.parametrize("d, sliding_window", [(512, None), (256, 4)])
def test_2d_mask_of_any_width(nq, nk, width, pads, d, sliding_window):
    q, k, v = _inputs(nq, nk, d)
    if width < nk:  # empty static-cache slots: garbage a kernel must never read
        k[:, :, width:] = float("nan")
        v[:, :, width:] = float("nan")
    mask = torch.ones(2, width, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    kw = {} if sliding_window is None else dict(sliding_window=sliding_window)
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, mask, scaling=0.1, **kw)
    assert out.shape == (2, nq, 4, d) and not torch.isnan(out).any()
    want = _expected(q, k, v, mask, 0.1, sliding_window)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_2d_mask_narrower_than_the_queries_raises():
    q, k, v = _inputs(6, 10, 512)
    with pytest.raises(ValueError, match="attention_mask: a 2D padding mask of 4 keys"):
        fa.ffpa_attention_forward(_Module(), q, k, v, torch.ones(2, 4, dtype=torch.long), scaling=0.1)


def test_2d_mask_of_another_batch_raises():
    q, k, v = _inputs(6, 6, 512)
    with pytest.raises(ValueError, match="needs batch 2"):
        fa.ffpa_attention_forward(_Module(), q, k, v, torch.ones(3, 6, dtype=torch.long), scaling=0.1)


def uniform_dead_rows_sdpa(module, query, key, value, mask, dropout=0.0, scaling=None, **kwargs):
    """An SDPA that, like CUDA's memory-efficient kernel on the H200, returns a nonzero average for rows
    whose keys are all masked (CPU SDPA returns 0 there, which hid the difference)."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1).float(), value.repeat_interleave(g, 1).float()
    s = (query.float() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~mask, -1e4) if mask.dtype == torch.bool else s + mask.float().clamp_min(-1e4)
    p = torch.softmax(s, -1)
    return (p @ v).to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("keep", [((0, 0, 0, 0, 0, 0),), ((1, 1, 1, 0, 0, 0, 0, 0),)], ids=["all-padding", "wider"])
def test_fallback_rows_without_keys_are_zero_whatever_sdpa_does(monkeypatch, keep):
    """Found by the GPU fuzz: a 2D mask that leaves a row without keys falls back to SDPA, and on CUDA SDPA's
    result for that row was not the 0 the kernels (and the CPU) give."""
    monkeypatch.setattr(fallback, "get_sdpa", lambda: uniform_dead_rows_sdpa)
    fallback._SDPA_FN = None
    q, k, v = _inputs(2, 5, 256)
    q, k, v = q[:1], k[:1], v[:1]
    mask = torch.tensor(keep, dtype=torch.long)
    out, _ = fa.ffpa_attention_forward(_Module(), q, k, v, mask, scaling=0.1)
    want = _expected(q, k, v, mask, 0.1)
    assert torch.all(out[want.abs().sum((-1, -2)) == 0] == 0)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    fallback._SDPA_FN = None
