"""Kernel cache safety (#12 item 5): races, damaged entries, read-only/full directories, trust.

The compile and load steps are replaced by a deterministic fake (bytes in, the same bytes
out), so these run in seconds on the CPU; the locking, checking and commit logic is the real
one. ``test_processes_and_threads_compile_once_with_real_compiles`` does the race with real
sm_90a compiles. Root ignores file modes, so where a test needs a directory it cannot write
it also refuses the writes at the ``os`` level, and a foreign owner is made with ``chown``
as root or by faking ``fstat``/``stat`` otherwise."""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from xattn.core import cache, cache_link, disk_cache
from xattn.core.spec import KernelSpec

REPO = Path(__file__).resolve().parents[2]
SPECS = (KernelSpec("fa4", "fwd", "bfloat16", 64, 64), KernelSpec("fa4", "fwd", "bfloat16", 96, 96),
         KernelSpec("ffpa", "fwd", "bfloat16", 512, 512))
SPEC = SPECS[0]
FOREIGN_UID = 4242


# ----------------------------------------------------------------------------- the fake compiler


def payload(spec: KernelSpec) -> bytes:
    """The fake "machine code" of ``spec``: deterministic, a few kB."""
    seed = hashlib.sha256(spec.short_name().encode()).digest()
    return b"FAKE\0" + spec.short_name().encode() + b"\0" + seed * 128


class FakeCompiled:
    """Stands in for a CuTeDSL compiled launcher: exports its payload, "runs" as its payload."""

    def __init__(self, data: bytes):
        self._tvm_ffi_function = data  # what cache.Launcher.function becomes

    def export_to_c(self, path, function_name):
        with open(path, "wb") as f:
            f.write(self._tvm_ffi_function)


def fake_compile(spec: KernelSpec) -> FakeCompiled:
    log_path = os.environ.get("XATTN_TEST_COMPILE_LOG")
    if log_path:  # one line per compile, appended atomically: counts compiles across processes
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, (spec.short_name() + "\n").encode())
        os.close(fd)
    time.sleep(float(os.environ.get("XATTN_TEST_COMPILE_SECONDS", "0")))
    return FakeCompiled(payload(spec))


LOADED: list[bytes] = []  # every payload the fake loader was handed


def fake_open(path: str):
    data = Path(path).read_bytes()
    data = data[3:] if data.startswith(b"SO\0") else data
    if not data.startswith(b"FAKE\0"):
        raise OSError(errno.ENOEXEC, "invalid ELF header")
    LOADED.append(data)
    return data, data


def fake_link(obj: str, out: str, rpath: bool = True) -> bool:
    Path(out).write_bytes(b"SO\0" + Path(obj).read_bytes())
    return True


FAKES = dict(open_shared=fake_open, open_object=fake_open, link_shared=fake_link, preload_runtime=lambda: None)


def install_fakes(setattr_=setattr) -> None:
    """Replace compile/link/load by the fakes (also called by the race test's subprocesses)."""
    setattr_(cache, "_default_compiler", fake_compile)
    for name, fn in FAKES.items():
        setattr_(cache_link, name, fn)


@pytest.fixture
def kc(tmp_path, monkeypatch):
    """A fresh cache directory with the fake compiler installed; yields its path."""
    directory = tmp_path / "kc"
    monkeypatch.setenv("XATTN_CACHE_DIR", str(directory))
    monkeypatch.delenv("XATTN_CACHE", raising=False)
    monkeypatch.delenv("XATTN_TEST_COMPILE_LOG", raising=False)
    install_fakes(monkeypatch.setattr)
    cache.set_compiler(None)
    cache.clear()
    LOADED.clear()
    yield directory
    cache.clear()
    for path in tmp_path.rglob("*"):
        if path.is_dir() and not path.is_symlink():
            with contextlib.suppress(OSError):
                os.chmod(path, 0o700)  # let pytest clean up read-only trees


def fresh(spec=SPEC):
    """A launcher as a new process would get it (memory cache forgotten)."""
    cache.clear()
    return cache.get_launcher(spec)


def stem(directory: Path, spec=SPEC) -> Path:
    return directory / disk_cache.entry_stem(spec)


def warnings_of(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and text in r.getMessage()]


