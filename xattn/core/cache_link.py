"""Compiled objects of the disk cache as code: an exported ``.o`` linked into a ``.so``, and
either form loaded as ``(module, function)``.

The ``.so`` (:func:`link_shared`, when a C compiler is found) loads through
``tvm_ffi.load_module`` in milliseconds, without importing cutlass (:func:`load_shared`); the
``.o`` loads through cutlass (:func:`open_object`). Both find the launcher under
:data:`EXPORT_NAME`. Only files that passed :mod:`xattn.core.cache_trust` reach these loaders
(:mod:`xattn.core.disk_cache` checks them first); tests replace the ``open_*``, ``link_shared``
and ``preload_runtime`` functions of this module with fakes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import subprocess
from pathlib import Path

from .cache_trust import first_line

__all__ = ["EXPORT_NAME", "link_shared", "load_shared", "open_shared", "open_object", "preload_runtime"]

log = logging.getLogger("xattn")
EXPORT_NAME = "xattn_launcher"  # the function name an entry's object exports


def open_shared(path: str):
    """``(module, function)`` of a verified ``.so`` entry."""
    import tvm_ffi

    module = tvm_ffi.load_module(path)
    return module, module[EXPORT_NAME]


def open_object(path: str):
    """``(module, function)`` of a verified ``.o`` entry, through cutlass."""
    preload_runtime()
    import cutlass.cute as cute

    module = cute.runtime.load_module(path, enable_tvm_ffi=True)
    return module, getattr(module, EXPORT_NAME)


@functools.cache
def preload_runtime() -> None:
    """Make the CuTeDSL runtime libraries globally visible (once per process).

    Exported objects reference their symbols; an entry dlopen-ed in a process that has compiled
    nothing yet, or a ``.so`` whose rpath does not exist here, needs them loaded first."""
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=False):
        if Path(lib).exists():
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)


def load_shared(lib: Path):
    """``(module, function)`` from a verified ``.so``, preloading the runtime if its rpath is foreign; else None."""
    for attempt in ("as is", "runtime preloaded"):
        try:
            if attempt == "runtime preloaded":
                preload_runtime()
            hit = open_shared(str(lib))
            if attempt != "as is":
                log.info("xattn: cache entry %s loaded (%s)", lib.stem, attempt)
            return hit
        except Exception as exc:  # noqa: BLE001 - the next attempt, then the .o, decide
            log.info("xattn: %s did not load %s (%s)", lib.name, attempt, first_line(exc))
    return None


def link_shared(obj: str, out: str, rpath: bool = True) -> bool:
    """Link the exported object ``obj`` into the shared library ``out`` against the CuTeDSL runtime
    (its directories as rpath unless ``rpath=False``); False where no C compiler is found or the
    link fails (the entry then loads through cutlass)."""
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
