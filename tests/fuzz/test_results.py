"""The fuzz results file on the CPU: one row per front end with counts, worst error / tolerance, failing
seeds, seed, device and date; a later session's rows replace only their own front ends."""

import json

import pytest

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


def _part(tmp_path, name, seeds, shard, monkeypatch, ratio=0.1):
    monkeypatch.setenv("XATTN_FUZZ_SHARD", shard)
    c = Collector(base_seed=7, n=4)
    for s in seeds:
        cfg = draw("jax", s)
        c.record(cfg, [_check("out", ratio, 1.0)], seconds=1.0, routes=("fused", "split-kv"))
    path = tmp_path / name
    c.write(path, device="NVIDIA H100 80GB HBM3", date="2026-12-05")
    return path


def test_shards_select_every_kth_configuration_and_merge_into_one_row(tmp_path, monkeypatch, capsys):
    from . import results
    from .space import selected_indices

    monkeypatch.setenv("XATTN_FUZZ_START", "1")
    monkeypatch.setenv("XATTN_FUZZ_SHARD", "1/2")
    assert list(selected_indices(8)) == [2, 4, 6]
    monkeypatch.setenv("XATTN_FUZZ_SHARD", "2/2")
    with pytest.raises(ValueError, match="XATTN_FUZZ_SHARD"):
        selected_indices(8)
    monkeypatch.delenv("XATTN_FUZZ_START")
    a = _part(tmp_path, "a.json", [21, 22], "0/2", monkeypatch)
    b = _part(tmp_path, "b.json", [23], "1/2", monkeypatch, ratio=0.7)
    assert json.loads(a.read_text())["rows"][0]["selection"] == "shard 0/2"
    results._merge_main(["--out", str(tmp_path / "m.json"), "--note", "two shards", str(a), str(b)])
    (row,) = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert (row["configs"], row["passed"], row["failed"], row["seconds"]) == (3, 3, 0, 3.0)
    assert row["worst_err_over_tol"] == 0.7 and row["note"] == "two shards" and "selection" not in row
    assert row["routes"]["split-kv"] == {"runs": 3, "failed": 0}
    assert [p["selection"] for p in row["parts"]] == ["shard 0/2", "shard 1/2"]
    assert "3 configurations in 2 part(s)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="two parts"):  # a part merged twice
        results.merge_rows([row, json.loads(b.read_text())["rows"][0]])
    other = dict(json.loads(b.read_text())["rows"][0], seed=8)
    with pytest.raises(ValueError, match="differ in"):
        results.merge_rows([json.loads(a.read_text())["rows"][0], other])
