"""`python -m xattn info` works on any machine and says what runs here and why not."""

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "xattn", *args], capture_output=True, text=True, check=True).stdout


def test_info_reports_versions_gpu_and_families():
    text = _run("info")
    assert "ffpa-attn 0.2.4" in text and "flash-attn-4 4.0.0b36" in text
    assert "ffpa  run here:" in text and "fa4   run here:" in text
    assert "kernel disk cache:" in text
    data = json.loads(_run("info", "--json"))
    assert set(data["disk_cache"]) == {"enabled", "path", "entries"}
    assert set(data["families"]) == {"ffpa", "fa4"}
    for fam in data["families"].values():
        assert fam["can_run"] == (fam["why_not_run"] is None)
        assert fam["can_compile"], fam["why_not_compile"]  # sm_90a compiles anywhere
    if not data["gpus"]:
        assert data["no_gpu_reason"] and "GPU: none" in text
        assert all("no GPU" in f["why_not_run"] for f in data["families"].values())


def test_info_prints_the_d512_backward_route_table():
    assert "d512 backward: GQA group >= 8: GEMM backward from Nk 2048" in _run("info")


@pytest.mark.compile  # a real sm_90a compile of one GEMM launcher
def test_cache_lists_and_clears_gemm_launchers(tmp_path):
    """The chunked backward's GEMM launchers live in the same disk cache: listed as gemm/<kind>,
    removed by `cache clear` (their names match xattn's own-file pattern)."""
    import os

    env = dict(os.environ, XATTN_CACHE_DIR=str(tmp_path))
    code = ("from xattn.core import get_launcher; from xattn.core.gemm_sm90 import GemmSpec; "
            "get_launcher(GemmSpec('mm_dq', 'bfloat16'))")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    run = lambda *a: subprocess.run([sys.executable, "-m", "xattn", *a], env=env, capture_output=True,  # noqa: E731
                                    text=True, check=True).stdout
    assert "gemm/mm_dq" in run("cache", "list")
    assert "removed 1 entries" in run("cache", "clear")
    assert not list(tmp_path.glob("*.o"))


def test_warmup_argument_errors_are_usage_errors_not_tracebacks():
    """Found by a newcomer (#26): these printed tracebacks, or exited 0 having built nothing."""
    cases = [(("--model", "llama"), "invalid choice: 'llama'"),
             (("--head-dims", "abc"), "expected D or D:Dv"),
             (("--head-dims", "100", "--dry-run"), "nothing to build: no kernel family serves head dims 100/100"),
             (("--gqa", "0"), "expected a positive int, got 0"),
             (("--model", "gemma4", "--head-dims", "128"), "cannot be combined with --head-dims")]
    for args, words in cases:
        res = subprocess.run([sys.executable, "-m", "xattn", "warmup", *args], capture_output=True, text=True)
        assert res.returncode == 2, (args, res.returncode, res.stderr)
        assert words in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)


def test_warmup_presets_named_by_the_cli_are_the_cores():
    from xattn.__main__ import MODEL_PRESETS
    from xattn.core.warmup import PRESETS

    assert set(MODEL_PRESETS) == set(PRESETS)
    listed = _run("warmup", "--head-dims", "512", "192:128", "--gqa", "4", "--dry-run").split()
    assert "ffpa_fwd_bfloat16_d512x512_g4_causal_dense_sm_90a" in listed
    assert "fa4_fwd_bfloat16_d192x128_g4_full_dense_sm_90a" in listed


def test_warmup_brings_the_gemm_backward_launchers_of_a_d512_backward(monkeypatch):
    """A d512 backward may take the chunked-GEMM route (the route table): warmup builds its launchers too,
    for the backward's dtypes only, and not when the backward is not asked for or the route is forced off."""
    from xattn.core import warmup

    gemm = {g.short_name() for g in warmup.gemm_backward_launchers("float16")}
    assert "ffpa_bwd_gemm_mm_kv_float16_d32_sm_90a" in gemm and "ffpa_bwd_gemm_acc_float16_d32_sm_90a" in gemm
    names = lambda specs: {s.short_name() for s in specs}  # noqa: E731
    specs, _ = warmup.plan(head_dims=(512,), dtypes=("float16",))
    assert gemm <= names(specs) and not any("bfloat16" in n for n in names(specs) if "gemm" in n)
    assert not any("gemm" in n for n in names(warmup.plan(head_dims=(512,), directions=("fwd",))[0]))
    assert not any("gemm" in n for n in names(warmup.plan(head_dims=(128,))[0]))
    assert {g.short_name() for g in warmup.gemm_backward_launchers("bfloat16")} <= names(warmup.plan(model="gemma4")[0])
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    assert not any("gemm" in n for n in names(warmup.plan(head_dims=(512,))[0]))


def test_cache_list_shows_the_linked_shared_library(tmp_path, monkeypatch):
    """`cache list` names each entry's .so next to its .o (both are on disk; the .so is what loads first)."""
    stem = "fa4_fwd_bfloat16_d128x128_g1_full_dense_sm_90a-" + "0" * 20
    (tmp_path / f"{stem}.o").write_bytes(b"\0" * 2000)
    (tmp_path / f"{stem}.json").write_text(json.dumps({"spec": {"family": "fa4", "direction": "fwd"}}))
    monkeypatch.setenv("XATTN_CACHE_DIR", str(tmp_path))
    assert "+ .so" not in _run("cache", "list")
    (tmp_path / f"{stem}.so").write_bytes(b"\0" * 3000)
    line = _run("cache", "list").splitlines()[0]
    assert line.startswith(f"{stem}.o") and "+ .so 3.0 kB" in line and "fa4/fwd" in line
