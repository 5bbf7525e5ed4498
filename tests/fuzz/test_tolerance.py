"""The fuzz verdict on the CPU: the low-precision twin is the shared reference's math, and ``compare``
passes rounding-level errors while failing NaN, wrong -inf rows and errors beyond K x the twin's."""

import math

import pytest
import torch

from tests.reference import attention, varlen_attention

from .tolerance import K, compare, eps, lowprec_attention, lowprec_varlen_attention, max_err


def _qkv(shape_q, shape_k, dv, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape_q, generator=g).to(dtype), torch.randn(shape_k, generator=g).to(dtype),
            torch.randn((*shape_k[:-1], dv), generator=g).to(dtype))


def _grads(fn, q, k, v, dout, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, **kw)
    return (out, lse, *torch.autograd.grad(out, leaves, dout))


MASKS = [dict(causal=False), dict(causal=True), dict(window=(3, 0)), dict(window=(5, 2)), dict(window=(None, 4))]


@pytest.mark.parametrize("mask", MASKS, ids=["full", "causal", "w3_0", "w5_2", "wNone_4"])
@pytest.mark.parametrize("nq, nk", [(9, 9), (13, 6), (5, 11)])
def test_lowprec_twin_in_fp64_is_the_reference(mask, nq, nk):
    """In fp64 the twin IS tests/reference.py (outputs, lse incl. -inf rows, gradients), GQA 2."""
    q, k, v = _qkv((2, nq, 4, 16), (2, nk, 2, 16), 8)
    dout = torch.randn(2, nq, 4, 8, dtype=torch.float64)
    got = _grads(lowprec_attention, q, k, v, dout, scale=0.3, **mask)
    ref = _grads(attention, q, k, v, dout, scale=0.3, **mask)
    for a, b in zip(got, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        assert max_err(a, b) < 1e-12


def test_lowprec_varlen_twin_in_fp64_is_the_reference():
    lens_q, lens_k = [3, 0, 5, 1, 4], [2, 6, 5, 0, 7]
    cu = [torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32) for ls in (lens_q, lens_k)]
    q, k, v = _qkv((sum(lens_q), 4, 16), (sum(lens_k), 2, 16), 16, seed=1)
    dout = torch.randn(sum(lens_q), 4, 16, dtype=torch.float64)
    got = _grads(lowprec_varlen_attention, q, k, v, dout, cu_q=cu[0], cu_k=cu[1], scale=0.25, causal=True)
    ref = _grads(varlen_attention, q, k, v, dout, cu_q=cu[0], cu_k=cu[1], scale=0.25, causal=True)
    for a, b in zip(got, ref):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b))
        assert max_err(a, b) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_lowprec_twin_rounds_like_its_dtype(dtype):
    """In bf16/fp16 the twin's error vs fp64 is a few units of its dtype: the scale K multiplies."""
    q, k, v = _qkv((1, 40, 2, 64), (1, 50, 2, 64), 64, dtype=dtype, seed=2)
    lp, _ = lowprec_attention(q, k, v, scale=0.125, causal=True)
    ref, _ = attention(q, k, v, scale=0.125, causal=True)
    err = max_err(lp, ref)
    assert eps(dtype) / 16 < err < 8 * eps(dtype)


def test_compare_scales_the_twin_error_and_adds_one_ulp_floor():
    ref = torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64)
    lp = ref + torch.tensor([[0.01, 0.0], [0.0, 0.0]], dtype=torch.float64)
    tol = K["out"] * 0.01 + eps(torch.bfloat16) * 3.0
    ok = compare("out", (ref + 0.9 * tol).float(), ref, lp, torch.bfloat16)
    assert ok.ok and ok.tol == pytest.approx(tol) and ok.ratio < 1
    bad = compare("out", (ref + torch.tensor([[0.0, 0.0], [0.0, 1.2 * tol]], dtype=torch.float64)).float(),
                  ref, lp, torch.bfloat16)
    assert not bad.ok and bad.ratio > 1 and not bad.problems
    assert K["dq"] == K["dk"] == K["dv"] == 3 and K["out"] == K["lse"] == 2
    zero = compare("dq", torch.full((3,), 1e-4), torch.zeros(3, dtype=torch.float64), torch.zeros(3), torch.float16)
    assert zero.ok  # an exact twin does not demand bit-exactness: the floor is one ulp at 1.0


def test_compare_fails_nan_and_rows_without_keys():
    ref = torch.tensor([[0.5, -math.inf], [1.5, 2.0]], dtype=torch.float64)
    good = torch.tensor([[0.5, -math.inf], [1.5, 2.0]])
    assert compare("lse", good, ref, ref, torch.bfloat16).ok
    for bad, words in ((torch.tensor([[0.5, 0.0], [1.5, 2.0]]), "-inf"),
                       (torch.tensor([[0.5, -math.inf], [math.nan, 2.0]]), "NaN"),
                       (torch.tensor([[0.5, -math.inf], [math.inf, 2.0]]), "non-finite")):
        check = compare("lse", bad, ref, ref, torch.bfloat16)
        assert not check.ok and any(words in p for p in check.problems), check
    assert not compare("out", torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.float64),
                       torch.zeros(2, 2), torch.bfloat16).ok
