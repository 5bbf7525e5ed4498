"""#12 item 4, JAX: arrays committed to the second GPU run there and give the first GPU's results;
a batch-sharded shard_map over both GPUs gives the one-GPU results; mixing committed devices in one
call is a clear error. "Results": the forward's bits, and the FFPA backward's bits (deterministic);
the FA4 backward reduce-adds fp32 partials in any order (xattn.core.determinism), so its gradients
are judged against an fp32 reference instead (within 1.25x + 1e-4 of the one-GPU run's error)."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import xattn.jax as xj  # noqa: E402

CONFIGS = [pytest.param(xj.ffpa_attention, 512, 4, id="ffpa-d512-gqa4-causal"),
           pytest.param(xj.flash_attention, 128, 4, id="fa4-d128-gqa4-causal")]


@pytest.fixture(scope="module")
def gpus():
    try:
        found = jax.devices("gpu")
    except RuntimeError:
        found = []
    if len(found) < 2:
        pytest.skip(f"needs 2 GPUs, found {len(found)}")
    return found[:2]


def _inputs(d, g, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    shapes = [(2, 333, 2 * g, d), (2, 397, 2, d), (2, 397, 2, d), (2, 333, 2 * g, d)]
    return [np.asarray(jax.random.normal(kk, s, jnp.bfloat16)) for kk, s in zip(ks, shapes)]


def _out_and_grads(fn, **kw):
    def run(q, k, v, dout):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, causal=True, **kw), q, k, v)
        return (out, *vjp(dout))
    return jax.jit(run)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _assert_same_results(fn, host, expect, got, where):
    """``got`` (on ``where``) against ``expect`` (one GPU): bits where the kernels are deterministic."""
    ref = _out_and_grads(fn, backend="reference")(*(jnp.asarray(x, jnp.float32) for x in host))
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), expect, got, ref):
        err_a, err_b = _rel(a, r), _rel(b, r)
        assert err_b < 1e-2, f"{name}: error {err_b:.2e} vs fp32 on {where}"
        if name == "out" or fn is xj.ffpa_attention:
            assert np.array_equal(np.asarray(a), np.asarray(b)), f"{name}: {where} differs from one GPU"
        else:
            assert err_b <= 1.25 * err_a + 1e-4, f"{name}: error {err_b:.2e} on {where} vs {err_a:.2e} on one GPU"


@pytest.mark.parametrize("fn, d, g", CONFIGS)
def test_second_gpu_gives_first_gpus_results(gpus, fn, d, g):
    host = _inputs(d, g)
    on = [_out_and_grads(fn)(*(jax.device_put(x, dev) for x in host)) for dev in gpus]
    for name, b in zip(("out", "dq", "dk", "dv"), on[1]):
        assert b.devices() == {gpus[1]}, name
    _assert_same_results(fn, host, on[0], on[1], "GPU 1")


@pytest.mark.skipif(os.environ.get("XATTN_JAX_MULTI_GPU_BWD") != "1",
                    reason="known hang: xattn.jax backward on 2 GPUs of one process (set XATTN_JAX_MULTI_GPU_BWD=1)")
@pytest.mark.parametrize("fn, d, g", CONFIGS)
def test_batch_sharded_over_two_gpus_gives_one_gpu_results(gpus, fn, d, g):
    host = _inputs(d, g, seed=1)
    mesh = Mesh(np.array(gpus), ("x",))
    sharded = jax.shard_map(lambda q, k, v, dout: _out_and_grads(fn)(q, k, v, dout), mesh=mesh,
                            in_specs=(P("x"),) * 4, out_specs=(P("x"),) * 4)
    both = jax.jit(sharded)(*(jax.device_put(x, NamedSharding(mesh, P("x"))) for x in host))
    one = _out_and_grads(fn)(*(jax.device_put(x, gpus[0]) for x in host))
    _assert_same_results(fn, host, one, both, "2 GPUs")


def test_mixed_devices_is_a_clear_error(gpus):
    q, k, v, _ = _inputs(128, 4)
    args = (jax.device_put(q, gpus[0]), jax.device_put(k, gpus[1]), jax.device_put(v, gpus[0]))
    with pytest.raises(ValueError, match="[Dd]evice"):
        jax.jit(lambda q, k, v: xj.flash_attention(q, k, v, causal=True))(*args)
    out = jax.jit(lambda q, k,
                  v: xj.flash_attention(q, k, v, causal=True))(*(jax.device_put(x, gpus[1]) for x in (q, k, v)))
    assert np.isfinite(np.asarray(out, np.float32)).all()
