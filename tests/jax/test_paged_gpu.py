"""xattn.jax.paged_attention on the H200 with the real kernels (issue #44): against fp64 of the same bf16 inputs
and against Pallas' own GPU paged_attention (the peer) on the same call; FA4 (TMA at its key tile, cp.async
otherwise) and FFPA, shuffled block tables, partly filled last pages, traced lengths under jit."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import xattn.jax as xj

from .test_paged import _case, _reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("num_splits", [0, 1])
@pytest.mark.parametrize("d, hq, hkv, ps, max_pages, lengths", [
    pytest.param(512, 32, 4, 64, 150, [9000, 1, 4097], id="ffpa-d512-g8-ps64"),
    pytest.param(512, 32, 4, 256, 40, [10000, 300], id="ffpa-d512-g8-ps256"),
    pytest.param(128, 32, 8, 16, 700, [11000, 17], id="fa4-d128-g4-ps16"),
    pytest.param(128, 32, 8, 128, 90, [11000, 129, 0], id="fa4-d128-g4-ps128-tma"),
    pytest.param(128, 32, 8, 64, 180, [11000, 65, 1], id="fa4-d128-g4-ps64-decode-tile"),
])
def test_paged_attention_vs_fp64_and_pallas(num_splits, d, hq, hkv, ps, max_pages, lengths):
    q, k_pages, v_pages, table, n = _case(d + ps, len(lengths), hq, hkv, d, ps, max_pages, lengths)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k_pages, v_pages)]
    ours = jax.jit(lambda q, kp, vp, t, n: xj.paged_attention(q, kp, vp, t, n, num_splits=num_splits))(
        *args, jnp.asarray(table), jnp.asarray(n))
    want = _reference(*(np.asarray(a, np.float32) for a in args), table, n)
    scale = max(1.0, np.abs(want).max())
    assert np.abs(np.asarray(ours, np.float64) - want).max() < 2e-2 * scale
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    from benchmarks.paged_jax import pallas_tiling

    tiling = pallas_tiling(d, ps, table.shape[1])  # the peer's defaults where they run (k_splits | table width)
    if min(lengths) > 0 and ps >= 16 and tiling:  # the peer's own limits (no empty sequence, shared memory)
        peer = paged_attention(*args, jnp.asarray(table), jnp.asarray(n), **tiling)
        assert np.abs(np.asarray(ours, np.float64) - np.asarray(peer, np.float64)).max() < 3e-2 * scale
