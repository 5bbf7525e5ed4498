"""Warm start on the GPU: a new process with a filled disk cache prepares d512 fwd+bwd in
under a second and produces the same bits as the process that compiled them."""

import importlib.util
import pathlib

import pytest

pytestmark = pytest.mark.gpu

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "cold_start.py"


def _cold_start():
    spec = importlib.util.spec_from_file_location("cold_start", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_warm_process_loads_fast_and_bit_identical():
    r = _cold_start().measure()
    assert r["cold"]["sources"] == ["compiled", "compiled"], r
    assert r["warm"]["sources"] == ["disk", "disk"], r
    assert r["warm"]["prep_seconds"] < 1.0, r
    assert r["bit_identical"] == {n: True for n in ("out", "lse", "dq", "dk", "dv")}, r
