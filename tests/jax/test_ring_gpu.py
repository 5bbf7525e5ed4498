"""xattn.jax.ring_attention on 2 GPUs with the real kernels: out and dq/dk/dv of the sharded (dual-chunk)
problem vs the fp32 reference of the unsharded problem and vs the 1-GPU kernel; d512 GQA 8 (FFPA) and d128
(FA4), causal and not, N_local = 2000 (no multiple of a tile), sliding windows through the halo (FA4 d256
(63, 0), d128 spanning two chunks, d128 two-sided)."""

import functools
import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import xattn.jax as xj  # noqa: E402
from xattn.core.spec import canonical_mask  # noqa: E402

N = 2 * 2 * 1000  # 2 devices, chunks of L = 1000, N_local = 2000


@pytest.fixture(scope="module")
def mesh():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if len(gpus) < 2:
        pytest.skip(f"ring attention needs 2 GPUs, found {len(gpus)}")
    if os.environ.get("XATTN_JAX_MULTI_GPU_BWD") != "1":
        # Measured on 2xH200 (benchmarks/results/logs/ring_h200x2.log): any xattn.jax backward on 2 GPUs of one
        # process hangs, even batch-sharded without collectives (the forward and the ring forward run). Until
        # that is fixed this test would hang the GPU suite; set XATTN_JAX_MULTI_GPU_BWD=1 to run it.
        pytest.skip("known hang: xattn.jax backward on 2 GPUs in one process (issue #13/#12 item 4)")
    return Mesh(np.array(gpus[:2]), ("cp",))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _out_and_grads(f, q, k, v, ct):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(ct.astype(out.dtype)))


@pytest.mark.parametrize("d, hq, hkv, b, causal, window", [
    pytest.param(512, 32, 4, 1, True, (None, None), id="ffpa-d512-gqa8-causal"),
    pytest.param(512, 32, 4, 1, False, (None, None), id="ffpa-d512-gqa8-full"),
    pytest.param(128, 8, 2, 2, True, (None, None), id="fa4-d128-gqa4-causal"),
    pytest.param(128, 8, 2, 2, False, (None, None), id="fa4-d128-gqa4-full"),
    pytest.param(256, 8, 4, 1, False, (63, 0), id="fa4-d256-window(63,0)"),
    pytest.param(128, 8, 2, 1, True, (1500, None), id="fa4-d128-causal-window1500>L"),
    pytest.param(128, 8, 2, 1, False, (100, 37), id="fa4-d128-window(100,37)"),
])
def test_ring_vs_reference_and_one_gpu(mesh, d, hq, hkv, b, causal, window):
    ks = jax.random.split(jax.random.PRNGKey(d + hq + (window[0] or 0)), 4)
    q = jax.random.normal(ks[0], (b, N, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, N, hkv, d), jnp.bfloat16) for key in ks[1:3])
    ct = jax.random.normal(ks[3], q.shape, jnp.bfloat16)
    scale = d ** -0.5

    spec = P(None, "cp")
    body = functools.partial(xj.ring_attention, axis_name="cp", causal=causal, window_size=window, scale=scale,
                             backend="kernel")
    ring = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    put = lambda a: jax.device_put(xj.shard_sequence(np.asarray(a), 2), NamedSharding(mesh, spec))  # noqa: E731
    got = jax.jit(functools.partial(_out_and_grads, ring))(put(q), put(k), put(v), put(ct))
    got = [xj.unshard_sequence(np.asarray(x.astype(jnp.float32)), 2) for x in got]
    assert all(np.isfinite(x).all() for x in got)

    c, left, right = canonical_mask(causal, *window)
    one = mesh.devices.flat[0]
    on_one = [jax.device_put(x, one) for x in (q, k, v, ct)]
    if d == 512:
        single = functools.partial(xj.ffpa_attention, scale=scale, causal=c, backend="kernel")
    else:
        single = functools.partial(xj.flash_attention, scale=scale, causal=c, window_size=(left, right),
                                   backend="kernel")
    one_gpu = jax.jit(functools.partial(_out_and_grads, single))(*on_one)
    ref = lambda q, k, v: xj.attention_reference(q, k, v, scale=scale, causal=c, window=(left, right))[0]  # noqa: E731
    with jax.default_matmul_precision("float32"):
        expect = jax.jit(functools.partial(_out_and_grads, ref))(*(x.astype(jnp.float32) for x in on_one))
    for name, a, single_a, e in zip(("out", "dq", "dk", "dv"), got, one_gpu, expect):
        assert _rel(a, e) < 1e-2, (name, _rel(a, e))
        assert _rel(a, np.asarray(single_a.astype(jnp.float32))) < 1e-2, (name, "vs 1 GPU")
