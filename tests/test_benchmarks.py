"""The benchmark tooling that runs without a GPU: the full plan, the report (ratios, peak share,
markdown) and the plot when matplotlib is there."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_full_plan_covers_the_issue():
    full = _load("full")
    d512 = full.plan("d512")
    assert {r[0] for r in d512} >= {"xattn.torch", "xattn.jax", "ffpa_attn native", "torch sdpa", "jax xla", "jax cudnn"}
    assert {r[4] for r in d512} == {1024, 2048, 4096, 8192, 16384, 32768}
    assert {(r[2], r[3]) for r in d512} == {(32, 4), (16, 16)}
    assert {r[1] for r in full.plan("small")} == {128, 256}
    assert full.flops(1, 1, 4, 4, 1, True, "fwd") == 4 * 8 and full.flops(1, 1, 4, 4, 1, False, "fwd+bwd") == 4 * 16 * 3.5
    assert full.flops(1, 1, 4, 4, 1, False, "fwd", window=2) == 4 * (1 + 2 + 2 + 2)
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "full.py"), "--part", "sliding", "--dry-run"],
                         capture_output=True, text=True, check=True).stdout
    assert "5 rows in part sliding" in out and "matmul" in out  # + the same-run peak


def _rows():
    base = dict(head_dim=512, heads_q=32, heads_kv=4, causal=True, dtype="bfloat16", device="H200", status="ok",
                part="d512")
    rows = [dict(base, method="torch bf16 matmul 8192^3", head_dim=0, seqlen=8192, **{"pass": "matmul"}, ms=1.0, tflops=800.0)]
    for n, nat, ours in ((4096, 380.0, 386.0), (8192, 480.0, 490.0)):
        rows.append(dict(base, method="ffpa_attn native", seqlen=n, **{"pass": "fwd"}, ms=1.0, tflops=nat))
        rows.append(dict(base, method="xattn.torch", seqlen=n, **{"pass": "fwd"}, ms=1.0, tflops=ours))
    rows.append(dict(base, method="jax cudnn", seqlen=4096, **{"pass": "fwd"}, ms=None, tflops=None,
                     status="refused: head_dim 512"))
    return rows


def test_report_ratios_peak_and_markdown(tmp_path):
    report = _load("report")
    rows = report.enrich(_rows())
    ours = [r for r in rows if r["method"] == "xattn.torch"]
    assert [r["vs_native"] for r in ours] == [round(386 / 380, 3), round(490 / 480, 3)]
    assert ours[0]["pct_peak"] == round(100 * 386 / 800, 1)
    md = report.markdown(rows)
    assert "| jax cudnn | 512 | 32/4 | 4096 | True | fwd |  |  |  |  |  | refused: head_dim 512 |" in md
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(_rows()))
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), str(path)], check=True, capture_output=True)
    md = (tmp_path / "rows.md").read_text()
    assert md.startswith("## Targets") and "\n| method |" in md


def test_report_targets_list_every_row_below():
    report = _load("report")
    rows = _rows() + [dict(_rows()[1], method="xattn.jax", tflops=370.0),  # 370 / 380 < 0.98
                      dict(_rows()[3], method="xattn.jax", tflops=475.0)]  # 475 / 480 >= 0.98
    md = report.targets(report.enrich(rows))
    assert "| xattn.torch >= 98 % of ffpa_attn native (d512, N >= 4k) | 2 | none |" in md
    assert "| xattn.jax >= 98 % of ffpa_attn native (d512, N >= 4k) | 2 | d512 32/4 N4096 causal fwd 0.974 |" in md
    assert "| xattn.torch | 32/4 | fwd | 8192 |" in md and "matmul |" not in md.split("Longest")[1]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    report = _load("report")
    report.plot(report.enrich(_rows()), str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