def assert_good_entry(directory: Path, spec=SPEC):
    """The entry on disk is whole, safe and loads (from disk) as the right bits."""
    launcher = fresh(spec)
    assert launcher.source == "disk" and launcher.function == payload(spec)
    for suffix in (".o", ".so", ".json"):
        st = stem(directory, spec).with_suffix(suffix).stat()
        assert st.st_uid == os.geteuid() and not st.st_mode & 0o022
    assert not [p.name for p in directory.iterdir() if p.name.endswith(".tmp") or ".tmp." in p.name]


# ----------------------------------------------------------------------------- races


RACE_CHILD = """
    import json, os, sys, threading, time, hashlib
    sys.path.insert(0, {repo!r})
    from xattn.core import cache
    fakes = {fakes}
    if fakes:
        from tests.core.test_disk_cache_safety import SPECS, install_fakes
        install_fakes()
    else:
        from xattn.core import KernelSpec
        SPECS = (KernelSpec("fa4", "fwd", "bfloat16", 64, 64),)
        real = cache._default_compiler
        def counted(spec):
            fd = os.open(os.environ["XATTN_TEST_COMPILE_LOG"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, (spec.short_name() + "\\n").encode()); os.close(fd)
            return real(spec)
        cache._default_compiler = counted
    go = sys.argv[1]
    open(go + ".ready." + sys.argv[2], "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    barrier, lock, rows = threading.Barrier(8), threading.Lock(), []
    def work(i):
        barrier.wait()
        for k in range(len(SPECS)):
            spec = SPECS[(i + k) % len(SPECS)]
            e = cache.get_launcher(spec)
            bits = e.function if isinstance(e.function, bytes) else None
            with lock:
                rows.append(dict(key=spec.short_name(), source=e.source, launcher=id(e),
                                 sha=hashlib.sha256(bits).hexdigest() if bits else None))
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print(json.dumps(rows))
"""


def _race(directory: Path, tmp_path: Path, fakes: bool, processes: int = 4) -> tuple[list[dict], list[str]]:
    """``processes`` processes x 8 threads get every key at once; returns their rows and the compile log."""
    log_path, go = tmp_path / "compiles.log", tmp_path / "go"
    env = dict(os.environ, XATTN_CACHE_DIR=str(directory), XATTN_TEST_COMPILE_LOG=str(log_path),
               XATTN_TEST_COMPILE_SECONDS="0.3")
    env.pop("XATTN_CACHE", None)
    code = textwrap.dedent(RACE_CHILD.format(repo=str(REPO), fakes=fakes))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(go), str(i)], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(processes)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready.*"))) < processes and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    go.touch()  # everyone starts together
    rows, stderr = [], []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        stderr.append(err)
        rows += [dict(r, pid=p.pid) for r in json.loads(out.strip().splitlines()[-1])]
    for text in ("unusable", "kernel cache directory", "without it"):  # no warning of the cache's
        assert not [e for e in stderr if text in e], stderr
    return rows, log_path.read_text().split()


def test_processes_and_threads_compile_each_key_once(kc, tmp_path):
    """4 processes x 8 threads race for 3 keys: one compile per key, every launcher the same bits."""
    rows, compiles = _race(kc, tmp_path, fakes=True)
    keys = sorted(s.short_name() for s in SPECS)
    assert sorted(compiles) == keys  # exactly one compile per key, across all processes
    assert len(rows) == 4 * 8 * len(SPECS)
    for spec in SPECS:
        mine = [r for r in rows if r["key"] == spec.short_name()]
        assert {r["sha"] for r in mine} == {hashlib.sha256(payload(spec)).hexdigest()}  # identical bits
        compiled_in = {r["pid"] for r in mine if r["source"] == "compiled"}
        assert len(compiled_in) == 1 and all(r["source"] == "disk" for r in mine if r["pid"] not in compiled_in)
        assert all(len({r["launcher"] for r in mine if r["pid"] == pid}) == 1 for pid in {r["pid"] for r in mine})
        assert_good_entry(kc, spec)


@pytest.mark.compile
def test_processes_and_threads_compile_once_with_real_compiles(tmp_path, monkeypatch):
    """The same race with a real sm_90a compile: one compile, everyone else loads the entry."""
    directory = tmp_path / "kc"
    rows, compiles = _race(directory, tmp_path, fakes=False)
    assert compiles == [SPEC.short_name()] and len(rows) == 4 * 8
    assert sum(r["source"] == "compiled" for r in rows) == 8  # the 8 threads of the compiling process
    assert len({(r["pid"], r["launcher"]) for r in rows}) == 4  # one launcher per process
    monkeypatch.setenv("XATTN_CACHE_DIR", str(directory))
    assert [e["file"] for e in disk_cache.entries()] == [stem(directory).name + ".o"]


