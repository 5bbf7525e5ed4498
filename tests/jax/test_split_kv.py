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

pytestmark = pytest.mark.usefixtures("launcher_calls")


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


@pytest.mark.parametrize("seed", range(20))
def test_jnp_cu_seqlens_equal_the_core_plan(seed):
    """The traced-lengths bounds (jnp) give the core's documents."""
    import random

    from xattn.core import split_kv as core
    from xattn.jax.split_kv import device_cu_seqlens_k
    r = random.Random(seed)
    b, nq, nk = r.randint(1, 4), r.randint(1, 16), r.randint(1, 5000)
    causal, splits = r.random() < 0.5, r.randint(2, 60)
    lengths = [r.randint(0, nk) for _ in range(b)]
    plan = core.plan_splits(splits, causal, nq, None)
    _, cu_k, _, tail_k = core.split_cu_seqlens(plan, nq, nk, lengths, b * nk)
    got, got_tail = device_cu_seqlens_k(plan, nq, nk, b * nk, jnp.asarray(lengths))
    assert got.tolist() == cu_k and (got_tail.tolist() if plan.tail else []) == tail_k


@pytest.mark.parametrize("jit", [False, True])
def test_dot_product_attention_with_key_value_seq_lengths_splits(jit):
    """jax.nn's decoding spelling (one query, the cache, key_value_seq_lengths) on the split route, forced, with
    gradients through the varlen backward; rows with no key give out 0 (xattn's rule)."""
    from xattn.jax import dot_product_attention

    q, k, v = _inputs(3, 1, 8, 2, 600, 512, seed=9)
    lengths = jnp.asarray([0, 1, 517], jnp.int32)

    def run(backend):
        def loss(q, k, v):
            out = dot_product_attention(q, k, v, key_value_seq_lengths=lengths, backend=backend)
            return jnp.sum(out.astype(jnp.float32) ** 2), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)

    with routes.forced_forward("split-kv"):
        fn = run("kernel")
        (_, out), grads = jax.block_until_ready((jax.jit(fn) if jit else fn)(q, k, v))
    assert any(c.startswith("fwd:(") and c.split(",")[0] != "fwd:(3" for c in numpy_launcher.CALLS)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    (_, want), want_grads = run("reference")(f32(q), f32(k), f32(v))
    assert float(jnp.max(jnp.abs(f32(out) - want))) < 2e-2 and float(jnp.max(jnp.abs(f32(out[0])))) == 0.0
    for g, w in zip(grads, want_grads):
        assert float(jnp.max(jnp.abs(f32(g) - w))) < 2e-2 * max(1.0, float(jnp.max(jnp.abs(w))))
