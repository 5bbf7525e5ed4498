"""Compile-once launcher cache, keyed by :class:`KernelSpec`, safe across threads and processes.

Two threads asking for the same key compile it once (a per-key lock); different keys
compile in parallel. Behind the in-memory cache sits the disk cache
(:mod:`xattn.core.disk_cache`): later processes load instead of compiling. The cache keeps
the compiled CuTeDSL object (or loaded module) alive next to the raw positional
``tvm_ffi.Function`` used for launches.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import disk_cache
from .device import cuda_gpus
from .spec import KernelSpec, supports
from .paged import PagedMetaSpec
from .split_kv import CombineSpec, SlotCallSpec, SplitFwdSpec, SplitMetaSpec

__all__ = ["Launcher", "get_launcher", "cached_specs", "clear", "set_compiler"]

log = logging.getLogger("xattn")


@dataclass(frozen=True)
class Launcher:
    """A compiled launcher: ``function(*tensors, *scalars)`` enqueues on the TVM-FFI env stream."""

    spec: KernelSpec
    function: Any  # tvm_ffi.Function, positional
    owner: Any  # the CuTeDSL compiled object or loaded module that keeps the code alive
    seconds: float  # time to get it: compile (+ export) or disk load
    source: str  # "compiled" or "disk"


_lock = threading.Lock()
_entries: dict[KernelSpec, Launcher] = {}
_key_locks: dict[KernelSpec, threading.Lock] = {}
_compiler: Callable[[KernelSpec], Any] | None = None


def _default_compiler(spec: KernelSpec):
    from .symbolic import check_dsl_arch  # importing it pins the DSL target first

    check_dsl_arch(spec.arch)
    if isinstance(spec, CombineSpec):  # the split-KV route's merge (xattn.core.split_kv)
        from .combine_sm90 import compile_combine
        return compile_combine(spec)
    if isinstance(spec, SlotCallSpec):  # the slot launch and the combine as one host function (xattn.core.split_kv)
        from .slot_call_sm90 import compile_slot_call
        return compile_slot_call(spec)
    if isinstance(spec, PagedMetaSpec):  # the paged split route's index kernel (xattn.core.paged)
        from .paged_meta_sm90 import compile_paged_meta
        return compile_paged_meta(spec)
    if isinstance(spec, SplitMetaSpec):  # the contiguous split route's index kernel (xattn.core.split_kv)
        from .split_meta_sm90 import compile_split_meta
        return compile_split_meta(spec)
    if isinstance(spec, SplitFwdSpec) and spec.shared_q:  # FA4's split launch on q as it is (xattn.core.split_kv)
        from .split_q_sm90 import compile_shared_q
        return compile_shared_q(spec)
    if not isinstance(spec, KernelSpec):  # a GEMM of the chunked backward (xattn.core.gemm_sm90.GemmSpec)
        from .gemm_sm90 import compile_gemm
        return compile_gemm(spec)
    if spec.page_size is not None:  # a paged KV cache's forward (xattn.core.paged_sm90)
        from .paged_sm90 import compile_paged
        return compile_paged(spec)
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
    """Return the launcher for ``spec`` (a KernelSpec, or a GemmSpec of the chunked backward),
    compiling it on first use."""
    entry = _entries.get(spec)
    if entry is not None:
        return entry
    reason = supports(spec) if isinstance(spec, KernelSpec) else None
    if reason is not None:
        raise NotImplementedError(reason)
    with _lock:
        key_lock = _key_locks.setdefault(spec, threading.Lock())
    with key_lock:
        entry = _entries.get(spec)
        if entry is None:
            entry = _prepare(spec)
            _entries[spec] = entry
        return entry


def _check_gpu_arch(spec: KernelSpec) -> None:
    gpus = cuda_gpus()
    if gpus and not any(g.arch == spec.arch for g in gpus):
        found = ", ".join(f"{g.name} ({g.arch})" for g in gpus)
        raise NotImplementedError(f"{spec.short_name()}: xattn ships {spec.arch} kernels; this machine has {found}")


def _prepare(spec: KernelSpec) -> Launcher:
    """Load ``spec`` from the disk cache, or compile (once across processes) and store it."""
    _check_gpu_arch(spec)
    t0 = time.perf_counter()
    use_disk = disk_cache.enabled() and _compiler is None
    if use_disk:
        hit = disk_cache.load(spec)  # the quick look: any flaw is a miss, looked at again below
        if hit is None:
            with disk_cache.compile_lock(spec) as held:
                # Another process may have compiled it meanwhile; a flawed entry is reported here,
                # and repaired only by the lock holder.
                hit = disk_cache.load(spec, report=True, repair=held)
                if hit is None:
                    return _compile(spec, t0, store=True)
        module, function = hit
        seconds = time.perf_counter() - t0
        log.info("xattn: loaded %s from %s in %.2f s", spec.short_name(), disk_cache.cache_dir(), seconds)
        return Launcher(spec, function, module, seconds, "disk")
    return _compile(spec, t0, store=False)


def _compile(spec: KernelSpec, t0: float, store: bool) -> Launcher:
    log.info("xattn: compiling %s", spec.short_name())
    owner = (_compiler or _default_compiler)(spec)
    compile_seconds = time.perf_counter() - t0
    if store:
        disk_cache.store(spec, owner, compile_seconds)
    function = getattr(owner, "_tvm_ffi_function", None) or owner
    seconds = time.perf_counter() - t0
    log.info("xattn: compiled %s in %.1f s", spec.short_name(), compile_seconds)
    return Launcher(spec, function, owner, seconds, "compiled")


def cached_specs() -> list[KernelSpec]:
    """Specs compiled in this process so far."""
    return list(_entries)


def clear() -> None:
    """Forget every compiled launcher of this process."""
    with _lock:
        _entries.clear()
        _key_locks.clear()
