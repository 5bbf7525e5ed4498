"""Fixtures shared by the JAX tests."""

import pytest


@pytest.fixture
def gemm_standin():
    """The GEMM launchers of both GEMM backwards (tests/numpy_gemm.py) and every other launcher
    (tests/jax/numpy_launcher.py) as NumPy stand-ins on the CPU platform; ``numpy_gemm.CALLS`` starts empty."""
    from tests import numpy_gemm
    from tests.jax import numpy_launcher
    from xattn.jax import _ffi

    _ffi.set_launcher_provider(numpy_gemm.provider(numpy_launcher.provider))
    numpy_gemm.CALLS.clear()
    yield
    _ffi.set_launcher_provider(None)


@pytest.fixture
def launcher_calls(gemm_standin):
    """:func:`gemm_standin`, with ``numpy_launcher.CALLS`` (the stand-in launches, in order) starting empty."""
    from tests.jax import numpy_launcher

    numpy_launcher.CALLS.clear()
    yield numpy_launcher.CALLS
