"""xattn.jax.attention_with_kvcache on the NumPy stand-in launchers: the functional append (and under jit with
donated caches), per-sequence traced lengths (0 included), both routes forced, the causal tail, an FA4 window;
against the jnp reference of the same call and an explicit per-sequence fp32 computation."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from tests.jax import numpy_launcher  # noqa: E402
from xattn.core import routes  # noqa: E402
from xattn.jax import attention_with_kvcache, flash_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("launcher_calls")


def _case(b, nq, hq, hkv, nc, nn, d, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    return mk(b, nq, hq, d), mk(b, nc, hkv, d), mk(b, nc, hkv, d), mk(b, nn, hkv, d), mk(b, nn, hkv, d)


def _per_sequence(q, k_cache, v_cache, lengths, causal, window):
    """Sequence by sequence on its valid rows (bottom-right: flash_attention's own reference)."""
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    outs = [flash_attention(f32(q[i:i + 1]), f32(k_cache[i:i + 1, :n]), f32(v_cache[i:i + 1, :n]), causal=causal,
                            window_size=window, backend="reference") if n else jnp.zeros_like(f32(q[i:i + 1]))
            for i, n in enumerate(lengths)]
    return jnp.concatenate(outs)


@pytest.mark.parametrize("route", ["split-kv", "fused"])
@pytest.mark.parametrize("b, nq, hq, hkv, nc, nn, seqlens, causal, window, d", [
    pytest.param(3, 1, 8, 2, 400, 1, [0, 200, 398], True, (None, None), 512, id="d512-decode"),
    pytest.param(2, 4, 4, 2, 300, 4, [10, 250], True, (None, None), 512, id="d512-speculative-tail"),
    pytest.param(2, 2, 4, 2, 300, 0, [0, 120], False, (None, None), 128, id="d128-no-append"),
    pytest.param(2, 1, 4, 2, 300, 1, [100, 250], False, (16, 0), 128, id="d128-window"),
])
def test_matches_per_sequence_reference(route, b, nq, hq, hkv, nc, nn, seqlens, causal, window, d):
    if window != (None, None) and route == "split-kv":
        pytest.skip("a window is served by the fused route only")
    q, kc, vc, kn, vn = _case(b, nq, hq, hkv, nc, nn, d, seed=nc + nq + nn)
    seq = jnp.asarray(seqlens, jnp.int32)
    with routes.forced_forward(route):
        out, lse, k2, v2 = attention_with_kvcache(q, kc, vc, kn if nn else None, vn if nn else None,
                                                  cache_seqlens=seq, causal=causal, window_size=window,
                                                  return_softmax_lse=True, backend="kernel")
        jax.block_until_ready(out)
    for i, n in enumerate(seqlens):
        if nn:
            assert jnp.array_equal(k2[i, n:n + nn], kn[i]) and jnp.array_equal(v2[i, n:n + nn], vn[i])
        assert jnp.array_equal(k2[i, :n], kc[i, :n]) and jnp.array_equal(k2[i, n + nn:], kc[i, n + nn:])
    lengths = [n + nn for n in seqlens]
    want = _per_sequence(q, k2, v2, lengths, causal, window)
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) < 2e-2
    ref_out, ref_lse, _, _ = attention_with_kvcache(q, kc, vc, kn if nn else None, vn if nn else None,
                                                    cache_seqlens=seq, causal=causal, window_size=window,
                                                    return_softmax_lse=True, backend="reference")
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32)))) < 2e-2
    finite = jnp.isfinite(ref_lse)
    assert jnp.array_equal(finite, jnp.isfinite(lse))
    assert float(jnp.max(jnp.abs(jnp.where(finite, lse - ref_lse, 0.0)))) < 1e-2
    split_ran = any(c.split(",")[0] != f"fwd:({b * nq}" or c.endswith(":shared-q")
                    for c in numpy_launcher.CALLS if c.startswith("fwd:"))
    assert split_ran == (route == "split-kv"), numpy_launcher.CALLS


def test_a_jitted_decode_loop_with_donated_caches():
    q, kc, vc, kn, vn = _case(2, 1, 8, 2, 64, 1, 512, seed=3)
    step = jax.jit(lambda q, k_cache, v_cache, kn, vn, seq: attention_with_kvcache(
        q, k_cache, v_cache, kn, vn, cache_seqlens=seq, causal=True, backend="kernel"),
        donate_argnames=("k_cache", "v_cache"))
    seq = jnp.asarray([5, 20], jnp.int32)
    keys = jnp.array(kc, copy=True)  # kc itself is donated
    for t in range(3):
        kn_t = kn + t
        out, kc, vc = step(q, kc, vc, kn_t, vn, seq)
        keys = keys.at[jnp.arange(2), seq].set(kn_t[:, 0])
        assert jnp.array_equal(kc, keys)
        want = _per_sequence(q, kc, vc, (seq + 1).tolist(), True, (None, None))
        assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - want))) < 2e-2
        seq = seq + 1
