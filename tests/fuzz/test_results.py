"""The fuzz results file on the CPU: one row per front end with counts, worst error / tolerance, failing
seeds, seed, device and date; a later session's rows replace only their own front ends."""

import json

from .results import Collector, output_path
from .space import POOL, draw
from .tolerance import Check


def _check(name, err, tol, problems=()):
    return Check(name, err, tol / 2, tol, list(problems))


def test_rows_count_worst_ratio_and_failing_seeds(tmp_path):
    c = Collector(base_seed=7, n=3)
    a, b, d = (draw("core", s) for s in (11, 12, 13))
    c.record(a, [_check("out", 0.1, 1.0), _check("dq", 0.5, 1.0)], seconds=0.25)
    c.record(b, [_check("out", 2.0, 1.0)], seconds=0.5)
    c.record(d, [], error="ValueError: out: needs unit stride", seconds=0.1)
    c.record(draw("jax", 5), [_check("lse", 0.0, 1.0)])
    doc = c.write(tmp_path / "fuzz.json", device="NVIDIA H200", date="2026-12-01")
    assert json.loads((tmp_path / "fuzz.json").read_text()) == doc
    assert doc["pool_launchers"] == 2 * len(POOL) and "K = " in doc["tolerance"]
    core, jax_row = doc["rows"]
    assert (core["front_end"], core["configs"], core["passed"], core["failed"]) == ("core", 3, 1, 2)
    assert core["worst_err_over_tol"] == 2.0 and core["worst"].startswith(f"{b.id} out")
    assert core["failing_seeds"] == [12, 13] and "unit stride" in core["errors"]["13"]
    assert (core["seed"], core["device"], core["date"], core["seconds"]) == (7, "NVIDIA H200", "2026-12-01", 0.8)
    assert (jax_row["front_end"], jax_row["passed"], jax_row["worst_err_over_tol"]) == ("jax", 1, 0.0)


def test_nan_counts_as_infinite_ratio():
    c = Collector(1, 1)
    c.record(draw("torch", 3), [_check("dk", 0.0, 1.0, problems=["2 NaN"])])
    (row,) = c.table("cpu")
    assert row["failed"] == 1 and row["worst_err_over_tol"] == "inf"


def test_a_later_session_replaces_only_its_front_ends(tmp_path):
    path = tmp_path / "fuzz.json"
    first = Collector(1, 2)
    for fe in ("core", "torch"):
        first.record(draw(fe, 1), [_check("out", 0.5, 1.0)])
    first.write(path, device="gpu0")
    second = Collector(2, 2)
    second.record(draw("torch", 2), [_check("out", 3.0, 1.0)])
    rows = {r["front_end"]: r for r in second.write(path, device="gpu1")["rows"]}
    assert rows["core"]["seed"] == 1 and rows["core"]["device"] == "gpu0"
    assert rows["torch"]["seed"] == 2 and rows["torch"]["failed"] == 1


def test_output_path_defaults_to_benchmarks_results(monkeypatch, tmp_path):
    monkeypatch.delenv("XATTN_FUZZ_OUT", raising=False)
    assert output_path().parts[-3:] == ("benchmarks", "results", "fuzz_h200.json")
    monkeypatch.setenv("XATTN_FUZZ_OUT", str(tmp_path / "x.json"))
    assert output_path() == tmp_path / "x.json"


def test_autosave_rewrites_the_file_after_every_configuration(tmp_path):
    path = tmp_path / "fuzz.json"
    c = Collector(3, 300, autosave=(path, "gpu"))
    c.record(draw("jax", 1), [_check("out", 0.5, 1.0)])
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["configs"], row["n_requested"], row["device"]) == (1, 300, "gpu")
    c.record(draw("jax", 2), [_check("out", 0.5, 1.0)])
    assert json.loads(path.read_text())["rows"][0]["configs"] == 2
