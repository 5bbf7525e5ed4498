"""The persistent launcher cache: round trip, keys, concurrency, corruption, CLI (CPU, sm_90a)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import tvm_ffi

from xattn.core import cache, cache_link, cache_trust, disk_cache
from xattn.core.spec import KernelSpec

# FA4 d64 forward: the quickest launcher to compile (~2 s on one core).
SPEC = KernelSpec("fa4", "fwd", "bfloat16", 64, 64)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XATTN_CACHE_DIR", str(tmp_path / "kc"))
    monkeypatch.delenv("XATTN_CACHE", raising=False)
    cache.set_compiler(None)
    cache.clear()
    yield tmp_path / "kc"
    cache.clear()


def _in_new_process(code: str, env_dir: Path, extra_env=None) -> dict:
    env = dict(os.environ, XATTN_CACHE_DIR=str(env_dir), **(extra_env or {}))
    script = textwrap.dedent(code)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


LOAD_IN_NEW_PROCESS = """
    import json, sys, time
    t0 = time.perf_counter()
    import xattn.core as xc
    from xattn.core import cache, KernelSpec
    entry = cache.get_launcher(KernelSpec("fa4", "fwd", "bfloat16", 64, 64))
    xc.bwd_workspace("ffpa", (1, 100, 8, 512), (1, 100, 2, 512), causal=True)
    xc.bwd_workspace("fa4", (1, 100, 8, 128), (1, 100, 2, 128))
    kernel_modules = sorted(m for m in ("cutlass", "ffpa_attn", "flash_attn", "quack") if m in sys.modules)
    import tvm_ffi, torch
    q = torch.zeros(1, 8, 1, 64, dtype=torch.bfloat16)
    try:  # CPU tensors: the launcher's own signature check must refuse them, naming the arg
        entry.function(q, q, q, q, torch.zeros(1, 1, 8), 0.1)
        err = None
    except ValueError as exc:
        err = str(exc)
    print(json.dumps(dict(source=entry.source, seconds=entry.seconds,
                          is_fn=isinstance(entry.function, tvm_ffi.Function),
                          err=err, kernel_modules=kernel_modules)))
"""


@pytest.mark.compile
def test_export_load_round_trip(cache_dir):
    fresh = cache.get_launcher(SPEC)
    assert fresh.source == "compiled"
    entry = disk_cache.entries()
    assert len(entry) == 1 and entry[0]["spec"]["family"] == "fa4" and entry[0]["bytes"] > 10_000
    out = _in_new_process(LOAD_IN_NEW_PROCESS, cache_dir)
    assert out["source"] == "disk" and out["is_fn"] and out["seconds"] < 1.0
    assert "Mismatched Tensor on argument #0" in out["err"] and "mQ: Tensor([n0, n1, n2, 64], bfloat16)" in out["err"]
    if entry[0].get("shared_library"):  # a warm process never imports the DSL or the kernel packages
        assert out["kernel_modules"] == []


def _rewrite_meta(obj: Path, with_library: bool) -> None:
    """Record the entry's files in its .json as the machine that wrote them would have."""
    meta = json.loads(obj.with_suffix(".json").read_text())
    files = {s: cache_trust.file_record(obj.with_suffix(s).read_bytes()) for s in (".o", ".so")[: 1 + with_library]}
    obj.with_suffix(".json").write_text(json.dumps(dict(meta, files=files, shared_library=with_library)))


@pytest.mark.compile
def test_object_only_entry_loads_through_cutlass(cache_dir):
    """An entry written where no C compiler was found has no .so."""
    cache.get_launcher(SPEC)
    for so in cache_dir.glob("*.so"):
        so.unlink()
    _rewrite_meta(next(cache_dir.glob("*.o")), with_library=False)
    out = _in_new_process(LOAD_IN_NEW_PROCESS, cache_dir)
    assert out["source"] == "disk" and out["is_fn"] and "Mismatched Tensor" in out["err"]


@pytest.mark.compile
def test_corrupt_object_is_removed_and_recompiled(cache_dir, caplog):
    cache.get_launcher(SPEC)
    for so in cache_dir.glob("*.so"):  # the .so form would be loaded first: make the .o the one that loads
        so.unlink()
    next(cache_dir.glob("*.o")).write_bytes(b"\x7fELF not really" * 10)
    cache.clear()
    with caplog.at_level("WARNING", logger="xattn"):
        again = cache.get_launcher(SPEC)
    assert again.source == "compiled" and isinstance(again.function, tvm_ffi.Function)
    assert "unusable" in caplog.text
    cache.clear()
    assert cache.get_launcher(SPEC).source == "disk"  # the recompiled entry is good


def _compiled_shared_library(cache_dir):
    cache.get_launcher(SPEC)
    so = next(cache_dir.glob("*.so"), None)
    if so is None:
        pytest.skip("no .so entry on this machine (no C compiler for the .so form)")
    return so


