"""jax.nn's own test cases (see :mod:`tests.jax.nn_upstream_cases`) on the CPU: the reference backend
(the CPU twin of the GPU run), and the kernel route with the NumPy stand-in launchers, where each case
either runs on the (stand-in) kernels or falls back to jax.nn's own XLA call, as on the GPU."""

import dataclasses
import functools

import jax.numpy as jnp
import pytest

import xattn.jax as xj
from xattn.jax import _ffi

from . import numpy_launcher
from .nn_upstream_cases import cases, run_case

CASES = cases()


def _can_jit(case) -> bool:
    return jnp.dtype(case.dtype) != jnp.float16  # XLA:CPU has no fp16 x fp16 -> fp32 dot under jit


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_reference_backend_passes_jax_nn_cases(case):
    result = run_case(functools.partial(xj.dot_product_attention, backend="reference"), case,
                      reference_f32=not _can_jit(case))
    assert not result.errors, result.errors


# the kernel route's expected route per case: head dim 32 has no kernel, mask/bias arrays have no kernel form
def _expected_route(case) -> str:
    if "bias" in case.modes or "custom" in case.modes:
        return "mask/bias"
    return "head dims 32/32" if case.head_dim == 32 else "kernel"


D128 = [c for c in CASES if c.head_dim == 128]  # (d32 only falls back: test_nn.py covers that route)


@pytest.mark.parametrize("case", D128, ids=[c.name for c in D128])
def test_kernel_route_passes_jax_nn_cases(case):
    """The NumPy stand-in takes fp16, so the kernel cases run in fp16 (against jax.nn on their float32: XLA:CPU
    cannot run jax.nn's fp16 call under jit); the routes are the GPU's."""
    route = _expected_route(case)
    if route == "kernel":
        case = dataclasses.replace(case, dtype=jnp.float16)
    _ffi.set_launcher_provider(numpy_launcher.provider)
    try:
        result = run_case(functools.partial(xj.dot_product_attention, backend="kernel"), case,
                          reference_f32=not _can_jit(case))
    finally:
        _ffi.set_launcher_provider(None)
    assert not result.errors, result.errors
    assert (result.route == "kernel") if route == "kernel" else route in result.route, result.route
