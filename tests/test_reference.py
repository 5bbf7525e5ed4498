"""The shared reference agrees with torch SDPA where their conventions meet (CPU)."""

import math

import torch
import torch.nn.functional as F

from tests.reference import allowed, attention, varlen_attention


def _sdpa(q, k, v, causal, scale):
    g = q.shape[2] // k.shape[2]
    qt, kt, vt = (t.transpose(1, 2).double() for t in (q, k, v))
    kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)


def test_matches_sdpa_full_and_causal_square():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 33, 4, 16), torch.randn(2, 33, 2, 16), torch.randn(2, 33, 2, 16)
    for causal in (False, True):
        out, lse = attention(q, k, v, scale=0.3, causal=causal)
        assert torch.allclose(out, _sdpa(q, k, v, causal, 0.3), atol=1e-10)
    s = torch.einsum("bnhd,bmhd->bhnm", q.double(), k.repeat_interleave(2, 2).double()) * 0.3
    assert torch.allclose(attention(q, k, v, scale=0.3)[1], torch.logsumexp(s, -1))


def test_causal_is_bottom_right():
    m = allowed(2, 4, causal=True)
    assert m.tolist() == [[True, True, True, False], [True, True, True, True]]
    m = allowed(4, 2, causal=True)  # first two queries see nothing
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert allowed(3, 3, False, window=(1, 0)).tolist() == [[True, False, False], [True, True, False],
                                                            [False, True, True]]


def test_empty_rows_and_segments():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    out, lse = attention(q, k, v, scale=1 / math.sqrt(8), causal=True)
    assert (out[0, :2] == 0).all() and torch.isinf(lse[0, 0, :2]).all()
    qv, kv = torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True), torch.randn(5, 2, 8)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 2, 4, 5])
    o, l_ = varlen_attention(qv, kv, kv, cu_q, cu_k, scale=0.5)
    ref, _ = attention(qv[None, 3:7], kv[None, 4:5], kv[None, 4:5], scale=0.5)
    assert torch.allclose(o[3:7], ref[0]) and l_.shape == (2, 7)
    o.sum().backward()
    assert torch.isfinite(qv.grad).all()
