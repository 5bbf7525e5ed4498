"""Fuzz session plumbing: parametrize the front-end tests with drawn configurations, collect verdicts.

The GPU fuzz tests are opt-in: they are generated only when the mark expression selects ``fuzz``
(``pytest -m fuzz``), the command line names a fuzz path on a machine with a GPU (``pytest -m gpu
tests/fuzz``, what ``scripts/gpu_run.sh tests-fuzz`` runs) or ``XATTN_FUZZ_ONLY`` names configurations; otherwise each
front end shows one skipped placeholder, so neither CPU CI nor ``pytest -m gpu`` pays for 7 x 1000
configurations. Without a GPU they skip like every ``gpu`` test (tests/conftest.py).
"""

import os

import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

from xattn.core.device import cuda_gpus  # noqa: E402

from . import space  # noqa: E402
from .results import Collector, output_path  # noqa: E402


def _selected(config) -> bool:
    expr = config.getoption("markexpr", "") or ""
    named = any("fuzz" in str(arg) for arg in config.args) and bool(cuda_gpus())  # on a CPU: skipped anyway
    return ("fuzz" in expr and "not fuzz" not in expr) or named or bool(os.environ.get("XATTN_FUZZ_ONLY"))


def pytest_generate_tests(metafunc):
    if "fuzz_config" not in metafunc.fixturenames:
        return
    if not _selected(metafunc.config):
        skip = pytest.mark.skip(reason="fuzz: opt-in, run with -m fuzz (XATTN_FUZZ_SEED, _N, _ONLY, _OUT)")
        metafunc.parametrize("fuzz_config", [pytest.param(None, id="opt-in", marks=skip)])
        return
    front_end = metafunc.module.FRONT_END
    metafunc.parametrize("fuzz_config", [pytest.param(c, id=c.id) for c in space.configs(front_end)])


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def fuzz_collector():
    """Session-wide verdicts: one row per front end that ran goes to the results file, rewritten after
    every configuration (a run cut short keeps its rows) and once more at the end of the session."""
    base, n, only = space.env_settings()
    path = output_path()
    collector = Collector(base, n, only, autosave=(path, _device_name()))
    yield collector
    if collector.rows:
        collector.write(path, _device_name())
        print(f"\nfuzz: results -> {path}")