def test_unlocked_writers_and_readers_never_see_a_mixed_entry(kc, caplog):
    """Writers that skipped the compile lock (a lock timeout) commit whole entries: readers see one
    writer's complete entry or none, never one writer's .o with another's .json (it would be
    reported as unusable)."""
    variants = [payload(SPEC) + bytes([i]) * 4000 for i in range(6)]
    stop, seen, errors = threading.Event(), [], []

    def write(data):
        for _ in range(3):
            disk_cache.store(SPEC, FakeCompiled(data), 1.0)

    def read():
        while not stop.is_set():
            try:
                hit = disk_cache.load(SPEC, report=True)  # a flaw would be logged
                if hit is not None:
                    seen.append(hit[1])
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    caplog.set_level(logging.WARNING, logger="xattn")
    readers = [threading.Thread(target=read) for _ in range(3)]
    writers = [threading.Thread(target=write, args=(v,)) for v in variants]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors and seen and set(seen) <= set(variants) and not warnings_of(caplog, "")
    final = disk_cache.load(SPEC, report=True)
    assert final is not None and final[1] in variants
    assert sorted(p.name for p in kc.iterdir() if p.is_file()) == sorted(
        stem(kc).name + s for s in (".json", ".o", ".so"))


# ----------------------------------------------------------------------------- damaged entries


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_json(edit):
    def damage(path):
        meta = json.loads(path.read_text())
        edit(meta)
        path.write_text(json.dumps(meta))
    return damage


def _other_keys_json(path):
    cache.get_launcher(SPECS[1])
    shutil.copy(stem(path.parent, SPECS[1]).with_suffix(".json"), path)


def _symlink_to_copy(path):
    copy = path.parent.parent / ("elsewhere" + path.suffix)
    shutil.copy(path, copy)
    path.unlink()
    path.symlink_to(copy)


def _digest_wrong(meta):
    meta["files"][".o"]["sha256"] = "0" * 64


DAMAGE = [
    pytest.param(".o", _truncate, "compiled", "bytes", id="truncated-object"),
    pytest.param(".o", _flip, "compiled", "SHA-256", id="corrupt-object"),
    pytest.param(".o", Path.unlink, "compiled", ".o missing", id="missing-object"),
    pytest.param(".o", _symlink_to_copy, "compiled", "symbolic link", id="symlinked-object"),
    pytest.param(".json", Path.unlink, "compiled", ".json missing", id="missing-json"),
    pytest.param(".json", lambda p: p.write_text('{"spec": '), "compiled", "unreadable", id="truncated-json"),
    pytest.param(".json", _other_keys_json, "compiled", "another kernel", id="json-of-another-key"),
    pytest.param(".json", _edit_json(_digest_wrong), "compiled", "SHA-256", id="json-wrong-digest"),
    pytest.param(".json", _edit_json(lambda m: m.pop("files")), "compiled", "no object", id="json-without-files"),
    pytest.param(".json", lambda p: p.write_text("[]"), "compiled", "format", id="json-not-an-object"),
    pytest.param(".so", _truncate, "disk", "bytes", id="truncated-library"),
    pytest.param(".so", _flip, "disk", "SHA-256", id="corrupt-library"),
    pytest.param(".so", Path.unlink, "disk", ".so missing", id="missing-library"),
]


@pytest.mark.parametrize("suffix, damage, rebuilt_as, why", DAMAGE)
def test_damaged_entry_is_rebuilt_with_a_warning(kc, caplog, suffix, damage, rebuilt_as, why):
    assert cache.get_launcher(SPEC).source == "compiled"
    damage(stem(kc).with_suffix(suffix))
    LOADED.clear()
    with caplog.at_level(logging.WARNING, logger="xattn"):
        again = fresh()
    assert again.source == rebuilt_as and again.function == payload(SPEC)
    (warning,) = warnings_of(caplog, "unusable")
    assert stem(kc).name in warning and why in warning, warning
    assert all(data == payload(SPEC) for data in LOADED)  # damaged bytes never reached the loader
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xattn"):
        assert_good_entry(kc)  # repaired on disk: the next process loads it
    assert not warnings_of(caplog, "")