@pytest.mark.compile
def test_corrupt_shared_library_is_relinked_from_the_object(cache_dir):
    so = _compiled_shared_library(cache_dir)
    so.write_bytes(b"\x7fELF not really" * 10)
    cache.clear()
    again = cache.get_launcher(SPEC)
    assert again.source == "disk" and isinstance(again.function, tvm_ffi.Function)
    assert so.read_bytes()[:4] == b"\x7fELF" and len(so.read_bytes()) > 10_000  # a real library again


@pytest.mark.compile
def test_entry_from_another_machine_loads_without_its_rpath(cache_dir):
    """A cache filled on a login node links the runtime by a path that does not exist here."""
    so = _compiled_shared_library(cache_dir)
    assert cache_link.link_shared(str(so.with_suffix(".o")), str(so), rpath=False)
    _rewrite_meta(so.with_suffix(".o"), with_library=True)
    linked = so.read_bytes()
    out = _in_new_process(LOAD_IN_NEW_PROCESS, cache_dir)
    assert out["source"] == "disk" and out["is_fn"] and "Mismatched Tensor" in out["err"]
    assert so.read_bytes() == linked  # loaded as is once the runtime was preloaded: not relinked


def test_key_changes_with_everything_that_changes_the_binary(monkeypatch):
    base = disk_cache.entry_stem(SPEC)
    assert base.startswith(SPEC.short_name() + "-")
    versions = tuple((d, v + ".post1" if d == "nvidia-cutlass-dsl" else v) for d, v in SPEC.versions)
    assert disk_cache.entry_stem(KernelSpec("fa4", "fwd", "bfloat16", 64, 64, versions=versions)) != base
    assert disk_cache.entry_stem(KernelSpec("fa4", "fwd", "bfloat16", 64, 64, arch="sm_90")) != base
    monkeypatch.setattr(disk_cache.sys, "version_info", (3, 99, 0))
    assert disk_cache.entry_stem(SPEC) != base
    monkeypatch.undo()
    monkeypatch.setattr(disk_cache, "_source_fingerprint", lambda: "changed-launcher-source")
    assert disk_cache.entry_stem(SPEC) != base


class _SlowExport:
    """Stands in for a compiled launcher: writes its object in pieces, slowly."""

    def __init__(self, tag: bytes):
        self.tag = tag

    def export_to_c(self, path, function_name):
        with open(path, "wb") as f:
            for _ in range(5):
                f.write(self.tag * 1000)
                f.flush()
                time.sleep(0.01)


def test_concurrent_writers_threads_leave_one_whole_entry(cache_dir, monkeypatch):
    monkeypatch.setattr(cache_link, "link_shared", lambda obj, out: False)
    tags = [bytes([65 + i]) for i in range(8)]
    threads = [threading.Thread(target=disk_cache.store, args=(SPEC, _SlowExport(t), 1.0)) for t in tags]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    files = sorted(p.name for p in cache_dir.iterdir() if p.is_file())
    stem = disk_cache.entry_stem(SPEC)
    assert files == [f"{stem}.json", f"{stem}.o"]  # no temporaries left
    data = (cache_dir / f"{stem}.o").read_bytes()
    assert len(data) == 5000 and len(set(data)) == 1  # one writer's complete file


@pytest.mark.compile
def test_concurrent_processes_compile_once(cache_dir):
    code = """
        import json
        from xattn.core import cache, KernelSpec
        e = cache.get_launcher(KernelSpec("fa4", "fwd", "bfloat16", 64, 64))
        print(json.dumps(dict(source=e.source)))
    """
    env = dict(os.environ, XATTN_CACHE_DIR=str(cache_dir))
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    sources = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-2000:]
        sources.append(json.loads(out.strip().splitlines()[-1])["source"])
    assert sorted(sources) == ["compiled", "disk", "disk"]  # the lock made the others wait and load
    assert len(disk_cache.entries()) == 1


def test_lock_timeout_falls_back_to_compiling_unlocked(cache_dir):
    with disk_cache.compile_lock(SPEC) as first:
        assert first
        t0 = time.monotonic()
        with disk_cache.compile_lock(SPEC, timeout=0.3) as second:
            assert not second and time.monotonic() - t0 >= 0.3


@pytest.mark.parametrize("setting, writes", [("0", False), ("1", True)])
def test_cache_switch(cache_dir, monkeypatch, setting, writes):
    monkeypatch.setenv("XATTN_CACHE", setting)
    monkeypatch.setattr(cache_link, "link_shared", lambda obj, out: False)
    monkeypatch.setattr(cache, "_default_compiler", lambda spec: _SlowExport(b"x"))
    entry = cache.get_launcher(SPEC)
    assert entry.source == "compiled"
    assert disk_cache.enabled() == writes
    assert (len(disk_cache.entries()) == 1) == writes


