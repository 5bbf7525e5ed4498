"""The FA4 helpers on the GPU with the real kernels, in NeMo's layouts: ``causal_fa4_attention`` and
``document_causal_fa4_attention`` (SDPA ``[batch, heads, sequence, dim]``, heads != sequence length) and
``_load_fa4``'s entry points (FlashAttention layouts), forward and gradients (dq, dk, dv) against an fp64
masked reference; bf16 and fp16, GQA, head dims 128, 192/128 and 256, query shards at
``q_global_start > 0`` over several documents with padding (padding queries exactly zero).

Tolerances as FlashAttention's tests: the kernel's max error vs fp64 may be at most twice the max error
of the same computation done by the torch reference in the low precision, plus twice the rounding noise
of that precision at the reference's magnitude. Inputs and output gradients are fresh random normals.
"""

import pytest
import torch

from xattn.torch import fa4

from .fa4_reference import causal_mask, document_causal_mask, sdpa_reference

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
DTYPES = [torch.bfloat16, torch.float16]
DIMS = [(128, 128), (192, 128), (256, 256)]


def _inputs(b, hq, hkv, nq, nk, d, dv, dtype, seed):
    """Fresh random SDPA-layout q ``[b, hq, nq, d]``, k ``[b, hkv, nk, d]``, v ``[b, hkv, nk, dv]`` needing grad."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def mk(*shape):
        return torch.randn(*shape, device=DEVICE, dtype=dtype, generator=g).requires_grad_()
    return mk(b, hq, nq, d), mk(b, hkv, nk, d), mk(b, hkv, nk, dv)


def _reference(q, k, v, mask, scale, dout, dtype, keep):
    xs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out = sdpa_reference(*xs, mask, scale, dtype=dtype, keep_queries=keep)
    return (out, *torch.autograd.grad(out, xs, dout.to(dtype)))


def _check(run, q, k, v, mask, scale, keep=None):
    """``run(q, k, v)`` (SDPA layout) against the masked reference: out, dq, dk, dv within FlashAttention's budget."""
    out = run(q, k, v)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and out.dtype == q.dtype
    dout = torch.randn_like(out)
    no_bwd = q.shape[-1] != v.shape[-1] and q.shape[1] != k.shape[1]  # FA4 sm90: no 192/128 GQA backward
    if no_bwd:
        with pytest.raises(NotImplementedError, match="head_dim == head_dim_v under GQA"):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    got = (out,) if no_bwd else (out, *torch.autograd.grad(out, (q, k, v), dout))
    truth = _reference(q, k, v, mask, scale, dout, torch.float64, keep)
    low = _reference(q, k, v, mask, scale, dout, q.dtype, keep)
    for name, a, t, lp in zip(("out", "dq", "dk", "dv"), got, truth, low):
        assert torch.isfinite(a).all(), name
        t_low = t.to(q.dtype)
        atol = 2 * (t_low + 0.3 - 0.3 - t_low).abs().max().item()
        err, budget = (a.double() - t).abs().max().item(), (lp.double() - t).abs().max().item()
        assert err <= 2 * budget + atol, f"{name}: error {err:.3g} > 2 x {budget:.3g} ({q.dtype} torch) + {atol:.3g}"
    if keep is not None:
        assert torch.all(out[(~keep)[:, None].expand(out.shape[:3])] == 0), "padding queries must be zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, dv", DIMS)
@pytest.mark.parametrize("hq, hkv", [(8, 2), (6, 6)])
def test_causal_fa4_attention(dtype, d, dv, hq, hkv):
    q, k, v = _inputs(2, hq, hkv, 173, 173, d, dv, dtype, seed=d + hq)
    scale = 0.9 / d ** 0.5
    _check(lambda q, k, v: fa4.causal_fa4_attention(q, k, v, scale), q, k, v,
           causal_mask(2, 173, device=DEVICE), scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq, nk", [(97, 173), (173, 97)])
def test_causal_fa4_attention_unequal_lengths(dtype, nq, nk):
    """Nq != Nk as NeMo passes it to FA4: causal aligned bottom-right (queries that see no key give 0)."""
    q, k, v = _inputs(2, 4, 2, nq, nk, 128, 128, dtype, seed=nq)
    i, j = torch.arange(nq, device=DEVICE)[:, None], torch.arange(nk, device=DEVICE)[None, :]
    _check(lambda q, k, v: fa4.causal_fa4_attention(q, k, v, scale=0.08), q, k, v,
           (j <= i + nk - nq).expand(2, nq, nk), 0.08)


# row 0: left padding, documents 1-3, trailing padding; row 1: documents 4-6 (6 crosses shards), padding
KV_IDS = [[0] * 16 + [1] * 70 + [2] * 90 + [3] * 50 + [0] * 30, [4] * 100 + [5] * 3 + [6] * 133 + [0] * 20]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d, dv", DIMS)
@pytest.mark.parametrize("start, nq", [(0, 256), (96, 64), (160, 96)])
def test_document_causal_fa4_attention(dtype, d, dv, start, nq):
    kv_ids = torch.tensor(KV_IDS, device=DEVICE)
    q_ids = kv_ids[:, start:start + nq]
    q, k, v = _inputs(2, 8, 2, nq, 256, d, dv, dtype, seed=start + d)
    scale = 1.1 / d ** 0.5
    _check(lambda q, k, v: fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, scale), q, k, v,
           document_causal_mask(q_ids, kv_ids, start), scale, keep=q_ids != 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_fa4_dense_entry_point(dtype):
    """flash_attn.cute's ``flash_attn_func`` convention ([B, N, H, D] in and out), causal bottom-right, Nq < Nk."""
    dense, _ = fa4._load_fa4()
    q, k, v = _inputs(2, 8, 2, 150, 211, 192, 128, dtype, seed=5)
    mask = torch.arange(211, device=DEVICE)[None, :] <= torch.arange(150, device=DEVICE)[:, None] + 61

    def run(q, k, v):
        out, lse = dense(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=0.07, causal=True)
        assert lse.shape == (2, 8, 150)  # kept because q/k/v require grad, as flash_attn.cute does
        return out.transpose(1, 2)
    _check(run, q, k, v, mask.expand(2, 150, 211), 0.07)


@pytest.mark.parametrize("dtype", DTYPES)
def test_load_fa4_varlen_entry_point(dtype):
    """``flash_attn_varlen_func`` on [T, H, D] views: one packed row of three documents, causal per document."""
    _, varlen = fa4._load_fa4()
    ids = torch.tensor([[1] * 60 + [2] * 7 + [3] * 130], device=DEVICE)
    cu = torch.tensor([0, 60, 67, 197], dtype=torch.int32, device=DEVICE)
    q, k, v = _inputs(1, 8, 2, 197, 197, 128, 128, dtype, seed=6)

    def run(q, k, v):
        out, _ = varlen(*(t.transpose(1, 2)[0] for t in (q, k, v)), cu_seqlens_q=cu, cu_seqlens_k=cu,
                        max_seqlen_q=130, max_seqlen_k=130, softmax_scale=0.08, causal=True)
        return out[None].transpose(1, 2)
    _check(run, q, k, v, document_causal_mask(ids, ids, 0), 0.08)