def test_library_that_fails_to_load_falls_back_to_the_object(kc, caplog, monkeypatch):
    """A verified .so that dlopen refuses (and cannot be relinked here) still leaves a working entry."""
    cache.get_launcher(SPEC)
    monkeypatch.setattr(cache_link, "open_shared", lambda path: (_ for _ in ()).throw(OSError("undefined symbol")))
    with caplog.at_level(logging.WARNING, logger="xattn"):
        again = fresh()
    assert again.source == "disk" and again.function == payload(SPEC)
    assert warnings_of(caplog, "does not load")
    meta = json.loads(stem(kc).with_suffix(".json").read_text())
    assert set(meta["files"]) == {".o"} and not stem(kc).with_suffix(".so").exists()  # rewritten without it


# ----------------------------------------------------------------------------- read-only and full


def _deny_writes(monkeypatch, directory: Path, code: int = errno.EROFS):
    """Make every write under ``directory`` fail with ``code``, as a read-only mount would (root
    ignores chmod)."""
    root = os.path.abspath(directory)

    def inside(p):
        return isinstance(p, (str, bytes, os.PathLike)) and os.path.abspath(os.fsdecode(p)).startswith(root)

    def refuse(p):
        raise OSError(code, os.strerror(code), os.fsdecode(p))

    real = {name: getattr(os, name) for name in ("open", "mkdir", "replace", "rename", "unlink", "remove", "chmod")}

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if inside(path) and (flags & (os.O_WRONLY | os.O_RDWR) or flags & os.O_CREAT and not os.path.lexists(path)):
            refuse(path)
        return real["open"](path, flags, mode, dir_fd=dir_fd)

    def mkdir(path, mode=0o777, *, dir_fd=None):
        if inside(path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, "File exists", os.fsdecode(path))
            refuse(path)
        return real["mkdir"](path, mode, dir_fd=dir_fd)

    def guard(name):
        def wrapper(*args, **kwargs):
            for p in args[:2]:
                if inside(p):
                    refuse(p)
            return real[name](*args, **kwargs)
        return wrapper

    def any_open(file, mode="r", *args, **kwargs):
        if inside(file) and any(c in mode for c in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    real_open = builtins.open
    monkeypatch.setattr(os, "open", os_open)
    monkeypatch.setattr(os, "mkdir", mkdir)
    for name in ("replace", "rename", "unlink", "remove", "chmod"):
        monkeypatch.setattr(os, name, guard(name))
    monkeypatch.setattr(builtins, "open", any_open)
    monkeypatch.setattr(io, "open", any_open)


def _make_read_only(monkeypatch, directory: Path):
    """chmod 0500 the tree's directories; where that does not stop writes (root), refuse them at
    the os level too."""
    for d in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True) + [directory]:
        os.chmod(d, 0o500)
    probe = directory / ".probe"
    try:
        probe.touch()
    except PermissionError:
        return "chmod"
    probe.unlink()
    _deny_writes(monkeypatch, directory)
    return "simulated"


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def _get_all_in_threads(specs):
    out = {}
    threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, cache.get_launcher(s))) for s in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_read_only_directory_warns_once_and_runs_from_memory(kc, caplog, monkeypatch):
    cache.get_launcher(SPEC)  # an entry written while the directory was writable
    before = _files(kc)
    _make_read_only(monkeypatch, kc)
    cache.clear()
    with caplog.at_level(logging.WARNING, logger="xattn"):
        got = _get_all_in_threads(SPECS)
        cache.clear()
        _get_all_in_threads(SPECS[1:])  # the same misses again: no second warning
    assert got[SPEC].source == "disk"  # existing entries still load
    assert all(got[s].source == "compiled" and got[s].function == payload(s) for s in SPECS[1:])
    (warning,) = warnings_of(caplog, "kernel cache directory")
    assert "read-only" in warning or "not writable" in warning, warning
    assert "stay in memory" in warning and not warnings_of(caplog, "unusable")
    assert _files(kc) == before


def test_directory_that_cannot_be_created_warns_once(tmp_path, kc, caplog, monkeypatch):
    parent = tmp_path / "ro"
    parent.mkdir()
    monkeypatch.setenv("XATTN_CACHE_DIR", str(parent / "kc"))
    _make_read_only(monkeypatch, parent)
    with caplog.at_level(logging.WARNING, logger="xattn"):
        got = _get_all_in_threads(SPECS)
    assert all(got[s].source == "compiled" and got[s].function == payload(s) for s in SPECS)
    (warning,) = warnings_of(caplog, "kernel cache directory")
    assert "cannot create it" in warning and not (parent / "kc").exists()


