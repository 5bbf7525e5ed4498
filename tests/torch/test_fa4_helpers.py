"""FA4 helpers (CPU, core replaced by the fp64 reference stand-in): segment layout worked examples,
document-causal attention against an explicitly masked reference, padding queries zero."""

import pytest
import torch

from xattn.torch import fa4

from . import stubs


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)
    fa4._layout_cache.clear()


@pytest.mark.parametrize("ids, q_len, start, q_lens, k_lens", [
    ([[1, 1, 1, 2, 2, 2, 2, 0]], 2, 4, [0, 2, 0, 0], [3, 3, 1, 1]),
    ([[1, 1, 1, 2, 2, 2, 2, 0]], 8, 0, [3, 4, 1], [3, 4, 1]),
    # row 0: one run (ends at the shard end); row 1: runs 1 | 2,2 | 0, the shard covers 2,0
    ([[5, 5, 5, 5], [1, 2, 2, 0]], 2, 2, [2, 0, 1, 1], [4, 1, 2, 1]),
])
def test_varlen_segments(ids, q_len, start, q_lens, k_lens):
    got_q, got_k = fa4._varlen_segments(torch.tensor(ids), q_len, start)
    assert (got_q, got_k) == (q_lens, k_lens)
    assert sum(got_k) == torch.tensor(ids).numel() and sum(got_q) == q_len * len(ids)


def test_shard_outside_keys_is_refused():
    with pytest.raises(ValueError, match="outside"):
        fa4._varlen_segments(torch.tensor([[1, 1, 1]]), 2, 2)


def _masked_reference(q, k, v, q_ids, kv_ids, start, scale):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    pos_q = torch.arange(nq) + start
    pos_k = torch.arange(nk)
    kk, vv = k.double().repeat_interleave(g, 2), v.double().repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    same = q_ids[:, :, None] == kv_ids[:, None, :]
    mask = same & (pos_k[None, None, :] <= pos_q[None, :, None])
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    return out * (q_ids != 0)[:, :, None, None]


@pytest.mark.parametrize("start", [0, 4])
def test_document_causal_matches_masked_reference(start):
    kv_ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 4, 4, 0, 0]])
    nq = 4 if start == 4 else 8
    q_ids = kv_ids[:, start:start + nq]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, nq, 4, 128, generator=g, requires_grad=True)
    k, v = torch.randn(2, 8, 2, 128, generator=g), torch.randn(2, 8, 2, 128, generator=g)
    out = fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, scale=0.1)
    ref = _masked_reference(q.detach(), k, v, q_ids, kv_ids, start, 0.1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert torch.isfinite(q.grad).all()
    assert fa4._varlen_layout(kv_ids, nq, start) is fa4._layout_cache["entry"][1]  # cached per step


def test_causal_and_import_helpers():
    q = torch.randn(1, 6, 2, 64)
    out = fa4.causal_fa4_attention(q, q, q, scale=0.125)
    assert out.shape == q.shape and ("fwd", "fa4") in stubs.CALLS
    with pytest.raises(ImportError, match="no_such_module"):
        fa4.import_fa4_modules("flash_attn.cute", "no_such_module")
