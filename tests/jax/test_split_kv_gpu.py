"""xattn.jax's split-KV forward on the GPU with the real kernels (XLA FFI, under jit): against the fp32
reference and against the fused kernel of the same call, as close to the reference within one more bf16
rounding of the partials; the rule's own choice at Gemma-4-31B's global layer; gradients through it."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import xattn.jax as xj  # noqa: E402
from xattn.core import routes  # noqa: E402


def _qkv(seed, b, nq, hq, hkv, nk, d):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (b, nq, hq, d), jnp.bfloat16), jax.random.normal(k2, (b, nk, hkv, d), jnp.bfloat16),
            jax.random.normal(k3, (b, nk, hkv, d), jnp.bfloat16))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("fn, b, nq, hq, hkv, nk, d, causal", [
    pytest.param(xj.ffpa_attention, 1, 1, 32, 4, 9000, 512, True, id="d512-B1-q1"),
    pytest.param(xj.ffpa_attention, 2, 4, 32, 4, 4100, 512, True, id="d512-B2-q4-causal-tail"),
    pytest.param(xj.flash_attention, 2, 1, 32, 8, 12000, 128, True, id="d128-B2-q1"),
    pytest.param(xj.flash_attention, 3, 4, 32, 8, 5001, 128, True, id="d128-B3-q4-tail-shared-q"),
    pytest.param(xj.flash_attention, 1, 3, 32, 16, 7001, 256, False, id="d256-q3"),
])
def test_split_vs_reference_and_fused(fn, b, nq, hq, hkv, nk, d, causal):
    q, k, v = _qkv(nk, b, nq, hq, hkv, nk, d)
    kern = jax.jit(lambda q, k, v: fn(q, k, v, causal=causal, backend="kernel"))
    with routes.forced_forward("split-kv"):
        split = jax.jit(lambda q, k, v: fn(q, k, v, causal=causal, backend="kernel"))(q, k, v)
    with routes.forced_forward("fused"):
        fused = kern(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref = fn(*f32, causal=causal, backend="reference")
    assert _rel(split, ref) < 2 * _rel(fused, ref) + 2e-3


def test_rule_splits_at_the_issue_shape_and_gradients_flow():
    q, k, v = _qkv(5, 1, 1, 32, 4, 32768, 512)
    problem = routes.FwdProblem("ffpa", 1, 4, 8, 1, 32768, causal=True)
    assert routes.forward_route(problem, "auto").name == "split-kv"
    loss = lambda f: (lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum())  # noqa: E731
    kern = lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True, backend="kernel")  # noqa: E731
    ref = lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True, backend="reference")  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert _rel(jax.jit(kern)(q, k, v), ref(*f32)) < 1e-2
    for a, w in zip(jax.jit(jax.grad(loss(kern), argnums=(0, 1, 2)))(q, k, v),
                    jax.grad(loss(ref), argnums=(0, 1, 2))(*f32)):
        assert _rel(a, w) < 2e-2


def test_dot_product_attention_decoding_with_lengths():
    """jax.nn's decoding spelling on the kernels: one query, the cache, key_value_seq_lengths (traced under jit);
    the rule splits (B 2, d512 Hq32/Hkv4, 9000-key cache) and the result and gradients match the fp32 reference."""
    q, k, v = _qkv(11, 2, 1, 32, 4, 9000, 512)
    lengths = jnp.asarray([8999, 1500], jnp.int32)
    problem = routes.FwdProblem("ffpa", 2, 4, 8, 1, 9000, traced=True)
    assert routes.forward_route(problem, "auto").name == "split-kv"

    def loss(backend):
        return lambda q, k, v: (xj.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, backend=backend)
                                .astype(jnp.float32) ** 2).sum()
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    for a, w in zip(jax.jit(jax.grad(loss("kernel"), argnums=(0, 1, 2)))(q, k, v),
                    jax.grad(loss("reference"), argnums=(0, 1, 2))(*f32)):
        assert _rel(a, w) < 2e-2


@pytest.mark.parametrize("route", ["split-kv", "fused"])
def test_attention_with_kvcache_both_routes(route):
    """xattn.jax.attention_with_kvcache under jit with donated caches: the append and per-sequence lengths (0
    included) on the kernels, against the jnp reference of the same call."""
    q, kc, vc = _qkv(21, 3, 1, 32, 4, 6000, 512)
    kn, vn = (x[:, :1] for x in _qkv(22, 3, 1, 4, 4, 1, 512)[1:])
    seq = jnp.asarray([0, 2500, 5998], jnp.int32)
    ref_out, ref_k, _ = xj.attention_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=seq, causal=True,
                                                  backend="reference")
    with routes.forced_forward(route):
        step = jax.jit(lambda q, k_cache, v_cache, kn, vn, seq: xj.attention_with_kvcache(
            q, k_cache, v_cache, kn, vn, cache_seqlens=seq, causal=True, backend="kernel"),
            donate_argnames=("k_cache", "v_cache"))
        out, k2, _ = step(q, jnp.array(kc, copy=True), jnp.array(vc, copy=True), kn, vn, seq)
    assert jnp.array_equal(k2, ref_k)
    assert _rel(out, ref_out) < 1e-2


@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, d, causal", [
    pytest.param([1, 1, 1, 0], [9000, 513, 1, 7000], 32, 4, 512, True, id="d512-decode-4-docs"),
    pytest.param([4, 1, 3], [4100, 2, 6000], 32, 4, 512, True, id="d512-spec-decode"),
    pytest.param([1, 16], [12000, 3000], 32, 8, 128, True, id="d128-mixed"),
])
def test_packed_split_vs_reference_and_fused(lens_q, lens_k, hq, hkv, d, causal):
    """varlen_fwd of packed decoding on the split route (forced, under jit) against the fp32 reference and the fused
    varlen kernel, with a trailing query row and key rows past cu[-1]."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(sum(lens_k)), 3)
    tq, tk = sum(lens_q) + 1, sum(lens_k) + 5
    q = jax.random.normal(k1, (tq, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(x, (tk, hkv, d), jnp.bfloat16) for x in (k2, k3))
    cu = lambda lens: jnp.asarray(np.cumsum([0] + lens), jnp.int32)  # noqa: E731
    kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal, scale=d ** -0.5,
              family="ffpa" if d > 256 else "fa4")
    run = lambda q, k, v, backend="kernel": xj.varlen_fwd(q, k, v, cu(lens_q), cu(lens_k), backend=backend, **kw)  # noqa: E731
    with routes.forced_forward("split-kv"):
        split, split_lse = jax.jit(run)(q, k, v)
    with routes.forced_forward("fused"):
        fused, fused_lse = jax.jit(run)(q, k, v)
    ref, ref_lse = run(*(x.astype(jnp.float32) for x in (q, k, v)), backend="reference")
    assert _rel(split, ref) < 2 * _rel(fused, ref) + 2e-3
    finite = np.isfinite(np.asarray(ref_lse))
    assert (np.isfinite(np.asarray(split_lse)) == finite).all()
    assert np.abs(np.asarray(split_lse)[finite] - np.asarray(ref_lse)[finite]).max() < \
        1e-3 + np.abs(np.asarray(fused_lse)[finite] - np.asarray(ref_lse)[finite]).max()
