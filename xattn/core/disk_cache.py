"""Persistent launcher cache: compiled launchers exported as object files, loaded by later processes.

Location: ``XATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/xattn`` (``~/.cache/xattn``). On by
default; ``XATTN_CACHE=0`` turns it off. One entry per compile key, three files:

- ``<name>-<digest>.o``: the ``export_to_c`` object;
- ``<name>-<digest>.so``: the same linked into a shared library when a C compiler is available
  (it loads through ``tvm_ffi.load_module`` in milliseconds, without importing cutlass);
- ``<name>-<digest>.json``: what the entry is (for ``cache list``) and the size and SHA-256 of
  the other two.

The digest in the name covers the :class:`KernelSpec` (which holds the library versions and
the arch), the Python minor version, the machine and a fingerprint of xattn's launcher sources.

**What is trusted.** An entry is machine code that ``dlopen`` maps into the process, so xattn
loads only files that you (the effective user) or root could have written:

- The directory is created private (``0700``). The default directory, when it is yours but
  open wider (an older xattn, umask 002), is tightened to ``0700``. An ``XATTN_CACHE_DIR``
  is never chmod-ed: it is the user's choice.
- A directory that is not owned by you or root, or that group or others can write (sticky
  bit or not), is not used at all: one warning, then every kernel is compiled in memory.
  The fix is ``chmod 700 DIR`` or a private ``XATTN_CACHE_DIR``. A cache shared by several
  users is therefore not supported; a read-only one prefilled by root is.
- Every file of an entry must be a regular file (not a symlink), owned by you or root, not
  writable by group or others, with the size and SHA-256 its ``.json`` records; the
  ``.json`` must describe this very key. Anything else is refused with a warning and the
  entry is rebuilt (and replaced on disk when the directory is writable). The checks read
  the files through the descriptor they ``fstat``, right before loading and under the
  entry lock (below), in a directory only you can write: a damaged or foreign file never
  reaches ``dlopen``.
- As root, "you" is root: a directory or entry owned by another user is refused (loading
  it would run that user's code as root).
- The parents of the cache directory are not checked: whoever can rename them can replace
  the directory itself. Keep it under a directory only you can write (``$HOME``, or a
  sticky ``/tmp``).

**Corruption.** A truncated or corrupt ``.o``, a missing, unparsable or wrong ``.json``, or a
refused file: warning ("unusable"), the key is recompiled and the entry rewritten. A bad
``.so`` next to a good ``.o`` is relinked from the verified ``.o`` instead (where that fails,
the entry is rewritten without its ``.so`` and loads through cutlass).

**Read-only or full directory.** The first write that fails for lack of permission or space
(``EROFS``, ``EACCES``, ``EPERM``, ``ENOSPC``, ``EDQUOT``; or an exporter's own error while
the file system has under 1 MiB free), or a directory that cannot be created, warns once;
from then on the process writes nothing there (no entries, no locks), compiles what it
misses in memory and still loads the good entries already there.

**Races.** Threads: one compile per key (:mod:`xattn.core.cache`). Processes: an exclusive
``flock`` on ``.locks/<stem>.lock`` makes concurrent processes (e.g. 8 ranks) compile a key
once while the others wait and load it. A lock not granted within
``XATTN_CACHE_LOCK_TIMEOUT`` seconds (default 600) is skipped: the process compiles on its own
(at worst duplicated work, never a bad file). Files are written under temporary names and
committed by renames (the ``.json`` last) under a short per-key lock,
``.locks/<stem>.entry.lock``: exclusive to commit or remove, shared to check and load, so a
reader sees a whole entry or none, even next to a writer that skipped the compile lock.
The first look for an entry takes no compile lock and writes nothing (a flaw is a silent
miss); the look under the compile lock reports flaws, and only the lock's holder repairs
(removes, relinks) an entry. Lock files are created ``0600`` inside the private directory
and opened read-only (``flock`` needs no write access), so no other user can take, fake or
bypass them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from .spec import KernelSpec

__all__ = ["enabled", "cache_dir", "entry_stem", "load", "store", "compile_lock", "entries", "clear"]

log = logging.getLogger("xattn")
EXPORT_NAME = "xattn_launcher"
_LAUNCHER_SOURCES = ("symbolic.py", "ffpa_sm90.py", "fa4_sm90.py", "disk_cache.py")
_FORMAT = 1  # of the .json sidecar
# Errors that mean "this directory takes no more writes": stop writing there, warn once.
_UNWRITABLE = {errno.EROFS: "read-only", errno.EACCES: "not writable", errno.EPERM: "not writable",
               errno.ENOSPC: "full", errno.EDQUOT: "over its disk quota"}
_ENTRY_LOCK_TIMEOUT = 60.0  # commit/check sections last milliseconds; a stuck holder is skipped

_state_lock = threading.Lock()
_no_writes: set[str] = set()  # directories this process stopped writing to
_warned: set[tuple] = set()
_serial = itertools.count()  # temporaries: unique per process and thread


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


# ----------------------------------------------------------------------------- trust and state


def _warn_once(key: tuple, msg: str, *args) -> None:
    with _state_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def _untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory with this status could hold someone else's code, or None."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by uid {st.st_uid}, not by you (uid {me}) or root"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


def _writes_off(directory: Path) -> bool:
    return str(directory) in _no_writes


def _unwritable(exc: BaseException) -> int | None:
    """The errno if ``exc`` (or what caused it) says the directory takes no more writes."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def _stop_writing(directory: Path, exc: BaseException, what: str = "") -> None:
    code = _unwritable(exc)
    state = _UNWRITABLE[code] if code is not None else "unusable for writing"
    detail = f"{what}: {_first_line(exc) or type(exc).__name__}" if what else _first_line(exc) or type(exc).__name__
    with _state_lock:
        _no_writes.add(str(directory))
    _warn_once(("no-writes", str(directory)),
               "xattn: kernel cache directory %s is %s (%s); kernels compiled from now on stay in memory "
               "for this process (existing entries still load)", directory, state, detail)


