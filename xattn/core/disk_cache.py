"""Persistent launcher cache: compiled launchers exported as object files, loaded by later processes.

Location: ``XATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/xattn`` (``~/.cache/xattn``). On by
default; ``XATTN_CACHE=0`` turns it off. One entry per compile key: ``<name>-<digest>.o``
(the ``export_to_c`` object), ``<name>-<digest>.so`` (the same linked into a shared library
when a C compiler is available: it loads through ``tvm_ffi.load_module`` in milliseconds,
without importing cutlass) and ``<name>-<digest>.json`` (what it is, for ``cache list``).
The digest covers the :class:`KernelSpec` (which holds the library versions and the arch),
the Python minor version, the machine and a fingerprint of xattn's launcher sources.

Concurrency: entries are written to a temporary name and renamed into place (a reader never
sees half a file); an exclusive ``flock`` per key makes concurrent processes (e.g. 8 ranks)
compile a key once while the others wait and load it. A lock not granted within
``XATTN_CACHE_LOCK_TIMEOUT`` seconds (default 600) is skipped: the process compiles on its
own (at worst several compiles, never a bad file). An entry that fails to load is logged,
removed and recompiled.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .spec import KernelSpec

__all__ = ["enabled", "cache_dir", "entry_stem", "load", "store", "compile_lock", "entries", "clear"]

log = logging.getLogger("xattn")
EXPORT_NAME = "xattn_launcher"
_LAUNCHER_SOURCES = ("symbolic.py", "ffpa_sm90.py", "fa4_sm90.py", "disk_cache.py")


def enabled() -> bool:
    """False when ``XATTN_CACHE=0``."""
    return os.environ.get("XATTN_CACHE", "1") != "0"


def cache_dir() -> Path:
    """The cache directory (not created here)."""
    env = os.environ.get("XATTN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xattn"


@functools.cache
def _source_fingerprint() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in _LAUNCHER_SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes())
    return h.hexdigest()[:16]


def entry_stem(spec: KernelSpec) -> str:
    """File name stem of ``spec``'s entry: readable name + digest of everything that changes the binary."""
    ident = repr((spec, sys.version_info[:2], platform.machine(), _source_fingerprint()))
    return f"{spec.short_name()}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"


