"""GPU fuzz, front end ``core-jax``: xattn.core with JAX arrays as inputs (DLPack), torch / raw tvm_ffi outputs.

``pytest -m fuzz``; configurations and the verdict are in tests/fuzz/space.py, harness.py, tolerance.py."""

import pytest

from .harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.fuzz]
FRONT_END = "core-jax"


def test_fuzz(fuzz_config, fuzz_collector):
    run_one(fuzz_config, fuzz_collector, "cuda")
