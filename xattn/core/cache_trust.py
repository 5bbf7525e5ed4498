"""Trust checks of the disk cache: which directory it may use, which entry files it may load.

An entry is machine code that ``dlopen`` maps into the process, so :mod:`xattn.core.disk_cache`
(whose docstring states the whole contract) uses only a directory, and loads only files, that
the effective user or root could have written. This module holds those checks and the state
behind them: the directories this process stopped writing to (read-only, full) and the
warnings already given (each once per process).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import stat
import threading
from pathlib import Path

__all__ = ["Unusable", "untrusted", "usable_dir", "make_private_dir", "writes_off", "unwritable", "stop_writing",
           "read_checked", "check_file", "file_record", "warn_once", "first_line"]

log = logging.getLogger("xattn")
# Errors that mean "this directory takes no more writes": stop writing there, warn once.
_UNWRITABLE = {errno.EROFS: "read-only", errno.EACCES: "not writable", errno.EPERM: "not writable",
               errno.ENOSPC: "full", errno.EDQUOT: "over its disk quota"}

_state_lock = threading.Lock()
_no_writes: set[str] = set()  # directories this process stopped writing to
_warned: set[tuple] = set()


def warn_once(key: tuple, msg: str, *args) -> None:
    """Log the warning ``msg % args`` unless one with the same ``key`` was logged by this process."""
    with _state_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 200 characters ("" when it has none)."""
    text = str(exc)
    return text.splitlines()[0][:200] if text else ""


# ----------------------------------------------------------------------------- the directory


def untrusted(st: os.stat_result) -> str | None:
    """Why a file or directory with this status could hold someone else's code, or None."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by uid {st.st_uid}, not by you (uid {me}) or root"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


def writes_off(directory: Path) -> bool:
    """Whether this process stopped writing to ``directory`` (:func:`stop_writing`)."""
    return str(directory) in _no_writes


def unwritable(exc: BaseException) -> int | None:
    """The errno if ``exc`` (or what caused it) says the directory takes no more writes."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in _UNWRITABLE:
            return exc.errno
        exc = exc.__cause__ or exc.__context__
    return None


def stop_writing(directory: Path, exc: BaseException, what: str = "") -> None:
    """Write nothing more to ``directory`` in this process, because of ``exc`` (while doing ``what``);
    warns once per directory."""
    code = unwritable(exc)
    state = _UNWRITABLE[code] if code is not None else "unusable for writing"
    detail = f"{what}: {first_line(exc) or type(exc).__name__}" if what else first_line(exc) or type(exc).__name__
    with _state_lock:
        _no_writes.add(str(directory))
    warn_once(("no-writes", str(directory)),
              "xattn: kernel cache directory %s is %s (%s); kernels compiled from now on stay in memory "
              "for this process (existing entries still load)", directory, state, detail)


def make_private_dir(path: Path) -> None:
    """Create ``path`` (``0700``) and its missing parents; an existing one is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)


def usable_dir(directory: Path, create: bool) -> Path | None:
    """``directory`` if entries may be loaded from it (and, with ``create``, written to it).

    ``None`` when it is missing (and not created) or not trusted (warned once)."""
    if create and not writes_off(directory):
        try:
            make_private_dir(directory)
        except OSError as exc:
            stop_writing(directory, exc, "cannot create it")
    try:
        problem = _dir_problem(directory)
    except FileNotFoundError:
        return None
    if problem:
        warn_once(("untrusted", str(directory)),
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
    return untrusted(st)


# ----------------------------------------------------------------------------- entry files


class Unusable(Exception):
    """An entry file that must not be loaded; the message says why."""


def read_checked(path: Path) -> bytes:
    """The bytes of an entry file after the trust checks on its open descriptor; raises
    :class:`Unusable` for a missing, unreadable, special or untrusted file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)  # (a FIFO must not block)
    except FileNotFoundError:
        raise Unusable(f"{path.suffix} missing") from None
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be read ({exc.strerror})"
        raise Unusable(f"{path.suffix} {why}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Unusable(f"{path.suffix} is not a regular file")
        problem = untrusted(st)
        if problem:
            raise Unusable(f"{path.suffix} is {problem}")
        return f.read()


def file_record(data: bytes) -> dict:
    """What an entry's ``.json`` records of one of its files: ``{"bytes", "sha256"}``."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def check_file(path: Path, record) -> bytes:
    """The bytes of an entry file that passes :func:`read_checked` and matches its ``record``
    (:func:`file_record`); raises :class:`Unusable` otherwise."""
    data = read_checked(path)
    record = record if isinstance(record, dict) else {}
    if record.get("bytes") != len(data):
        raise Unusable(f"{path.suffix} has {len(data)} bytes, its .json says {record.get('bytes')}")
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        raise Unusable(f"{path.suffix} does not match the SHA-256 in its .json")
    return data