@functools.cache
def _preload_runtime() -> None:
    # Exported objects reference symbols of the CuTeDSL runtime libraries; make them globally
    # visible before dlopen-ing an entry in a process that has compiled nothing yet.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def load(spec: KernelSpec):
    """``(module, function)`` from disk, or ``None`` on a miss. A broken entry is removed.

    The ``.so`` form is tried first (no cutlass import). A cache filled on another machine (a
    login node) has a runtime rpath that may not exist here: the runtime is then preloaded and
    the ``.so`` retried; a ``.so`` that still fails is relinked from the ``.o`` here."""
    stem = cache_dir() / entry_stem(spec)
    obj, lib = stem.with_suffix(".o"), stem.with_suffix(".so")
    if not obj.exists():
        return None
    if lib.exists():
        loaded = _load_shared(lib)
        if loaded is not None:
            return loaded
    try:
        _preload_runtime()
        import cutlass.cute as cute

        module = cute.runtime.load_module(str(obj), enable_tvm_ffi=True)
        return module, getattr(module, EXPORT_NAME)
    except Exception as exc:  # corrupt, truncated or incompatible: recompile
        log.warning("xattn: cache entry %s is unusable (%s: %s); removing it and recompiling",
                    stem.name, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        for suffix in (".so", ".o", ".json"):
            with contextlib.suppress(OSError):
                stem.with_suffix(suffix).unlink()
        return None


def _load_shared(lib: Path):
    """``(module, function)`` from the ``.so`` form, relinking it from the ``.o`` once if needed; else None."""
    import tvm_ffi

    for attempt in ("as is", "runtime preloaded", "relinked here"):
        if attempt == "runtime preloaded":
            _preload_runtime()
        elif attempt == "relinked here":
            tmp = lib.with_name(f".{lib.name}.{os.getpid()}.tmp")
            if not _link_shared(str(lib.with_suffix(".o")), str(tmp)):
                break
            os.replace(tmp, lib)
        try:
            module = tvm_ffi.load_module(str(lib))
            if attempt != "as is":
                log.info("xattn: cache entry %s loaded (%s)", lib.stem, attempt)
            return module, module[EXPORT_NAME]
        except Exception as exc:  # noqa: BLE001 - the next attempt, then the .o, decide
            log.info("xattn: %s did not load %s (%s)", lib.name, attempt, str(exc).splitlines()[0][:200])
    with contextlib.suppress(OSError):
        lib.unlink()
    return None


def _link_shared(obj: str, out: str, rpath: bool = True) -> bool:
    """Link an exported object into a shared library against the CuTeDSL runtime (rpath set)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return False
    import cutlass.cute as cute

    runtime = [p for p in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False) if Path(p).exists()]
    flags = []
    for path in runtime:
        d = os.path.dirname(path)
        name = os.path.basename(path)[3:].split(".so")[0]  # libcute_dsl_runtime.so -> cute_dsl_runtime
        flags += [f"-L{d}", f"-l{name}"] + ([f"-Wl,-rpath,{d}"] if rpath else [])
    try:
        subprocess.run([cc, "-shared", "-o", out, obj, *flags], check=True, capture_output=True, timeout=120)
        return True
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("xattn: no shared-library form of %s (%s); the .o entry loads through cutlass", obj, exc)
        return False


def store(spec: KernelSpec, compiled, compile_seconds: float) -> Path | None:
    """Export ``compiled`` atomically; returns the entry path, or ``None`` if it could not be written."""
    export = getattr(compiled, "export_to_c", None)
    if export is None:
        return None
    directory = cache_dir()
    stem = entry_stem(spec)
    tmp = directory / f".{stem}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        export(str(tmp) + ".o", function_name=EXPORT_NAME)
        linked = _link_shared(str(tmp) + ".o", str(tmp) + ".so")
        meta = dict(spec=_spec_dict(spec), compile_seconds=round(compile_seconds, 2),
                    created=time.strftime("%Y-%m-%dT%H:%M:%S"), python=platform.python_version(),
                    machine=platform.machine(), pid=os.getpid(), shared_library=linked)
        Path(str(tmp) + ".json").write_text(json.dumps(meta, indent=1))
        if linked:
            os.replace(str(tmp) + ".so", directory / f"{stem}.so")
        os.replace(str(tmp) + ".o", directory / f"{stem}.o")  # the .o is the commit point
        os.replace(str(tmp) + ".json", directory / f"{stem}.json")
        return directory / f"{stem}.o"
    except Exception as exc:
        log.warning("xattn: could not write cache entry %s (%s: %s)", stem, type(exc).__name__, exc)
        for suffix in (".o", ".so", ".json"):
            with contextlib.suppress(OSError):
                os.unlink(str(tmp) + suffix)
        return None


def _spec_dict(spec: KernelSpec) -> dict:
    d = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    d["versions"] = dict(spec.versions)
    return d


@contextlib.contextmanager
def compile_lock(spec: KernelSpec, timeout: float | None = None):
    """Exclusive cross-process lock for compiling ``spec``; yields True if held, False if it timed out."""
    timeout = float(os.environ.get("XATTN_CACHE_LOCK_TIMEOUT", 600)) if timeout is None else timeout
    path = cache_dir() / ".locks" / f"{entry_stem(spec)}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError as exc:
        log.warning("xattn: no cache lock for %s (%s); compiling without it", path.name, exc)
        yield False
        return
    held = False
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                    log.warning("xattn: waited %.0f s for %s; compiling without the lock", timeout, path.name)
                    break
                time.sleep(0.05)
        yield held
    finally:
        if held:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def entries() -> list[dict]:
    """Every entry on disk: ``{"file", "bytes", **metadata}`` (metadata may be missing)."""
    out = []
    directory = cache_dir()
    if not directory.is_dir():
        return out
    for obj in sorted(directory.glob("*.o")):
        if obj.name.startswith("."):
            continue  # a temporary being written
        meta = {}
        with contextlib.suppress(OSError, ValueError):
            meta = json.loads(obj.with_suffix(".json").read_text())
        out.append(dict(file=obj.name, bytes=obj.stat().st_size, **meta))
    return out


# xattn's own file names: entries "<spec short name>-<20 hex>.{o,so,json}", their temporaries
# (".<stem>.<pid>[.<ns>].tmp[.o|.so|.json]", ".<stem>.so.<pid>.tmp") and locks ("<stem>.lock").
_STEM = r"(?:ffpa|fa4)_(?:fwd|bwd)_\w+-[0-9a-f]{20}"
_OWN_FILE = re.compile(rf"^(?:{_STEM}\.(?:o|so|json)|\.{_STEM}\.[\w.]*tmp(?:\.(?:o|so|json))?)$")
_OWN_LOCK = re.compile(rf"^{_STEM}\.lock$")


def clear() -> int:
    """Delete xattn's entries (and stale temporaries/locks) and nothing else in the directory;
    returns the number of entries removed."""
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    n = 0
    for path in [p for p in directory.iterdir() if p.is_file() and _OWN_FILE.match(p.name)]:
        with contextlib.suppress(OSError):
            path.unlink()
            n += path.suffix == ".o" and not path.name.startswith(".")
    locks = directory / ".locks"
    for lock in [p for p in locks.iterdir() if _OWN_LOCK.match(p.name)] if locks.is_dir() else ():
        with contextlib.suppress(OSError):
            lock.unlink()
    return n
