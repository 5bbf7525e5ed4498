"""Compile-once launcher cache, keyed by :class:`KernelSpec`, safe across threads.

Two threads asking for the same key compile it once (a per-key lock); different keys
compile in parallel. The cache keeps the compiled CuTeDSL object alive (it owns the
loaded module) next to the raw positional ``tvm_ffi.Function`` used for launches.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .device import prepare_dsl_environment
from .spec import KernelSpec, supports

__all__ = ["Launcher", "get_launcher", "cached_specs", "clear", "set_compiler"]

log = logging.getLogger("xattn")


@dataclass(frozen=True)
class Launcher:
    """A compiled launcher: ``function(*tensors, *scalars)`` enqueues on the TVM-FFI env stream."""

    spec: KernelSpec
    function: Any  # tvm_ffi.Function, positional
    owner: Any  # the CuTeDSL compiled object that keeps the module loaded
    compile_seconds: float


_lock = threading.Lock()
_entries: dict[KernelSpec, Launcher] = {}
_key_locks: dict[KernelSpec, threading.Lock] = {}
_compiler: Callable[[KernelSpec], Any] | None = None


def _default_compiler(spec: KernelSpec):
    arch = prepare_dsl_environment()
    if arch != spec.arch:
        raise NotImplementedError(
            f"{spec.short_name()}: this process compiles for {arch} (CUTE_DSL_ARCH / the GPU), "
            f"but the launcher targets {spec.arch}")
    from .symbolic import check_dsl_arch

    check_dsl_arch(spec.arch)
    if spec.family == "ffpa":
        from .ffpa_sm90 import compile_ffpa
        return compile_ffpa(spec)
    from .fa4_sm90 import compile_fa4
    return compile_fa4(spec)


def set_compiler(fn: Callable[[KernelSpec], Any] | None) -> None:
    """Replace the compile function (tests use a recording stub); ``None`` restores the default."""
    global _compiler
    _compiler = fn


def get_launcher(spec: KernelSpec) -> Launcher:
    """Return the launcher for ``spec``, compiling it on first use."""
    entry = _entries.get(spec)
    if entry is not None:
        return entry
    reason = supports(spec)
    if reason is not None:
        raise NotImplementedError(reason)
    with _lock:
        key_lock = _key_locks.setdefault(spec, threading.Lock())
    with key_lock:
        entry = _entries.get(spec)
        if entry is not None:
            return entry
        log.info("xattn: compiling %s", spec.short_name())
        t0 = time.perf_counter()
        owner = (_compiler or _default_compiler)(spec)
        seconds = time.perf_counter() - t0
        function = getattr(owner, "_tvm_ffi_function", None) or owner
        entry = Launcher(spec, function, owner, seconds)
        log.info("xattn: compiled %s in %.1f s", spec.short_name(), seconds)
        _entries[spec] = entry
        return entry


def cached_specs() -> list[KernelSpec]:
    """Specs compiled in this process so far."""
    return list(_entries)


def clear() -> None:
    """Forget every compiled launcher of this process."""
    with _lock:
        _entries.clear()
        _key_locks.clear()
