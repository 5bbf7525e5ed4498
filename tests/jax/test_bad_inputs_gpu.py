"""The JAX bad-input battery on the GPU: the CPU tables (``test_bad_inputs.py``, bf16 here) against the real
kernels through XLA FFI, where empty and key-less varlen problems really launch; plus what the CPU cannot
build: cu_seqlens committed to another device than q.

Kernel configs (precompiled on the GPU machine): FFPA bf16 d512 GQA 4 dense, FA4 bf16 d128 GQA 4 causal
dense and varlen, FA4 bf16 d256 GQA 2 window (63, 0). Each case is followed by a good call."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.battery import gpu_cases

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

from .test_bad_inputs import DENSE, DPA, VARLEN, _call, _varlen, check_result, good_call, run  # noqa: E402


@pytest.mark.parametrize("c", gpu_cases(DENSE + VARLEN + DPA))
def test_jax_gpu(c):
    run(c, "gpu")


def test_cu_seqlens_committed_to_the_cpu():
    """cu_seqlens committed to the host while q/k/v live on the GPU: a correct result (JAX moves them)
    or JAX's own device error (a ValueError naming the devices); never a launch with a host pointer."""
    name, args, kw = _varlen()("gpu")
    cpu = jax.devices("cpu")[0]
    kw = {**kw, "cu_seqlens_q": jax.device_put(np.asarray(kw["cu_seqlens_q"]), cpu),
          "cu_seqlens_k": jax.device_put(np.asarray(kw["cu_seqlens_k"]), cpu)}
    try:
        out = _call(name, *args, dict(kw))
    except ValueError as exc:
        assert "device" in str(exc).lower(), exc
    else:
        jax.block_until_ready(out)
        check_result(name, args, kw)
    good_call("gpu")