def _make_private_dir(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def _usable_dir(create: bool) -> Path | None:
    """The cache directory if entries may be loaded from it (and, with ``create``, written to it).

    ``None`` when it is missing (and not created) or not trusted (warned once)."""
    directory = cache_dir()
    if create and not _writes_off(directory):
        try:
            _make_private_dir(directory)
        except OSError as exc:
            _stop_writing(directory, exc, "cannot create it")
    try:
        problem = _dir_problem(directory)
    except FileNotFoundError:
        return None
    if problem:
        _warn_once(("untrusted", str(directory)),
                   "xattn: not using kernel cache directory %s: %s. Kernels are compiled in memory for this "
                   "process; make it private (chmod 700, owned by you) or point XATTN_CACHE_DIR elsewhere",
                   directory, problem)
        return None
    return directory


def _dir_problem(directory: Path) -> str | None:
    try:
        st = os.stat(directory)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise  # a plain miss
        return f"cannot stat it ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if st.st_mode & 0o077 and st.st_uid == os.geteuid() and not os.environ.get("XATTN_CACHE_DIR"):
        with contextlib.suppress(OSError):  # the default directory is xattn's own: make it private
            os.chmod(directory, 0o700)
            log.info("xattn: made the kernel cache directory %s private (was %03o)", directory, st.st_mode & 0o777)
            st = os.stat(directory)
    return _untrusted(st)


def _flock(fd: int, op: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() >= deadline:
                return False
            time.sleep(0.02)


def _open_lock(path: Path, create: bool) -> int:
    # O_RDONLY is enough for flock; 0600 in a 0700 directory: only this user takes these locks.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    return os.open(path, flags, 0o600)


@contextlib.contextmanager
def _entry_lock(stem: Path, exclusive: bool):
    """Short per-key lock around committing/removing (exclusive) or checking+loading (shared) files."""
    path = stem.parent / ".locks" / f"{stem.name}.entry.lock"
    writable = not _writes_off(stem.parent)
    try:
        if writable:
            with contextlib.suppress(OSError):
                _make_private_dir(path.parent)
        fd = _open_lock(path, create=writable)
    except OSError:
        # No lock file in a directory that takes no writes: there is no writer to exclude.
        yield
        return
    try:
        if not _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, _ENTRY_LOCK_TIMEOUT):
            log.warning("xattn: %s held for %.0f s; going on without it", path.name, _ENTRY_LOCK_TIMEOUT)
        yield
    finally:
        os.close(fd)  # releases the flock


# ----------------------------------------------------------------------------- checking entries


class _Unusable(Exception):
    """An entry file that must not be loaded; the message says why."""


def _read_checked(path: Path) -> bytes:
    """The bytes of an entry file after the trust checks on its open descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO must not block)
    except FileNotFoundError:
        raise _Unusable(f"{path.suffix} missing") from None
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        raise _Unusable(f"{path.suffix} {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _Unusable(f"{path.suffix} is not a regular file")
        problem = _untrusted(st)
        if problem:
            raise _Unusable(f"{path.suffix} is {problem}")
        return f.read()


def _file_record(data: bytes) -> dict:
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _check_file(path: Path, record) -> bytes:
    data = _read_checked(path)
    record = record if isinstance(record, dict) else {}
    if record.get("bytes") != len(data):
        raise _Unusable(f"{path.suffix} has {len(data)} bytes, its .json says {record.get('bytes')}")
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        raise _Unusable(f"{path.suffix} does not match the SHA-256 in its .json")
    return data


def _check_meta(stem: Path, spec: KernelSpec) -> dict:
    try:
        meta = json.loads(_read_checked(stem.with_suffix(".json")))
    except ValueError as exc:
        raise _Unusable(f".json unreadable ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise _Unusable(".json is not in this cache's format")
    if meta.get("stem") != stem.name or meta.get("spec") != json.loads(json.dumps(_spec_dict(spec))):
        raise _Unusable(".json describes another kernel")
    files = meta.get("files")
    if not isinstance(files, dict) or ".o" not in files or not set(files) <= {".o", ".so"}:
        raise _Unusable(".json lists no object file")
    return meta


# ----------------------------------------------------------------------------- loading


def _open_shared(path: str):
    """``(module, function)`` of a verified ``.so`` entry (tests replace it)."""
    import tvm_ffi

    module = tvm_ffi.load_module(path)
    return module, module[EXPORT_NAME]


def _open_object(path: str):
    """``(module, function)`` of a verified ``.o`` entry, through cutlass (tests replace it)."""
    _preload_runtime()
    import cutlass.cute as cute

    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    return module, getattr(module, EXPORT_NAME)


@functools.cache
def _preload_runtime() -> None:
    # Exported objects reference symbols of the CuTeDSL runtime libraries; make them globally
    # visible before dlopen-ing an entry in a process that has compiled nothing yet.
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def _load_shared(lib: Path):
    """``(module, function)`` from a verified ``.so``, preloading the runtime if its rpath is foreign; else None."""
    for attempt in ("as is", "runtime preloaded"):
        try:
            if attempt == "runtime preloaded":
                _preload_runtime()
            hit = _open_shared(str(lib))
            if attempt != "as is":
                log.info("xattn: cache entry %s loaded (%s)", lib.stem, attempt)
            return hit
        except Exception as exc:  # noqa: BLE001 - the next attempt, then the .o, decide
            log.info("xattn: %s did not load %s (%s)", lib.name, attempt, _first_line(exc))
    return None


def load(spec: KernelSpec, *, report: bool = False, repair: bool = False):
    """``(module, function)`` from disk, or ``None`` on a miss.

    Without ``report`` this is the quick look: any flaw is a silent miss (the caller looks again
    under the compile lock). With ``report`` a flawed entry is logged; with ``repair`` (only for
    the holder of the compile lock) it is removed, or its ``.so`` relinked from the verified
    ``.o``. The ``.so`` form is tried first (no cutlass import); an entry filled on another
    machine, whose runtime rpath does not exist here, loads once the runtime is preloaded."""
    directory = _usable_dir(create=False)
    if directory is None:
        return None
    stem = directory / entry_stem(spec)
    with _entry_lock(stem, exclusive=False):
        hit, problem, good_object = _load_checked(stem, spec, object_fallback=report and not repair)
    if hit is not None or problem is None or not report:
        return hit
    if good_object is not None:  # only the .so is bad (and we may repair)
        log.warning("xattn: cache entry %s is unusable (%s); relinking it from its .o", stem.name, problem)
        return _relink(stem, *good_object) or load(spec, report=True)
    log.warning("xattn: cache entry %s is unusable (%s); recompiling it", stem.name, problem)
    if repair and not _writes_off(directory):
        _remove(stem)
    return None


def _load_checked(stem: Path, spec: KernelSpec, object_fallback: bool):
    """``(hit, problem, good_object)``: a loaded entry; else why not (None: a plain miss) and, when
    only the ``.so`` is bad, ``(meta, object bytes)`` to relink it from."""
    obj, lib = stem.with_suffix(".o"), stem.with_suffix(".so")
    if not obj.exists() and not os.path.lexists(stem.with_suffix(".json")):
        return None, None, None
    try:
        meta = _check_meta(stem, spec)
        obj_data = _check_file(obj, meta["files"][".o"])
        if ".so" not in meta["files"]:
            return _open_object(str(obj)), None, None
        try:
            _check_file(lib, meta["files"][".so"])
            hit = _load_shared(lib)
            problem = None if hit is not None else ".so does not load"
        except _Unusable as exc:
            hit, problem = None, str(exc)
        if hit is not None:
            return hit, None, None
        if not object_fallback:
            return None, problem, (meta, obj_data)
        log.warning("xattn: cache entry %s is unusable (%s); loading its .o", stem.name, problem)
        return _open_object(str(obj)), None, None
    except _Unusable as exc:
        return None, str(exc), None
    except Exception as exc:  # noqa: BLE001 - a loader refused a verified file (say, a foreign build)
        return None, f"{type(exc).__name__}: {_first_line(exc)}", None


def _relink(stem: Path, meta: dict, obj_data: bytes):
    """Rewrite the entry from the verified object bytes with a ``.so`` linked here; its ``(module,
    function)``, or None (the entry is then rewritten without a ``.so``)."""
    tmp = _temporary(stem.parent, stem.name)
    try:
        _write_new(tmp + ".o", obj_data)
        linked = _link_shared(tmp + ".o", tmp + ".so")
        hit = _load_shared(Path(tmp + ".so")) if linked else None
        files = {".o": _file_record(obj_data)}
        if hit is not None:
            files[".so"] = _file_record(Path(tmp + ".so").read_bytes())
        _write_new(tmp + ".json", json.dumps(dict(meta, files=files, shared_library=hit is not None), indent=1))
        _commit(stem, tmp, files)
        return hit
    except Exception as exc:  # noqa: BLE001 - the caller falls back to the .o
        _cleanup(tmp)
        if _unwritable(exc) is not None:
            _stop_writing(stem.parent, exc, "relinking")
        else:
            log.warning("xattn: could not relink %s (%s)", stem.name, exc)
        return None


def _remove(stem: Path) -> None:
    with _entry_lock(stem, exclusive=True):
        for suffix in (".json", ".o", ".so"):  # the .json first: the entry stops existing at once
            with contextlib.suppress(OSError):
                stem.with_suffix(suffix).unlink()


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0][:200] if text else ""


# ----------------------------------------------------------------------------- writing


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


def _temporary(directory: Path, stem: str) -> str:
    return str(directory / f".{stem}.{os.getpid()}.{next(_serial)}.tmp")


def _write_new(path: str, data) -> None:
    data = data.encode() if isinstance(data, str) else data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _commit(stem: Path, tmp: str, files: dict) -> None:
    """Rename the temporaries into place, the ``.json`` last, under the exclusive entry lock."""
    for suffix in (*files, ".json"):
        os.chmod(tmp + suffix, stat.S_IMODE(os.stat(tmp + suffix).st_mode) & ~0o022)  # e.g. umask 002
    with _entry_lock(stem, exclusive=True):
        if ".so" not in files:
            with contextlib.suppress(FileNotFoundError):
                stem.with_suffix(".so").unlink()
        for suffix in (*(s for s in (".so", ".o") if s in files), ".json"):
            os.replace(tmp + suffix, stem.with_suffix(suffix))


def _cleanup(tmp: str) -> None:
    for suffix in (".o", ".so", ".json"):
        with contextlib.suppress(OSError):
            os.unlink(tmp + suffix)


def store(spec: KernelSpec, compiled, compile_seconds: float) -> Path | None:
    """Export ``compiled`` atomically; returns the entry path, or ``None`` if it was not written."""
    export = getattr(compiled, "export_to_c", None)
    if export is None:
        return None
    directory = _usable_dir(create=True)
    if directory is None or _writes_off(directory):
        return None
    stem = entry_stem(spec)
    tmp = _temporary(directory, stem)
    try:
        export(tmp + ".o", function_name=EXPORT_NAME)
        files = {".o": _file_record(Path(tmp + ".o").read_bytes())}
        if _link_shared(tmp + ".o", tmp + ".so"):
            files[".so"] = _file_record(Path(tmp + ".so").read_bytes())
        meta = dict(format=_FORMAT, stem=stem, spec=_spec_dict(spec), files=files,
                    compile_seconds=round(compile_seconds, 2), created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    python=platform.python_version(), machine=platform.machine(), pid=os.getpid(),
                    shared_library=".so" in files)
        _write_new(tmp + ".json", json.dumps(meta, indent=1))
        _commit(directory / stem, tmp, files)
        return directory / f"{stem}.o"
    except Exception as exc:  # noqa: BLE001 - a failed export never fails the call: the kernel runs from memory
        _cleanup(tmp)
        if _unwritable(exc) is not None:
            _stop_writing(directory, exc)
        elif _full(directory):
            _stop_writing(directory, OSError(errno.ENOSPC, f"{type(exc).__name__}: {_first_line(exc)}"))
        else:
            log.warning("xattn: could not write cache entry %s (%s: %s)", stem, type(exc).__name__, _first_line(exc))
        return None


def _full(directory: Path) -> bool:
    """Whether the file system has (almost) no room left: exporters do not always raise OSError."""
    with contextlib.suppress(OSError):
        st = os.statvfs(directory)
        return st.f_bavail * st.f_frsize < (1 << 20)
    return False


def _spec_dict(spec: KernelSpec) -> dict:
    d = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    d["versions"] = dict(spec.versions)
    return d


@contextlib.contextmanager
def compile_lock(spec: KernelSpec, timeout: float | None = None):
    """Exclusive cross-process lock for compiling ``spec``; yields True if held, False if not
    (timed out, or the directory is untrusted or takes no writes)."""
    timeout = float(os.environ.get("XATTN_CACHE_LOCK_TIMEOUT", 600)) if timeout is None else timeout
    directory = _usable_dir(create=True)
    if directory is None or _writes_off(directory):
        yield False
        return
    path = directory / ".locks" / f"{entry_stem(spec)}.lock"
    try:
        _make_private_dir(path.parent)
        fd = _open_lock(path, create=True)
    except OSError as exc:
        if _unwritable(exc) is not None:
            _stop_writing(directory, exc, "no lock file")
        else:
            log.warning("xattn: no cache lock for %s (%s); compiling without it", path.name, exc)
        yield False
        return
    try:
        held = _flock(fd, fcntl.LOCK_EX, timeout)
        if not held:
            log.warning("xattn: no lock on %s within %.0f s; compiling without it", path.name, timeout)
        yield held
    finally:
        os.close(fd)  # releases the flock


# ----------------------------------------------------------------------------- listing, clearing


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
        if not isinstance(meta, dict):
            meta = {}
        meta.pop("file", None)
        out.append(dict(file=obj.name, bytes=obj.stat().st_size, **meta))
    return out


# xattn's own file names: entries "<spec short name>-<20 hex>.{o,so,json}", their temporaries
# (".<stem>.<pid>.<ns>.tmp.{o,so,json}", older ".<stem>.so.<pid>.tmp") and locks
# ("<stem>.lock", "<stem>.entry.lock").
_STEM = r"(?:ffpa|fa4)_(?:fwd|bwd)_\w+-[0-9a-f]{20}"
_OWN_FILE = re.compile(rf"^(?:{_STEM}\.(?:o|so|json)|\.{_STEM}\.[\w.]*tmp(?:\.(?:o|so|json))?)$")
_OWN_LOCK = re.compile(rf"^{_STEM}(?:\.entry)?\.lock$")


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