class _FullDisk(FakeCompiled):
    exports = 0

    def export_to_c(self, path, function_name):
        type(self).exports += 1
        with open(path, "wb") as f:
            f.write(self._tvm_ffi_function[:100])
            raise OSError(errno.ENOSPC, "No space left on device")


def test_full_directory_warns_once_and_runs_from_memory(kc, caplog, monkeypatch):
    monkeypatch.setattr(cache, "_default_compiler", lambda spec: _FullDisk(payload(spec)))
    _FullDisk.exports = 0
    with caplog.at_level(logging.WARNING, logger="xattn"):
        got = {SPEC: cache.get_launcher(SPEC)}
        got.update(_get_all_in_threads(SPECS[1:]))
        cache.clear()
        _get_all_in_threads(SPECS)
    assert all(got[s].source == "compiled" and got[s].function == payload(s) for s in SPECS)
    (warning,) = warnings_of(caplog, "kernel cache directory")
    assert "full" in warning and "No space left" in warning
    assert _FullDisk.exports == 1  # after the first failure nothing more is written
    assert [p for p in _files(kc) if not p.startswith(".locks")] == []  # no partial files left


def test_exporter_failing_without_oserror_on_a_full_disk(kc, caplog, monkeypatch):
    """Exporters may report ENOSPC as their own exception: the free space decides."""
    def broken(path, function_name):
        raise RuntimeError("LLVM ERROR: IO failure on output stream")

    compiled = FakeCompiled(payload(SPEC))
    compiled.export_to_c = broken
    monkeypatch.setattr(cache, "_default_compiler", lambda spec: compiled)
    monkeypatch.setattr(disk_cache.os, "statvfs", lambda p: os.statvfs_result((4096, 4096, 10, 0, 0, 10, 0, 0, 0, 255)))
    with caplog.at_level(logging.WARNING, logger="xattn"):
        assert cache.get_launcher(SPEC).source == "compiled"
    (warning,) = warnings_of(caplog, "kernel cache directory")
    assert "full" in warning and "IO failure" in warning


# ----------------------------------------------------------------------------- trust


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_cache_directory_locks_and_entries_are_created_private(tmp_path, kc, monkeypatch):
    directory = tmp_path / "a" / "b" / "kc"
    monkeypatch.setenv("XATTN_CACHE_DIR", str(directory))
    old = os.umask(0o002)  # a group-writable umask must not leak into the cache
    try:
        cache.get_launcher(SPEC)
    finally:
        os.umask(old)
    assert _mode(directory) == 0o700 and _mode(directory / ".locks") == 0o700
    locks = list((directory / ".locks").iterdir())
    assert locks and all(_mode(p) == 0o600 for p in locks)
    assert all(not _mode(p) & 0o022 for p in directory.iterdir())
    assert_good_entry(directory)
    assert disk_cache.clear() == 1 and list((directory / ".locks").iterdir()) == []  # clear takes the locks too


def test_default_directory_is_created_private_and_tightened(tmp_path, kc, monkeypatch, caplog):
    monkeypatch.delenv("XATTN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    directory = tmp_path / "xdg" / "xattn"
    cache.get_launcher(SPEC)
    assert _mode(directory) == 0o700
    os.chmod(directory, 0o775)  # as an older xattn under umask 002 left it
    with caplog.at_level(logging.WARNING, logger="xattn"):
        assert fresh().source == "disk"
    assert _mode(directory) == 0o700 and not warnings_of(caplog, "")


def _set_owner(monkeypatch, path: Path, uid: int) -> None:
    """Make ``path`` look owned by ``uid``: chown as root, else fake stat/fstat for its inode."""
    if os.geteuid() == 0:
        os.chown(path, uid, -1, follow_symlinks=False)
        return
    st = path.stat()
    target = (st.st_dev, st.st_ino, st.st_ctime_ns)  # this very file, not a later one reusing its inode
    real_stat, real_fstat = os.stat, os.fstat

    def fake(st):
        if (st.st_dev, st.st_ino, st.st_ctime_ns) != target:
            return st
        fields = list(st)
        fields[stat.ST_UID] = uid
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", lambda p, *a, **k: fake(real_stat(p, *a, **k)))
    monkeypatch.setattr(os, "fstat", lambda fd: fake(real_fstat(fd)))


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=["world-writable", "group-writable", "sticky-tmp-like"])
def test_open_cache_directory_is_refused_and_left_alone(kc, caplog, mode):
    cache.get_launcher(SPEC)  # a good entry, written while the directory was private
    os.chmod(kc, mode)
    before = _files(kc)
    with caplog.at_level(logging.WARNING, logger="xattn"):
        got = [fresh(SPEC), cache.get_launcher(SPECS[1])]
    assert [g.source for g in got] == ["compiled", "compiled"]  # nothing loaded from it, nothing written
    (warning,) = warnings_of(caplog, "not using kernel cache directory")
    assert "writable by group or others" in warning and f"{mode & 0o777:03o}" in warning
    assert _files(kc) == before and _mode(kc) == mode  # an XATTN_CACHE_DIR is the user's: not chmod-ed


