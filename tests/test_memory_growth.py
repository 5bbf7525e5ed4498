"""benchmarks/memory_growth.py on the CPU: the mixed-call loop, the samples and the verdict, with the
torch core calls replaced by the fp64 stand-ins (tests/torch/stubs.py); the GPU run is the figure."""

import importlib.util
import pathlib

import pytest

from tests.torch import stubs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("memory_growth", ROOT / "benchmarks" / "memory_growth.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mixed_calls_with_the_standins(monkeypatch):
    mg = _load()
    stubs.install(monkeypatch)
    try:
        from xattn.torch.hf import support

        monkeypatch.setattr(support, "kernels_available", lambda: None)  # the HF case runs on the stand-ins
    except ImportError:
        pass
    lines = []
    r = mg.run(calls=100, device="cpu", small=True, use_jax=False, warmup_cycles=1, log=lines.append)
    assert r["calls"] == 100 and not r["stopped_early"]
    assert [s["at"] for s in r["samples"]] == ["start", "warm", "100"]
    assert lines == [lines[0]] and lines[0].startswith("memory_growth: 100/100 calls") and "launchers" in lines[0]
    assert r["growth"]["launchers"] == 0 and r["samples"][-1]["torch_allocated"] is None
    assert sum(e["calls"] for e in r["tally"].values()) == 100
    good = {n: e for n, e in r["tally"].items() if not e["bad"]}
    assert len(good) >= 7 and not any(e["raised"] for e in good.values())
    assert any("varlen" in n for n in good) and any("window" in n for n in good)
    for name in ("bad: varlen without max_seqlen", "bad: FA4 backward under use_deterministic_algorithms"):
        e = r["tally"][name]  # refused before the core (the stand-ins skip the core's own checks)
        assert e["refused"] == e["calls"] > 0
    assert ("bwd", "ffpa") in stubs.CALLS and ("bwd", "fa4") in stubs.CALLS


@pytest.mark.parametrize("grow, tally, missed", [
    pytest.param(dict(torch_allocated=0, torch_reserved=0, launchers=0, rss=2 ** 20), {}, [], id="clean"),
    pytest.param(dict(torch_allocated=512, launchers=0), {}, ["torch_allocated grew by 512"], id="device-leak"),
    pytest.param(dict(launchers=1), {}, ["launchers grew by 1"], id="new-launcher"),
    pytest.param(dict(rss=17 * 2 ** 20), {}, ["rss grew by 17.0 MiB > 16 MiB"], id="rss"),
    pytest.param({}, {"g": dict(calls=2, raised={"ValueError": 1}, refused=0, bad=False, last_error="ValueError: x")},
                 ["g: ValueError: x"], id="good-call-failed"),
    pytest.param({}, {"b": dict(calls=2, raised={"TypeError": 1}, refused=1, bad=True)},
                 ["b: refused 1 of 2 calls (no error)"], id="bad-call-ran"),
])
def test_verdict(grow, tally, missed):
    met, got = _load().verdict(tally, grow)
    assert got == missed and met == (not missed)
