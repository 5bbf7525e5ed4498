"""Failure isolation of xattn.jax on the GPU (#12 item 3): XLA runs out of memory for a call's buffers, and a
launcher fails to compile; each time the next good call is right.

Kernel config (precompiled on the GPU machine): FFPA bf16 d512 GQA 4, non-causal."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import xattn.jax as xj  # noqa: E402
from xattn.core import cache  # noqa: E402

from .test_bad_inputs import _dense, check_result, good_call  # noqa: E402


def test_xla_out_of_memory_then_the_next_call_is_right():
    """q broadcast inside jit to 64 x 2**21 x 8 x 512 bf16 (1 TiB, within the kernels' index limits):
    XLA cannot allocate the custom call's operands; the error is XLA's, and the process goes on."""
    def huge(q1, k, v):
        return xj.ffpa_attention(jnp.broadcast_to(q1, (64, 2 ** 21, 8, 512)), k, v, backend="kernel").sum()

    q1 = jnp.zeros((1, 1, 8, 512), jnp.bfloat16)
    k = jnp.zeros((64, 128, 2, 512), jnp.bfloat16)
    good_call("gpu")
    with pytest.raises(Exception, match="(?i)resource_exhausted|out of memory|allocat"):
        jax.block_until_ready(jax.jit(huge)(q1, k, k))
    good_call("gpu")


def test_failed_compile_then_the_real_launcher():
    """A fresh trace whose launcher fails to compile raises the compiler's error; with the default compiler
    back, a fresh trace loads the launcher and is right (XLA targets already registered are reused)."""
    good_call("gpu")
    cache.clear()

    def failing(spec):
        raise RuntimeError(f"compile failed (test): {spec.short_name()}")
    name, args, kw = _dense(b=1, nq=24, nk=20)("gpu")  # a shape not traced before: a fresh trace
    cache.set_compiler(failing)
    try:
        with pytest.raises(RuntimeError, match="compile failed"):
            check_result(name, args, kw)
    finally:
        cache.set_compiler(None)
    check_result(name, args, kw)
    good_call("gpu")
