"""jax.nn's own test cases (:mod:`tests.jax.nn_upstream_cases`) on the GPU: ``xattn.jax.dot_product_attention``
with the real kernels (or, where no kernel runs the case exactly, jax.nn's XLA fallback) against jax.nn's XLA
implementation, at upstream's tolerances. ``XATTN_CASES_OUT=<path>`` writes the per-case table (route, verdict)."""

import json
import os

import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")

import xattn.jax as xj  # noqa: E402

from .nn_upstream_cases import cases, run_case  # noqa: E402

CASES = cases()
KERNEL_ROUTE = {c.name for c in CASES if c.head_dim == 128 and "bias" not in c.modes and "custom" not in c.modes}


def _record(result) -> None:
    path = os.environ.get("XATTN_CASES_OUT")
    if not path:
        return
    rows = json.load(open(path)) if os.path.exists(path) else []
    rows = [r for r in rows if r["case"] != result.case.name]
    rows.append(dict(case=result.case.name, head_dim=result.case.head_dim, route=result.route,
                     verdict=result.verdict, errors=result.errors, device=jax.devices()[0].device_kind))
    json.dump(sorted(rows, key=lambda r: r["case"]), open(path, "w"), indent=1)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_jax_nn_cases_on_the_gpu(case):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    result = run_case(xj.dot_product_attention, case)
    _record(result)
    assert not result.errors, result.errors
    assert (result.route == "kernel") == (case.name in KERNEL_ROUTE), result.route