def test_directory_owned_by_another_user_is_refused(kc, caplog, monkeypatch):
    cache.get_launcher(SPEC)
    _set_owner(monkeypatch, kc, FOREIGN_UID)
    with caplog.at_level(logging.WARNING, logger="xattn"):
        assert fresh().source == "compiled"
    (warning,) = warnings_of(caplog, "not using kernel cache directory")
    assert f"owned by uid {FOREIGN_UID}" in warning


def _foreign(monkeypatch, path):
    _set_owner(monkeypatch, path, FOREIGN_UID)


def _chmod(mode):
    return lambda mp, path: os.chmod(path, mode)


UNTRUSTED = [
    pytest.param(".o", _foreign, "compiled", f"owned by uid {FOREIGN_UID}", id="object-of-another-user"),
    pytest.param(".json", _foreign, "compiled", f"owned by uid {FOREIGN_UID}", id="json-of-another-user"),
    pytest.param(".so", _foreign, "disk", f"owned by uid {FOREIGN_UID}", id="library-of-another-user"),
    pytest.param(".o", _chmod(0o664), "compiled", "writable by group or others (mode 664)", id="group-writable-object"),
    pytest.param(".so", _chmod(0o757), "disk", "writable by group or others (mode 757)", id="world-writable-library"),
    pytest.param(".json", _chmod(0o646), "compiled", "writable by group or others", id="world-writable-json"),
]


@pytest.mark.parametrize("suffix, make_untrusted, rebuilt_as, why", UNTRUSTED)
def test_untrusted_entry_file_is_refused_and_replaced(kc, caplog, monkeypatch, suffix, make_untrusted, rebuilt_as, why):
    cache.get_launcher(SPEC)
    make_untrusted(monkeypatch, stem(kc).with_suffix(suffix))
    LOADED.clear()
    with caplog.at_level(logging.WARNING, logger="xattn"):
        again = fresh()
    assert again.source == rebuilt_as and again.function == payload(SPEC)
    (warning,) = warnings_of(caplog, "unusable")
    assert why in warning, warning
    if rebuilt_as == "compiled":
        assert LOADED == []  # the refused file never reached the loader
    assert_good_entry(kc)  # replaced by a file of ours (a new inode: no faked owner)


def test_root_owned_entry_is_trusted(kc, caplog, monkeypatch):
    """A cache prefilled by root (say, read-only under /opt) is trusted by every user."""
    cache.get_launcher(SPEC)
    for suffix in (".o", ".so", ".json"):
        _set_owner(monkeypatch, stem(kc).with_suffix(suffix), 0)
    with caplog.at_level(logging.WARNING, logger="xattn"):
        assert fresh().source == "disk"
    assert not warnings_of(caplog, "")


def test_lock_needs_no_write_access_to_the_lock_file(kc, monkeypatch):
    """flock works on a read-only descriptor: a lock file we may not write still serialises compiles
    (the old O_RDWR open fell back to compiling unlocked)."""
    with disk_cache.compile_lock(SPEC) as held:
        assert held
    real_open = os.open

    def no_write_on_locks(path, flags, *args, **kwargs):
        if str(path).endswith(".lock") and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_write_on_locks)
    with disk_cache.compile_lock(SPEC) as first:
        assert first
        with disk_cache.compile_lock(SPEC, timeout=0.2) as second:
            assert not second  # really exclusive


def test_the_module_documents_the_contract():
    doc = disk_cache.__doc__
    for topic in ("What is trusted", "0700", "owned by you or root", "group or others", "Corruption",
                  "Read-only or full", "warns once", "Races", "compile lock", "As root"):
        assert topic in doc, topic
