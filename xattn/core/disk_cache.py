"""Persistent launcher cache: compiled launchers exported as object files, loaded by later processes.

Location: ``XATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/xattn`` (``~/.cache/xattn``). On by
default; ``XATTN_CACHE=0`` turns it off. One entry per compile key, three files:

- ``<name>-<digest>.o``: the ``export_to_c`` object;
- ``<name>-<digest>.so``: the same linked into a shared library when a C compiler is available
  (it loads through ``tvm_ffi.load_module`` in milliseconds, without importing cutlass);
- ``<name>-<digest>.json``: what the entry is (for ``cache list``) and the size and SHA-256 of
  the other two.

The digest in the name covers the :class:`KernelSpec` (which holds the library versions and
the arch), the Python minor version, the machine and a fingerprint of xattn's launcher sources (paged and
combine launchers: also their own module's).

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

**Modules.** This one stores, loads, lists and clears entries; the trust checks and the
directory's write state are :mod:`xattn.core.cache_trust`, the locks
:mod:`xattn.core.cache_lock`, the ``.so`` linking and the loaders :mod:`xattn.core.cache_link`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import itertools
import json
import logging
import os
import platform
import re
import stat
import sys
import time
from pathlib import Path

from . import cache_link, cache_lock
from .cache_trust import (Unusable, check_file, file_record, first_line, read_checked, stop_writing, unwritable,
                          usable_dir, writes_off)
from .spec import KernelSpec

__all__ = ["enabled", "cache_dir", "entry_stem", "load", "store", "compile_lock", "entries", "clear"]

log = logging.getLogger("xattn")
# What the entry names' digest fingerprints: the launcher sources and the cache's own code.
_LAUNCHER_SOURCES = ("symbolic.py", "ffpa_sm90.py", "fa4_sm90.py",
                     "disk_cache.py", "cache_trust.py", "cache_lock.py", "cache_link.py")
_FORMAT = 1  # of the .json sidecar
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


# Launchers built by a module of their own: its source joins their key (a GemmSpec carries its sources' digest).
_KIND_SOURCES = {"paged": ("paged_sm90.py",), "CombineSpec": ("combine_sm90.py", "split_kv.py"),
                 "PagedMetaSpec": ("paged_meta_sm90.py",),
                 "SplitMetaSpec": ("split_meta_sm90.py", "paged_meta_sm90.py"),
                 "SlotCallSpec": ("slot_call_sm90.py", "combine_sm90.py", "split_kv.py")}


@functools.cache
def _kind_fingerprint(kind: str) -> str:
    here = Path(__file__).resolve().parent
    return hashlib.sha256(b"".join((here / n).read_bytes() for n in _KIND_SOURCES[kind])).hexdigest()[:16]


def _spec_kind(spec) -> str | None:
    if getattr(spec, "page_size", None) is not None:
        return "paged"
    return type(spec).__name__ if type(spec).__name__ in _KIND_SOURCES else None


def entry_stem(spec: KernelSpec) -> str:
    """File name stem of ``spec``'s entry: readable name + digest of everything that changes the binary (the
    launcher sources; for paged and combine launchers also their own module's)."""
    kind = _spec_kind(spec)
    ident = (spec, sys.version_info[:2], platform.machine(), _source_fingerprint())
    ident = repr(ident + ((kind, _kind_fingerprint(kind)),) if kind else ident)
    return f"{spec.short_name()}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}"


# ----------------------------------------------------------------------------- loading