def _cli(*args, env_dir):
    env = dict(os.environ, XATTN_CACHE_DIR=str(env_dir))
    return subprocess.run([sys.executable, "-m", "xattn", *args], capture_output=True, text=True, env=env,
                          timeout=600, check=True)


@pytest.mark.compile
def test_warmup_and_cache_commands(cache_dir):
    args = ["warmup", "--family", "fa4", "--head-dims", "64", "96", "--passes", "fwd", "--causal", "no"]
    first = _cli(*args, env_dir=cache_dir)
    assert "[1/2]" in first.stderr and "[2/2]" in first.stderr and first.stderr.count("compiled") == 2
    second = _cli(*args, env_dir=cache_dir)
    assert second.stderr.count(" disk ") == 2
    listing = _cli("cache", "list", env_dir=cache_dir).stdout
    assert "2 entries" in listing and "fa4_fwd_bfloat16_d64x64" in listing and "fa4_fwd_bfloat16_d96x96" in listing
    assert _cli("cache", "path", env_dir=cache_dir).stdout.strip() == str(cache_dir)
    assert "removed 2 entries" in _cli("cache", "clear", env_dir=cache_dir).stdout
    assert "0 entries" in _cli("cache", "list", env_dir=cache_dir).stdout


def test_warmup_plan_gemma4_and_skips():
    from xattn.core.warmup import plan

    specs, skipped = plan(model="gemma4")
    names = [s.short_name() for s in specs]
    assert "ffpa_bwd_bfloat16_d512x512_g8_causal_dense_sm_90a" in names
    assert "fa4_fwd_bfloat16_d256x256_g2_full_dense_w1023_0_sm_90a" in names and not skipped
    specs, skipped = plan(families=("fa4",), head_dims=((192, 128),), gqa=(2,), directions=("fwd", "bwd"))
    assert [s.direction for s in specs] == ["fwd", "fwd"] and len(skipped) == 2
    assert all("GQA" in reason for _, reason in skipped)
    with pytest.raises(ValueError, match="unknown preset"):
        plan(model="llama9")


@pytest.mark.compile
def test_loaded_function_registers_as_an_xla_ffi_target(cache_dir):
    """JAX reaches loaded launchers exactly like fresh ones: both are tvm_ffi.Functions."""
    jax_tvm_ffi = pytest.importorskip("jax_tvm_ffi")
    fresh = cache.get_launcher(SPEC)
    cache.clear()
    loaded = cache.get_launcher(SPEC)
    assert loaded.source == "disk"
    for tag, entry in (("fresh", fresh), ("loaded", loaded)):
        assert isinstance(entry.function, tvm_ffi.Function)
        jax_tvm_ffi.register_ffi_target(f"{SPEC.target_name()}_{tag}", entry.function,
                                        arg_spec=["args", "attrs.softmax_scale"], platform="cpu")


def test_clear_removes_only_xattn_files(tmp_path, monkeypatch):
    """`python -m xattn cache clear` on a shared directory must not delete other programs' files."""
    monkeypatch.setenv("XATTN_CACHE_DIR", str(tmp_path))
    stem = disk_cache.entry_stem(SPEC)
    ours = [f"{stem}.o", f"{stem}.so", f"{stem}.json", f".{stem}.123.456.tmp.o", f".{stem}.so.123.tmp"]
    theirs = ["model.o", "libfoo.so", "config.json", ".editor.tmp", "ffpa_notes.json"]
    for name in ours + theirs:
        (tmp_path / name).write_text("x")
    (tmp_path / ".locks").mkdir()
    (tmp_path / ".locks" / f"{stem}.lock").write_text("")
    (tmp_path / ".locks" / "other.lock").write_text("")
    assert disk_cache.clear() == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(theirs)
    assert [p.name for p in (tmp_path / ".locks").iterdir()] == ["other.lock"]


def test_paged_and_combine_keys_follow_their_own_modules(monkeypatch):
    """A paged launcher is built by paged_sm90.py and the combine by combine_sm90.py: an edit there must change
    their entries' names (a stale binary would load otherwise), and leave the plain kernels' names alone."""
    from xattn.core.split_kv import CombineSpec

    paged = KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, page_size=128)
    combine = CombineSpec("fa4", "bfloat16", 128)
    before = {s: disk_cache.entry_stem(s) for s in (SPEC, paged, combine)}
    disk_cache._kind_fingerprint.cache_clear()
    monkeypatch.setattr(disk_cache, "_kind_fingerprint", lambda kind: f"edited {kind} module")
    assert disk_cache.entry_stem(paged) != before[paged]
    assert disk_cache.entry_stem(combine) != before[combine]
    assert disk_cache.entry_stem(SPEC) == before[SPEC]
