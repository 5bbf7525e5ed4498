"""File locks of the disk cache: ``flock`` on ``<cache dir>/.locks/<stem>[.entry].lock``.

Two locks per entry ``<stem>`` (see "Races" in :mod:`xattn.core.disk_cache`):

- :func:`compile_lock` (``<stem>.lock``, exclusive, held for a whole compile, up to a timeout):
  concurrent processes compile a key once while the others wait and load it;
- :func:`entry_lock` (``<stem>.entry.lock``, held for milliseconds): exclusive to commit or
  remove an entry's files, shared to check and load them, so a reader sees a whole entry or none.

Lock files are created ``0600`` inside the private directory and opened read-only (``flock``
needs no write access), so no other user can take, fake or bypass them. A lock not granted in
time is skipped with a warning: at worst duplicated work, never a bad file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from pathlib import Path

from .cache_trust import make_private_dir, stop_writing, unwritable, writes_off

__all__ = ["compile_lock", "entry_lock", "ENTRY_LOCK_TIMEOUT"]

log = logging.getLogger("xattn")
ENTRY_LOCK_TIMEOUT = 60.0  # commit/check sections last milliseconds; a stuck holder is skipped


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
def entry_lock(stem: Path, exclusive: bool):
    """Short per-key lock around committing/removing (exclusive) or checking+loading (shared) the
    files of the entry ``stem`` (``directory / name``); skipped where it cannot be had."""
    path = stem.parent / ".locks" / f"{stem.name}.entry.lock"
    writable = not writes_off(stem.parent)
    try:
        if writable:
            with contextlib.suppress(OSError):
                make_private_dir(path.parent)
        fd = _open_lock(path, create=writable)
    except OSError:
        # No lock file in a directory that takes no writes: there is no writer to exclude.
        yield
        return
    try:
        if not _flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, ENTRY_LOCK_TIMEOUT):
            log.warning("xattn: %s held for %.0f s; going on without it", path.name, ENTRY_LOCK_TIMEOUT)
        yield
    finally:
        os.close(fd)  # releases the flock


@contextlib.contextmanager
def compile_lock(stem: Path, timeout: float):
    """Exclusive cross-process lock for compiling the entry ``stem`` (``directory / name``, in a
    directory that takes writes); yields True if held, False if not (timed out, or no lock file:
    a directory that takes no more writes is then warned about once and written to no more)."""
    directory = stem.parent
    path = directory / ".locks" / f"{stem.name}.lock"
    try:
        make_private_dir(path.parent)
        fd = _open_lock(path, create=True)
    except OSError as exc:
        if unwritable(exc) is not None:
            stop_writing(directory, exc, "no lock file")
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
