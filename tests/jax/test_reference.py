"""The pure-jnp reference (CPU): agrees with jax.nn.dot_product_attention where conventions meet,
its supplied-out/lse backward equals autodiff, and the custom_vjp plumbing on top of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax.reference import attention_reference, attention_reference_bwd, varlen_visible

jax.config.update("jax_enable_x64", False)


def _qkv(key, b=2, nq=24, nk=24, hq=4, hkv=2, d=16, dv=None, dtype=jnp.float32):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(key), 3)
    return (jax.random.normal(k1, (b, nq, hq, d), dtype), jax.random.normal(k2, (b, nk, hkv, d), dtype),
            jax.random.normal(k3, (b, nk, hkv, dv or d), dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_jax_nn_square(causal):
    q, k, v = _qkv(0)
    out, lse = attention_reference(q, k, v, scale=0.25, causal=causal)
    ref = jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=causal, implementation="xla")
    np.testing.assert_allclose(out, ref, atol=2e-5)
    g = lambda f: jax.grad(lambda q, k, v: (f(q, k, v) ** 2).sum(), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
    ours = g(lambda q, k, v: xj.ffpa_attention(q, k, v, scale=0.25, causal=causal, backend="reference"))
    theirs = g(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=causal))
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=1e-4)


def test_bottom_right_differs_from_top_left_when_nq_lt_nk():
    q, k, v = _qkv(1, nq=8, nk=20)
    br, _ = attention_reference(q, k, v, scale=0.25, causal=True)
    tl = jax.nn.dot_product_attention(q, k, v, scale=0.25, is_causal=True)
    # bottom-right: the last query sees every key == non-causal for that row
    full = jax.nn.dot_product_attention(q, k, v, scale=0.25)
    np.testing.assert_allclose(br[:, -1], full[:, -1], atol=2e-5)
    assert not np.allclose(br, tl, atol=1e-3)


def test_rows_without_keys():
    q, k, v = _qkv(2, nq=10, nk=4)
    out, lse = attention_reference(q, k, v, scale=0.3, causal=True)
    assert (out[:, :6] == 0).all() and jnp.isneginf(lse[:, :, :6]).all()
    g = jax.grad(lambda q: xj.ffpa_attention(q, k, v, scale=0.3, causal=True, backend="reference").sum())(q)
    assert jnp.isfinite(g).all() and (g[:, :6] == 0).all()


@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (3, 0))])
def test_supplied_out_lse_backward_equals_autodiff(causal, window):
    q, k, v = _qkv(3, nq=12, nk=17, dv=8)
    dout = jax.random.normal(jax.random.PRNGKey(9), (2, 12, 4, 8))
    out, lse = attention_reference(q, k, v, scale=0.2, causal=causal, window=window)
    ours = attention_reference_bwd(dout, q, k, v, out, lse, scale=0.2, causal=causal, window=window)
    _, vjp = jax.vjp(lambda q, k, v: attention_reference(q, k, v, scale=0.2, causal=causal, window=window)[0], q, k, v)
    for a, b in zip(ours, vjp(dout)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)


def test_varlen_mask_is_per_segment_bottom_right():
    cu_q, cu_k = jnp.array([0, 2, 2, 5]), jnp.array([0, 3, 4, 6])
    m = np.asarray(varlen_visible(cu_q, cu_k, 6, 7, causal=True))
    assert m[0].tolist() == [1, 1, 0, 0, 0, 0, 0] and m[1].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert m[2].tolist() == [0] * 7  # segment 3 has 3 queries, 2 keys: first query sees none
    assert m[3].tolist() == [0, 0, 0, 0, 1, 0, 0] and m[4].tolist() == [0, 0, 0, 0, 1, 1, 0]
    assert not m[5].any()  # past cu_q[-1]


def test_backend_validation():
    q, k, v = _qkv(4)
    with pytest.raises(ValueError, match="backend"):
        xj.ffpa_attention(q, k, v, backend="cudnn")
    with pytest.raises(ValueError, match=r"rank 4"):
        xj.ffpa_attention(q[0], k, v)
    with pytest.raises(TypeError, match="causal"):
        xj.ffpa_attention(q, k, v, causal=1)


def test_jax_pairing_check_is_actionable():
    from xattn.jax._ffi import check_pairing

    check_pairing("0.10.2", "0.1.3")
    check_pairing("0.8.0", "0.1.2")
    with pytest.raises(ImportError, match=r"jax >= 0.9.1.*jax-tvm-ffi==0.1.2"):
        check_pairing("0.8.0", "0.1.3")
