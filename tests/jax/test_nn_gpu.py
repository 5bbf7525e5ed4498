"""xattn.jax.dot_product_attention on the GPU with the real kernels vs jax.nn.dot_product_attention (XLA,
float32 of the same rounded inputs, full-precision matmuls): top-left causal with Nq != Nk, local windows
(FA4), sequence lengths (varlen and dense), the residual, gradients; bf16/fp16, d512 (FFPA), d128/d256 (FA4)."""

import functools
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import xattn.jax as xj  # noqa: E402

from .test_nn import _run  # noqa: E402  (the same loss and grads as the CPU tests)

# (d, dtype, T, S, jax.nn keywords, query lengths, key/value lengths)
CASES = [
    (512, "bfloat16", 200, 264, dict(is_causal=True), None, None),             # FFPA: keys sliced to Nq
    (512, "float16", 264, 200, dict(is_causal=True), None, None),              # FFPA: causal + full launch
    (512, "bfloat16", 256, 320, {}, [256, 131, 7], [320, 0, 65]),              # FFPA varlen, a kv_len 0 row
    (512, "bfloat16", 256, 256, dict(is_causal=True), [256, 100, 17], [256, 100, 17]),  # padded self-attention
    (128, "bfloat16", 264, 200, dict(is_causal=True), None, None),             # FA4: window (None, Nq - Nk)
    (128, "float16", 200, 264, dict(is_causal=True, local_window_size=(64, 16)), None, None),
    (256, "bfloat16", 264, 200, dict(local_window_size=(48, 24)), None, None),
    (128, "float16", 256, 320, dict(local_window_size=40), [256, 90, 3], [320, 130, 43]),
    (256, "bfloat16", 200, 264, {}, None, [264, 1, 150]),                      # FA4 varlen
]


def _qkv(seed, b, t, s, d, dtype, hq=8, hkv=2):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (b, t, hq, d), dtype), jax.random.normal(k2, (b, s, hkv, d), dtype),
            jax.random.normal(k3, (b, s, hkv, d), dtype))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("d, dtype, t, s, kw, q_len, kv_len", CASES)
def test_matches_jax_nn_xla_float32(d, dtype, t, s, kw, q_len, kv_len):
    b = 3 if q_len or kv_len else 2
    q, k, v = _qkv(d + t, b, t, s, d, jnp.dtype(dtype))
    lens = {n: jnp.array(x, jnp.int32) for n, x in (("query_seq_lengths", q_len), ("key_value_seq_lengths", kv_len))
            if x is not None}
    (out, res), grads = _run(functools.partial(xj.dot_product_attention, backend="kernel", **kw), q, k, v, lens)
    with jax.default_matmul_precision("float32"):
        theirs_fn = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kw)
        (their_out, their_res), their_grads = _run(theirs_fn, *(x.astype(jnp.float32) for x in (q, k, v)), lens)
    assert res.shape == (b, t, 8) and res.dtype == q.dtype
    seen = np.asarray(their_res) > -1e30
    out, res = np.asarray(out.astype(jnp.float32)), np.asarray(res.astype(jnp.float32))
    assert _rel(out[seen], np.asarray(their_out)[seen]) < 1e-2
    assert _rel(res[seen], np.asarray(their_res)[seen]) < 1e-2
    assert (out[~seen] == 0).all() and (res[~seen] == -np.inf).all()
    for name, a, r in zip("qkv", grads, their_grads):
        assert _rel(a, r) < 1e-2, name


def test_ffpa_window_falls_back_exactly_strict_refuses_and_vmap_runs():
    q, k, v = _qkv(1, 2, 128, 128, 512, jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="FFPA has none"):
        xj.dot_product_attention(q, k, v, local_window_size=(32, 0), backend="kernel", strict=True)
    xj.nn._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="sliding window at head_dim 512"):
        got = xj.dot_product_attention(q, k, v, local_window_size=(32, 0), backend="kernel")
    want = jax.nn.dot_product_attention(q, k, v, local_window_size=(32, 0), implementation="xla")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    f = lambda q, k, v: xj.dot_product_attention(q, k, v, is_causal=True, backend="kernel")  # noqa: E731
    mapped = jax.jit(jax.vmap(f))(q[None], k[None], v[None])[0]
    assert _rel(mapped.astype(jnp.float32), f(q, k, v).astype(jnp.float32)) < 1e-6
