"""GPU fuzz, front end ``jax``: xattn.jax under jax.vjp (dense and varlen; eager and jit).

``pytest -m fuzz``; configurations and the verdict are in tests/fuzz/space.py, harness.py, tolerance.py."""

import pytest

from .harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.fuzz]
FRONT_END = "jax"


def test_fuzz(fuzz_config, fuzz_collector):
    run_one(fuzz_config, fuzz_collector, "cuda")
