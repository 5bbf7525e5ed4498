"""The split-KV forward route of xattn.jax (decoding under jit) on the NumPy stand-in launchers: forced and by
the rule, eager and jit, the causal tail, both families, gradients through it; against the fp32 reference of the
same call."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from tests.jax import numpy_launcher  # noqa: E402
from xattn.core import routes  # noqa: E402
from xattn.jax import attention as ja  # noqa: E402


@pytest.fixture(autouse=True)
def standins(gemm_standin):
    numpy_launcher.CALLS.clear()
    yield


def _inputs(b, nq, hq, hkv, nk, d, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    return mk(b, nq, hq, d), mk(b, nk, hkv, d), mk(b, nk, hkv, d)


def _fn(d):
    return ja.ffpa_attention if d > 256 else ja.flash_attention


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("b, nq, hq, hkv, nk, d, causal", [
    pytest.param(1, 1, 8, 1, 300, 512, True, id="d512-q1-g8"),
    pytest.param(2, 4, 4, 2, 300, 512, True, id="d512-q4-causal-tail"),
    pytest.param(3, 1, 8, 2, 500, 128, False, id="d128-q1-g4"),
    pytest.param(2, 3, 4, 4, 2, 128, True, id="d128-tail-longer-than-cache"),
])
def test_forced_split_matches_the_reference(jit, b, nq, hq, hkv, nk, d, causal):
    q, k, v = _inputs(b, nq, hq, hkv, nk, d, seed=nk + nq)
    with routes.forced_forward("split-kv"):
        fn = lambda q, k, v: _fn(d)(q, k, v, causal=causal, backend="kernel")  # noqa: E731
        out = jax.block_until_ready((jax.jit(fn) if jit else fn)(q, k, v))
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _fn(d)(f32(q), f32(k), f32(v), causal=causal, backend="reference")
    assert float(jnp.max(jnp.abs(f32(out) - want))) < 2e-2
    assert any(c.startswith("fwd:") and c != f"fwd:{q.shape}" for c in numpy_launcher.CALLS), numpy_launcher.CALLS


def test_the_rule_splits_a_long_cache_and_gradients_flow():
    q, k, v = _inputs(1, 1, 8, 1, 1024, 512, seed=1)
    def loss(q, k, v):
        return jnp.sum(ja.ffpa_attention(q, k, v, causal=True, backend="kernel").astype(jnp.float32))

    grads = jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))
    assert "fwd:(4, 8, 512)" in numpy_launcher.CALLS  # the rule: 1 CTA of 132 SMs, 1024 keys -> 4 splits of 256
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = lambda q, k, v: jnp.sum(ja.ffpa_attention(q, k, v, causal=True, backend="reference"))  # noqa: E731
    want = jax.grad(ref, argnums=(0, 1, 2))(f32(q), f32(k), f32(v))
    for g, w in zip(grads, want):
        assert float(jnp.max(jnp.abs(f32(g) - w))) < 2e-2 * max(1.0, float(jnp.max(jnp.abs(w))))


def test_fused_when_asked():
    q, k, v = _inputs(1, 1, 8, 1, 1024, 512, seed=2)
    with routes.forced_forward("fused"):
        jax.block_until_ready(ja.ffpa_attention(q, k, v, causal=True, backend="kernel"))
    assert numpy_launcher.CALLS == [f"fwd:{q.shape}"]
