"""Failure isolation in xattn.jax (#12 item 3): after a refused call, a failed compile, or a failure while
getting or running a launcher (XLA's out-of-memory included), the next good call in the same process
gives the right answer.

CPU: the NumPy stand-in launchers through jax-tvm-ffi; compiles go through ``xattn.core.cache`` (a
flaky compiler whose "compiled launcher" is the stand-in); a launch fails through the stand-in's
``FAIL_NEXT`` hook."""

from __future__ import annotations

import pytest

import xattn.jax as xj
from tests.battery import unmarked
from tests.core.test_failure_isolation import FlakyCompiler
from xattn.core import cache
from xattn.jax import _ffi

from . import numpy_launcher
from .test_bad_inputs import DENSE, VARLEN, _dense, _fa4, check_result, good_call, run

jax = pytest.importorskip("jax")
jnp = jax.numpy


@pytest.fixture
def standin():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    numpy_launcher.CALLS.clear()
    numpy_launcher.FAIL_NEXT.clear()
    yield
    numpy_launcher.FAIL_NEXT.clear()
    _ffi.set_launcher_provider(None)


@pytest.fixture
def compiler(monkeypatch):
    """Launchers come from ``xattn.core.cache`` (as on the GPU), compiled by a flaky stand-in compiler."""
    flaky = FlakyCompiler()

    def flaky_make(spec):
        flaky.compiled.append(spec)
        if spec in flaky.fail:
            flaky.fail.remove(spec)
            raise RuntimeError(f"compile failed (test): {spec.short_name()}")
        return numpy_launcher.make(spec)
    monkeypatch.setattr(cache, "_entries", {})
    monkeypatch.setattr(cache, "_key_locks", {})
    monkeypatch.setattr(cache, "_compiler", flaky_make)
    _ffi.set_launcher_provider(lambda spec: (cache.get_launcher(spec).function, "cpu"))
    yield flaky
    _ffi.set_launcher_provider(None)


def _spec(make, direction="fwd"):
    from xattn.jax.attention import _config

    name, (q, k, v), kw = make("cpu")
    cfg = _config(name, q, None, kw.get("causal", False), kw.get("window_size", (None, None)), "kernel")
    return cfg.spec(direction, q, k, v)


def _step(make):
    name, args, kw = make("cpu")
    check_result(name, args, kw)


@pytest.mark.parametrize("c", unmarked([p for p in DENSE + VARLEN if p.values[0].error is not None][::5]))
def test_refused_call_then_good_call(c, standin):
    run(c, "cpu")


def test_refused_trace_inside_jit_then_good_call(standin):
    """A jitted function whose trace is refused (bad shapes) caches nothing: the same jitted function
    with good inputs runs right."""
    f = jax.jit(lambda q, k, v: xj.ffpa_attention(q, k, v, backend="kernel"))
    _, (q, k, v), _ = _dense(b=1, nq=16, nk=20)("cpu")
    with pytest.raises(ValueError, match="Hkv=3"):
        f(q, jnp.tile(k, (1, 1, 3, 1)), jnp.tile(v, (1, 1, 3, 1)))
    with pytest.raises(ValueError, match="scale"):
        jax.jit(lambda q, k, v: xj.ffpa_attention(q, k, v, scale=float("nan"), backend="kernel"))(q, k, v)
    out = f(q, k, v)
    ref = xj.ffpa_attention(*(x.astype(jnp.float32) for x in (q, k, v)), backend="reference")
    assert float(jnp.abs(out.astype(jnp.float32) - ref).max()) < 2e-2
    good_call()


def test_failed_compile_is_retried_and_other_keys_unaffected(compiler):
    _step(_fa4(b=1, nq=16, nk=20))  # another key, compiled and cached first
    fa4_compiles = len(compiler.compiled)
    make = _dense(b=1, nq=16, nk=20)  # traced afresh each step (a jitted executable holds its target)
    fwd, bwd = _spec(make), _spec(make, "bwd")
    compiler.fail.append(fwd)
    with pytest.raises(RuntimeError, match="compile failed"):
        _step(make)
    assert fwd not in cache._entries
    compiler.fail.append(bwd)
    with pytest.raises(RuntimeError, match="compile failed"):
        _step(make)  # forward fine now; the backward's compile fails
    assert bwd not in cache._entries
    _step(make)
    assert compiler.compiled.count(fwd) == 2 and compiler.compiled.count(bwd) == 2
    good_call()
    _step(_fa4(b=1, nq=16, nk=20))
    assert len(compiler.compiled) == fa4_compiles + 4  # the FA4 keys were not compiled again


@pytest.mark.parametrize("exc", [MemoryError("RESOURCE_EXHAUSTED: out of memory allocating 200 GiB (test)"),
                                 RuntimeError("CUDA error: out of memory (test)")], ids=["memory-error", "runtime"])
def test_provider_failing_once_then_the_next_call_is_right(standin, exc):
    """Getting a launcher fails once (an out-of-memory while loading or compiling it): the call raises
    that error, nothing is registered half-way, and the next call is right."""
    good_call()
    state = []

    def provider(spec):
        if not state:
            state.append(spec)
            raise exc
        return numpy_launcher.provider(spec)
    _ffi.set_launcher_provider(provider)
    name, args, kw = _fa4(b=1, nq=16, nk=20, window_size=(3, 0), causal=False)("cpu")  # a fresh key
    with pytest.raises(type(exc), match="test"):
        check_result(name, args, kw)
    check_result(name, args, kw)
    good_call()


def test_launch_failing_once_then_the_next_call_is_right(standin):
    """A launch that fails at run time (the kernel's out-of-memory, a driver error) surfaces as JAX's
    runtime error; XLA, the registered target and the next call are fine."""
    good_call()
    numpy_launcher.FAIL_NEXT.append(RuntimeError("CUDA error: out of memory (test)"))
    with pytest.raises(Exception, match="out of memory"):
        good_call()
    assert numpy_launcher.FAIL_NEXT == []
    good_call()
    numpy_launcher.FAIL_NEXT.append(RuntimeError("CUDA error: out of memory (test)"))
    with pytest.raises(Exception, match="out of memory"):
        _step(_fa4(b=1, nq=16, nk=20))  # a backward with aliased, pre-filled buffers
    _step(_fa4(b=1, nq=16, nk=20))
