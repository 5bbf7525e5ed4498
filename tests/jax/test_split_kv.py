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


@pytest.mark.parametrize("b, nq, hq, hkv, nk, causal, shared", [
    pytest.param(2, 1, 8, 2, 700, True, True, id="g4-shared-q"),
    pytest.param(3, 4, 8, 4, 900, True, True, id="g2-q4-tail-shared-q"),
    pytest.param(2, 2, 4, 4, 700, False, False, id="g1-q-per-slot"),
])
def test_fa4_d128_split_launch_runs_the_decode_tile(monkeypatch, b, nq, hq, hkv, nk, causal, shared):
    """The split launch of FA4 d128 goes through XLA FFI as the core's decode tile (split_kv.SPLIT_TILES); with a
    packed GQA group it reads q's own B*Nq rows (shared_q), else one copy of q per slot."""
    from xattn.jax import _ffi

    names, call = [], _ffi.call
    monkeypatch.setattr(_ffi, "call", lambda spec, *a, **kw: (names.append(spec.short_name()), call(spec, *a, **kw))[1])
    q, k, v = _inputs(b, nq, hq, hkv, nk, 128, seed=4 + nq)
    with routes.forced_forward("split-kv"):
        out = jax.jit(lambda q, k, v: ja.flash_attention(q, k, v, causal=causal, backend="kernel"))(q, k, v)
        jax.block_until_ready(out)
    assert any(n.endswith("_t64x64" + "_sq" * shared + "_sm_90a") for n in names), names
    launches = [c for c in numpy_launcher.CALLS if c.startswith("fwd:(")]
    copied = [c for c in launches if int(c.split("(")[1].split(",")[0]) != b * nq]  # B*P*Nq rows: q once per slot
    assert len(copied) == (0 if shared else 1), numpy_launcher.CALLS
    assert any(c.endswith(":shared-q") for c in launches) == shared, numpy_launcher.CALLS
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = ja.flash_attention(f32(q), f32(k), f32(v), causal=causal, backend="reference")
    assert float(jnp.max(jnp.abs(f32(out) - want))) < 2e-2


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


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, d, causal, trailing", [
    pytest.param([1, 1, 1], [700, 33, 600], 8, 1, 512, True, (0, 0), id="d512-decode-3-docs"),
    pytest.param([4, 0, 1, 3], [900, 500, 0, 2], 4, 2, 512, True, (2, 5), id="d512-empty-docs-trailing-rows"),
    pytest.param([2, 5, 1], [3, 600, 1], 4, 4, 128, True, (1, 0), id="d128-tail-longer-than-keys"),
    pytest.param([16, 7], [1000, 257], 2, 1, 128, False, (0, 3), id="d128-16-queries"),
])
def test_packed_split_matches_the_reference(jit, lens_q, lens_k, hq, hkv, d, causal, trailing):
    """varlen_attention's decode calls (at most 16 queries per document) on the split route, forced, drawn from the
    varlen contract: empty and 1-token documents, fewer keys than queries, rows past cu[-1]; out and lse."""
    from xattn.jax import varlen_fwd

    rng = np.random.default_rng(sum(lens_k))
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    q, k, v = mk(sum(lens_q) + trailing[0], hq, d), mk(sum(lens_k) + trailing[1], hkv, d), mk(sum(lens_k) +
                                                                                              trailing[1], hkv, d)
    cu = lambda lens: jnp.asarray(np.cumsum([0] + lens), jnp.int32)  # noqa: E731
    family = "ffpa" if d > 256 else "fa4"
    kw = dict(max_seqlen_q=min(max(lens_q) + 1, 16), max_seqlen_k=max(lens_k), causal=causal, family=family,
              scale=d ** -0.5)

    def fn(q, k, v, backend):
        return varlen_fwd(q, k, v, cu(lens_q), cu(lens_k), backend=backend, **kw)

    with routes.forced_forward("split-kv"):
        run = jax.jit(fn, static_argnums=3) if jit else fn
        out, lse = jax.block_until_ready(run(q, k, v, "kernel"))
    assert any(c.startswith("fwd:") and c != f"fwd:{q.shape}" for c in numpy_launcher.CALLS), numpy_launcher.CALLS
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    want_out, want_lse = fn(f32(q), f32(k), f32(v), "reference")
    assert float(jnp.max(jnp.abs(f32(out) - want_out))) < 2e-2
    finite = np.isfinite(np.asarray(want_lse))
    assert (np.isfinite(np.asarray(lse)) == finite).all()
    assert float(np.max(np.abs(np.asarray(lse)[finite] - np.asarray(want_lse)[finite]), initial=0)) < 2e-2
