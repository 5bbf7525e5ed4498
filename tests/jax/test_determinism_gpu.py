"""Determinism of xattn.jax on the GPU with the real kernels: every forward gives the same bits over 5 runs;
the FFPA backward too, with ``XATTN_DETERMINISTIC=1``; there the FA4 backward is refused at trace time
(``=warn``: warns and runs)."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import xattn.jax as xj  # noqa: E402

RUNS = 5
LENGTHS = [700, 0, 1, 531]  # varlen documents: an empty and a one-token one
from tests.determinism_cases import ALERT, FA4, FFPA  # noqa: E402


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv("XATTN_DETERMINISTIC", raising=False)


def _loss(d, g, causal, window, varlen):
    """``(loss(q, k, v), (q, k, v))`` for one config; lengths are no multiple of any tile."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    hkv = 2
    if varlen:
        t = sum(LENGTHS)
        shape_q, shape_k = (t, g * hkv, d), (t, hkv, d)
        cu = jnp.array(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)

        def attn(q, k, v):
            return xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=max(LENGTHS), max_seqlen_k=max(LENGTHS),
                                       family="fa4", scale=d ** -0.5, causal=causal, backend="kernel")
    else:
        shape_q, shape_k = (2, 777, g * hkv, d), (2, 901, hkv, d)
        fn = xj.ffpa_attention if d > 256 else xj.flash_attention
        kw = {} if d > 256 else dict(window_size=window)

        def attn(q, k, v):
            return fn(q, k, v, causal=causal, backend="kernel", **kw)
    q = jax.random.normal(k1, shape_q, jnp.bfloat16)
    k, v = (jax.random.normal(r, shape_k, jnp.bfloat16) for r in (k2, k3))
    return attn, (lambda q, k, v: (attn(q, k, v).astype(jnp.float32) ** 2).sum()), (q, k, v)


def _same_bits(a, b):
    return np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize("d, g, causal, window, varlen", FFPA + FA4)
def test_forward_is_bitwise_reproducible(d, g, causal, window, varlen, monkeypatch):
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")  # never refuses a forward
    attn, _, args = _loss(d, g, causal, window, varlen)
    f = jax.jit(attn)
    first = f(*args)
    for _ in range(RUNS - 1):
        assert _same_bits(f(*args), first)


@pytest.mark.parametrize("d, g, causal, window, varlen", FFPA)
def test_ffpa_backward_is_bitwise_reproducible_in_deterministic_mode(d, g, causal, window, varlen, monkeypatch):
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")
    _, loss, args = _loss(d, g, causal, window, varlen)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    first = grad(*args)
    for _ in range(RUNS - 1):
        for name, a, b in zip(("dq", "dk", "dv"), grad(*args), first):
            assert _same_bits(a, b), name


@pytest.mark.parametrize("d, g, causal, window, varlen", FA4)
def test_fa4_backward_is_refused_in_deterministic_mode(d, g, causal, window, varlen, monkeypatch):
    _, loss, args = _loss(d, g, causal, window, varlen)
    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")
    with pytest.raises(RuntimeError, match=ALERT):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    monkeypatch.setenv("XATTN_DETERMINISTIC", "warn")
    with pytest.warns(UserWarning, match=ALERT):
        warned = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    for a, b in zip(warned, plain):  # the same computation, up to the order of the fp32 adds
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=2e-2, rtol=2e-2)
