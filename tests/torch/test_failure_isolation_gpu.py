"""Failure isolation on the GPU (#12 item 3): a real out-of-memory while allocating outputs, and a failed
compile of a real launcher, each followed by a good call that must be right.

Kernel config (precompiled on the GPU machine): FFPA bf16 d512 GQA 4, non-causal."""

from __future__ import annotations

import pytest
import torch

import xattn.torch as xt
from xattn.core import cache

from .test_bad_inputs import good_call

pytestmark = pytest.mark.gpu


def _huge():
    """Zero-stride q/k/v (no memory) whose output needs 64 * 2**21 * 8 * 512 bf16 = 1 TiB: within the
    kernels' index limits, so only the allocation can fail."""
    z = torch.zeros(1, 1, 1, 512, dtype=torch.bfloat16, device="cuda")
    return z.expand(64, 2 ** 21, 8, 512), z.expand(64, 128, 2, 512), z.expand(64, 128, 2, 512)


def test_real_out_of_memory_then_the_next_call_is_right():
    good_call("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        with pytest.raises(torch.OutOfMemoryError):
            xt.attention(*_huge())
        assert torch.cuda.memory_allocated() == before  # nothing half-allocated is kept
        good_call("cuda")
    torch.cuda.synchronize()


def test_failed_compile_then_the_real_launcher():
    """The in-memory cache is emptied and compiling fails once: the call raises the compiler's error,
    no entry is left; with the default compiler back, the next call loads the launcher and is right."""
    good_call("cuda")
    cache.clear()

    def failing(spec):
        raise RuntimeError(f"compile failed (test): {spec.short_name()}")
    cache.set_compiler(failing)
    try:
        with pytest.raises(RuntimeError, match="compile failed"):
            good_call("cuda")
        assert cache.cached_specs() == []
    finally:
        cache.set_compiler(None)
    good_call("cuda")
    torch.cuda.synchronize()
