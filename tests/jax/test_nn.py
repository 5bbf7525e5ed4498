"""xattn.jax.dot_product_attention: jax.nn / Flax calling convention and its refusals (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi

from . import numpy_launcher


def _qkv(shape_q, shape_k, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k1, shape_q, dtype), jax.random.normal(k2, shape_k, dtype),
            jax.random.normal(k3, shape_k, dtype))


def test_reference_matches_jax_nn_with_leading_dims_and_mask():
    q, k, v = _qkv((2, 3, 10, 4, 32), (2, 3, 10, 2, 32))
    out = xj.dot_product_attention(q, k, v, is_causal=True, backend="reference")
    ref = jax.vmap(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    mask = jax.random.bernoulli(jax.random.PRNGKey(1), 0.7, (6, 1, 10, 10)).at[..., 0].set(True)
    q6, k6, v6 = (x.reshape(6, *x.shape[2:]) for x in (q, k, v))
    out = xj.dot_product_attention(q6, k6, v6, mask=mask, backend="reference")
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q6, k6, v6, mask=mask), atol=2e-5)


def test_kernel_routing_and_refusals():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    try:
        q, k, v = _qkv((2, 8, 4, 384), (2, 8, 4, 384), jnp.float16)
        out = xj.dot_product_attention(q, k, v, is_causal=True, backend="kernel", deterministic=True)
        ref = xj.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True, backend="reference")
        np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3)
        assert any(c.startswith("fwd") for c in numpy_launcher.CALLS)
        with pytest.raises(ValueError, match="is_causal=True"):
            xj.dot_product_attention(q, k, v, mask=jnp.ones((2, 1, 8, 8), bool), backend="kernel")
        with pytest.raises(NotImplementedError, match="dropout"):
            xj.dot_product_attention(q, k, v, dropout_rate=0.1, deterministic=False, backend="kernel")
        with pytest.raises(NotImplementedError, match="no xattn kernel"):
            xj.dot_product_attention(*_qkv((1, 8, 2, 40), (1, 8, 2, 40), jnp.float16), backend="kernel")
    finally:
        _ffi.set_launcher_provider(None)


def test_flax_nnx_attention_fn_if_flax_is_installed():
    nnx = pytest.importorskip("flax.nnx")
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False,
                                   attention_fn=lambda *a, **kw: xj.dot_product_attention(*a, backend="reference", **kw),
                                   rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 6, 32))
    y = layer(x, deterministic=True)
    assert y.shape == (2, 6, 32) and jnp.isfinite(y).all()
