"""GPU fuzz, front end ``hf``: the drop-in over its peer's argument forms (tests/fuzz/forms.py).

``pytest -m fuzz``; configurations in forms.py, the verdict in forms_harness.py."""

import pytest

from .harness import run_one

pytestmark = [pytest.mark.gpu, pytest.mark.fuzz]
FRONT_END = "hf"


def test_fuzz(fuzz_config, fuzz_collector):
    run_one(fuzz_config, fuzz_collector, "cuda")