def _check_meta(stem: Path, spec: KernelSpec) -> dict:
    try:
        meta = json.loads(read_checked(stem.with_suffix(".json")))
    except ValueError as exc:
        raise Unusable(f".json unreadable ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise Unusable(".json is not in this cache's format")
    if meta.get("stem") != stem.name or meta.get("spec") != json.loads(json.dumps(_spec_dict(spec))):
        raise Unusable(".json describes another kernel")
    files = meta.get("files")
    if not isinstance(files, dict) or ".o" not in files or not set(files) <= {".o", ".so"}:
        raise Unusable(".json lists no object file")
    return meta


def load(spec: KernelSpec, *, report: bool = False, repair: bool = False):
    """``(module, function)`` from disk, or ``None`` on a miss.

    Without ``report`` this is the quick look: any flaw is a silent miss (the caller looks again
    under the compile lock). With ``report`` a flawed entry is logged; with ``repair`` (only for
    the holder of the compile lock) it is removed, or its ``.so`` relinked from the verified
    ``.o``. The ``.so`` form is tried first (no cutlass import); an entry filled on another
    machine, whose runtime rpath does not exist here, loads once the runtime is preloaded."""
    directory = usable_dir(cache_dir(), create=False)
    if directory is None:
        return None
    stem = directory / entry_stem(spec)
    with cache_lock.entry_lock(stem, exclusive=False):
        hit, problem, good_object = _load_checked(stem, spec, object_fallback=report and not repair)
    if hit is not None or problem is None or not report:
        return hit
    if good_object is not None:  # only the .so is bad (and we may repair)
        log.warning("xattn: cache entry %s is unusable (%s); relinking it from its .o", stem.name, problem)
        return _relink(stem, *good_object) or load(spec, report=True)
    log.warning("xattn: cache entry %s is unusable (%s); recompiling it", stem.name, problem)
    if repair and not writes_off(directory):
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
        obj_data = check_file(obj, meta["files"][".o"])
        if ".so" not in meta["files"]:
            return cache_link.open_object(str(obj)), None, None
        try:
            check_file(lib, meta["files"][".so"])
            hit = cache_link.load_shared(lib)
            problem = None if hit is not None else ".so does not load"
        except Unusable as exc:
            hit, problem = None, str(exc)
        if hit is not None:
            return hit, None, None
        if not object_fallback:
            return None, problem, (meta, obj_data)
        log.warning("xattn: cache entry %s is unusable (%s); loading its .o", stem.name, problem)
        return cache_link.open_object(str(obj)), None, None
    except Unusable as exc:
        return None, str(exc), None
    except Exception as exc:  # noqa: BLE001 - a loader refused a verified file (say, a foreign build)
        return None, f"{type(exc).__name__}: {first_line(exc)}", None


def _relink(stem: Path, meta: dict, obj_data: bytes):
    """Rewrite the entry from the verified object bytes with a ``.so`` linked here; its ``(module,
    function)``, or None (the entry is then rewritten without a ``.so``)."""
    tmp = _temporary(stem.parent, stem.name)
    try:
        _write_new(tmp + ".o", obj_data)
        linked = cache_link.link_shared(tmp + ".o", tmp + ".so")
        hit = cache_link.load_shared(Path(tmp + ".so")) if linked else None
        files = {".o": file_record(obj_data)}
        if hit is not None:
            files[".so"] = file_record(Path(tmp + ".so").read_bytes())
        _write_new(tmp + ".json", json.dumps(dict(meta, files=files, shared_library=hit is not None), indent=1))
        _commit(stem, tmp, files)
        return hit
    except Exception as exc:  # noqa: BLE001 - the caller falls back to the .o
        _cleanup(tmp)
        if unwritable(exc) is not None:
            stop_writing(stem.parent, exc, "relinking")
        else:
            log.warning("xattn: could not relink %s (%s)", stem.name, exc)
        return None


def _remove(stem: Path) -> None:
    with cache_lock.entry_lock(stem, exclusive=True):
        for suffix in (".json", ".o", ".so"):  # the .json first: the entry stops existing at once
            with contextlib.suppress(OSError):
                stem.with_suffix(suffix).unlink()


# ----------------------------------------------------------------------------- writing


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
    with cache_lock.entry_lock(stem, exclusive=True):
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
    directory = usable_dir(cache_dir(), create=True)
    if directory is None or writes_off(directory):
        return None
    stem = entry_stem(spec)
    tmp = _temporary(directory, stem)
    try:
        export(tmp + ".o", function_name=cache_link.EXPORT_NAME)
        files = {".o": file_record(Path(tmp + ".o").read_bytes())}
        if cache_link.link_shared(tmp + ".o", tmp + ".so"):
            files[".so"] = file_record(Path(tmp + ".so").read_bytes())
        meta = dict(format=_FORMAT, stem=stem, spec=_spec_dict(spec), files=files,
                    compile_seconds=round(compile_seconds, 2), created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    python=platform.python_version(), machine=platform.machine(), pid=os.getpid(),
                    shared_library=".so" in files)
        _write_new(tmp + ".json", json.dumps(meta, indent=1))
        _commit(directory / stem, tmp, files)
        return directory / f"{stem}.o"
    except Exception as exc:  # noqa: BLE001 - a failed export never fails the call: the kernel runs from memory
        _cleanup(tmp)
        if unwritable(exc) is not None:
            stop_writing(directory, exc)
        elif _full(directory):
            stop_writing(directory, OSError(errno.ENOSPC, f"{type(exc).__name__}: {first_line(exc)}"))
        else:
            log.warning("xattn: could not write cache entry %s (%s: %s)", stem, type(exc).__name__, first_line(exc))
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
    directory = usable_dir(cache_dir(), create=True)
    if directory is None or writes_off(directory):
        yield False
        return
    with cache_lock.compile_lock(directory / entry_stem(spec), timeout) as held:
        yield held


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
