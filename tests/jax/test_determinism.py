"""xattn.jax deterministic mode on the CPU (NumPy stand-in launchers through the real FFI plumbing):
``XATTN_DETERMINISTIC`` / ``XLA_FLAGS`` make tracing an FA4 backward raise (or warn); the FFPA backward,
every forward and the reference backend are never refused."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi
from xattn.jax.determinism import deterministic_mode

from . import numpy_launcher

ALERT = r"xattn backward \(FA4 sm90 .* does not have a deterministic implementation"


@pytest.fixture(autouse=True)
def standin(monkeypatch):
    monkeypatch.delenv("XATTN_DETERMINISTIC", raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    _ffi.set_launcher_provider(numpy_launcher.provider)
    yield
    _ffi.set_launcher_provider(None)


def _dense(fn, d, g, **kw):
    def run():
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(k1, (1, 8, 2 * g, d), jnp.float16)
        k, v = (jax.random.normal(r, (1, 8, 2, d), jnp.float16) for r in (k2, k3))
        loss = lambda q, k, v: (fn(q, k, v, backend="kernel", **kw).astype(jnp.float32) ** 2).sum()  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return run


def _varlen(family, d, g):
    def run():
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
        q = jax.random.normal(k1, (9, 2 * g, d), jnp.float16)
        k, v = (jax.random.normal(r, (9, 2, d), jnp.float16) for r in (k2, k3))
        cu = jnp.array([0, 4, 4, 9], jnp.int32)
        loss = lambda q, k, v: (xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=5, max_seqlen_k=5, family=family,  # noqa: E731
                                                    scale=0.1, causal=True,
                                                    backend="kernel").astype(jnp.float32) ** 2).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return run


CASES = [
    pytest.param(_dense(xj.ffpa_attention, 512, 4, causal=True), False, id="ffpa-d512-gqa4-causal"),
    pytest.param(_dense(xj.ffpa_attention, 320, 1), False, id="ffpa-d320-mha"),
    pytest.param(_varlen("ffpa", 384, 2), False, id="ffpa-varlen"),
    pytest.param(_dense(xj.flash_attention, 128, 4, causal=True), True, id="fa4-d128-gqa4-causal"),
    pytest.param(_dense(xj.flash_attention, 256, 2, window_size=(3, 0)), True, id="fa4-d256-gqa2-window"),
    pytest.param(_dense(xj.flash_attention, 64, 1), True, id="fa4-d64-mha"),
    pytest.param(_varlen("fa4", 128, 4), True, id="fa4-varlen"),
    pytest.param(_dense(xj.dot_product_attention, 128, 2, is_causal=True), True, id="jax.nn-drop-in-fa4"),
]


@pytest.mark.parametrize("run, nondet", CASES)
def test_on_raises_for_the_fa4_backward_only(run, nondet, monkeypatch):
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")
    if nondet:
        with pytest.raises(RuntimeError, match=ALERT):
            run()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            jax.block_until_ready(run())


@pytest.mark.parametrize("run, nondet", CASES)
def test_warn_gives_a_user_warning_and_the_result_off_gives_nothing(run, nondet, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off = jax.block_until_ready(run())
    monkeypatch.setenv("XATTN_DETERMINISTIC", "warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warned = jax.block_until_ready(run())
    alerts = [w for w in caught if "deterministic implementation" in str(w.message)]
    assert bool(alerts) == nondet and all(w.category is UserWarning for w in alerts)
    for a, b in zip(off, warned):
        np.testing.assert_array_equal(a, b)


def test_forward_and_reference_backend_are_never_refused(monkeypatch):
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")
    q = jnp.ones((1, 8, 4, 64), jnp.float16)
    k = jnp.ones((1, 8, 2, 64), jnp.float16)
    jax.block_until_ready(jax.jit(lambda q, k: xj.flash_attention(q, k, k, causal=True, backend="kernel"))(q, k))
    f = lambda q, k: (xj.flash_attention(q, k, k, causal=True, backend="reference") ** 2).sum()  # noqa: E731
    jax.block_until_ready(jax.jit(jax.grad(f))(q.astype(jnp.float32), k.astype(jnp.float32)))


@pytest.mark.parametrize("env, flags, mode", [
    pytest.param(None, None, "off", id="default"),
    pytest.param("1", None, "raise", id="env-on"),
    pytest.param("TRUE", None, "raise", id="env-on-case"),
    pytest.param("warn", None, "warn", id="env-warn"),
    pytest.param("0", "--xla_gpu_deterministic_ops=true", "off", id="env-off-beats-xla-flag"),
    pytest.param(None, "--xla_gpu_deterministic_ops=true", "raise", id="xla-deterministic-ops"),
    pytest.param(None, "--foo=1 --xla_gpu_deterministic_ops", "raise", id="xla-bare-flag"),
    pytest.param(None, "--xla_gpu_exclude_nondeterministic_ops=true", "raise", id="xla-exclude"),
    pytest.param(None, "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", "off", id="xla-last-wins"),
    pytest.param(None, "--xla_gpu_deterministic_ops_extra=true", "off", id="xla-other-flag"),
])
def test_mode_from_env_and_xla_flags(env, flags, mode, monkeypatch):
    if env is not None:
        monkeypatch.setenv("XATTN_DETERMINISTIC", env)
    if flags is not None:
        monkeypatch.setenv("XLA_FLAGS", flags)
    assert deterministic_mode() == mode


def test_bad_env_value_is_named(monkeypatch):
    monkeypatch.setenv("XATTN_DETERMINISTIC", "sometimes")
    with pytest.raises(ValueError, match="XATTN_DETERMINISTIC"):
        deterministic_mode()


def test_turning_the_mode_on_after_a_trace_still_refuses(monkeypatch):
    """A backward traced with the mode off is not reused once it is on (the GPU run caught this: the
    custom_vjp's traced backward was cached on a config that did not hold the mode)."""
    q, k, v = (jax.random.normal(kk, s, jnp.float16) for kk, s in zip(jax.random.split(jax.random.PRNGKey(4), 3),
                                                                       ((1, 16, 4, 128), (1, 16, 1, 128),
                                                                        (1, 16, 1, 128))))
    loss = lambda q, k, v: xj.flash_attention(q, k, v, causal=True, backend="kernel").astype(jnp.float32).sum()  # noqa: E731
    monkeypatch.setenv("XATTN_DETERMINISTIC", "0")
    jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    monkeypatch.setenv("XATTN_DETERMINISTIC", "1")
    with pytest.raises(RuntimeError, match="deterministic"):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
