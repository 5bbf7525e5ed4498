"""XLA FFI glue: the core's compiled launchers as XLA custom calls (through jax-tvm-ffi).

Target names come from the compile key (``KernelSpec.target_name()``), so every process
agrees on them; registration happens once per (spec, platform) under a lock and the
function objects stay referenced for the life of the process.

Calling convention (launcher parameters are inputs first, then outputs and workspace):

* no output needs a pre-fill (``spec.output_fill()`` empty, no workspace ``fill``):
  ``arg_spec=["args", "rets", "attrs.softmax_scale"]``; XLA allocates the outputs;
* otherwise every output and workspace buffer goes in as an input aliased to the matching
  result; ``arg_spec=["args", "attrs.softmax_scale"]`` (XLA hands uninitialised result buffers,
  so pre-filled outputs must be aliased inputs). Only the buffers with a fill are filled
  (``jnp.full``); the others come from ``jax.lax.empty`` (XLA's ``AllocateBuffer`` on GPU:
  no memset), so e.g. FA4's large fp32 ``dq_accum`` is never zeroed for nothing.

GPU targets are registered command-buffer compatible (``allow_cuda_graph``) when the process
sees one GPU: the launchers only enqueue kernels on the stream XLA hands them (no allocation,
no host sync), so XLA may capture them into CUDA graphs with the ops around them. With two or
more GPUs visible they run outside command buffers; :func:`capture_allowed` says why.
"""

from __future__ import annotations

import functools
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from xattn.core.spec import KernelSpec

__all__ = ["call", "call_gemm", "set_launcher_provider", "registered_targets", "check_pairing", "capture_allowed"]

_lock = threading.Lock()
_registered: dict[str, object] = {}  # target name -> function (kept alive)
_provider: Callable[[KernelSpec], tuple[object, str]] | None = None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def check_pairing(jax_version: str | None = None, ffi_version: str | None = None) -> None:
    """Raise ``ImportError`` with the fix when jax and jax-tvm-ffi cannot work together.

    jax-tvm-ffi 0.1.3 speaks XLA FFI API 0.3, which needs jax >= 0.9.1; 0.1.2 works with older jax.
    """
    from importlib import metadata

    if ffi_version is None:
        try:
            ffi_version = metadata.version("jax-tvm-ffi")
        except metadata.PackageNotFoundError:
            raise ImportError("xattn.jax needs jax-tvm-ffi: pip install jax-tvm-ffi==0.1.3") from None
    jax_version = jax_version or jax.__version__
    if _version(ffi_version) >= (0, 1, 3) and _version(jax_version) < (0, 9, 1):
        raise ImportError(f"jax-tvm-ffi {ffi_version} needs jax >= 0.9.1 (XLA FFI API 0.3), found jax {jax_version}: "
                          "pip install -U 'jax>=0.9.1', or pip install jax-tvm-ffi==0.1.2 for this jax")


def _jax_tvm_ffi():
    import jax_tvm_ffi

    return jax_tvm_ffi


@functools.cache
def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def _default_provider(spec: KernelSpec):
    if not _has_gpu():  # before compiling for seconds, only to fail at run time without a GPU handler
        raise RuntimeError(f"backend='kernel' needs a CUDA GPU, but JAX sees only {jax.default_backend()} "
                           "devices; use backend='auto' (the reference off-GPU) or 'reference'")
    from xattn.core import get_launcher

    return get_launcher(spec).function, "gpu"


def set_launcher_provider(provider: Callable[[KernelSpec], tuple[object, str]] | None) -> None:
    """Replace where launchers come from: ``provider(spec) -> (tvm_ffi function, platform)``.

    Tests plug in a NumPy stand-in on the ``"cpu"`` platform; ``None`` restores the
    compiled CuTeDSL launchers on ``"gpu"``.
    """
    global _provider
    _provider = provider


def capture_allowed(platform: str = "gpu") -> bool:
    """Whether XLA may capture the xattn targets into command buffers (CUDA graphs): on one visible GPU.

    A CuTeDSL launcher loads its kernels onto *every* visible GPU the first time it runs, under one
    process-wide lock (``cuda_dialect_init_library_once``). When XLA runs a program on two GPUs,
    each GPU's thread may make that first call while capturing its command buffer; the thread that
    holds the lock then waits to load onto the other GPU, whose capture is waiting for the lock: a
    deadlock (seen on 2xH200: a batch-sharded ``jax.grad`` hung in 2 of 3 fresh processes,
    ``benchmarks/tools/jax_two_gpu_probe.py``). Outside command buffers the load is an ordinary
    call and nothing waits on a capture. The cost is a few microseconds of launch per call.
    The mechanism is read from the runtime's code and the probe; the probe's ``-captured`` /
    ``-nocmdbuf`` cases confirm it on 2 GPUs (not yet run).
    """
    if platform != "gpu":
        return False
    from xattn.core.device import cuda_gpus

    return len(cuda_gpus()) <= 1


def _aliased(spec: KernelSpec, workspace) -> bool:
    return bool(spec.output_fill()) or any(fill is not None for *_, fill in workspace)


def _register(name: str, function, arg_spec: list, platform: str) -> None:
    """Register ``function`` as XLA FFI target ``name`` (caller holds ``_lock``) and keep it alive."""
    _jax_tvm_ffi().register_ffi_target(name, function, arg_spec=arg_spec, platform=platform,
                                       allow_cuda_graph=capture_allowed(platform), pass_owned_tensor=platform == "cpu")
    _registered[name] = function


def _target(spec: KernelSpec, aliased: bool) -> str:
    function, platform = (_provider or _default_provider)(spec)
    name = f"{spec.target_name()}_{platform}" + ("_aliased" if aliased else "")
    if name in _registered:
        return name
    with _lock:
        if name not in _registered:
            arg_spec = ["args", "attrs.softmax_scale"] if aliased else ["args", "rets", "attrs.softmax_scale"]
            _register(name, function, arg_spec, platform)
    return name


def registered_targets() -> list[str]:
    """Names of the XLA FFI targets this process registered."""
    return sorted(_registered)


def _varying_axes(x) -> frozenset:
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # older jax


def match_varying(results, inputs):
    """Inside shard_map, custom-call results carry no varying-axis type: give them the inputs'.

    Without it a custom_vjp backward returns cotangents typed unlike its primals and fails.
    """
    axes = frozenset().union(*(_varying_axes(x) for x in inputs))
    if not axes:
        return list(results)
    return [jax.lax.pcast(r, tuple(sorted(axes)), to="varying") if _varying_axes(r) != axes else r
            for r in results]


def call(spec: KernelSpec, inputs, outputs, workspace, softmax_scale: float, vmap_method: str | None = None):
    """Run one launcher from JAX; returns the output arrays (workspace dropped).

    ``outputs``/``workspace``: ``[(name, shape, dtype, fill | None)]`` in launcher order;
    ``outputs`` fills default to ``spec.output_fill()``.
    """
    fills = spec.output_fill()
    outputs = [(n, tuple(s), d, fills.get(n)) for n, s, d, *_ in outputs]
    buffers = outputs + [(n, tuple(s), d, f) for n, s, d, f in workspace]
    aliased = _aliased(spec, workspace)
    result = [jax.ShapeDtypeStruct(s, jnp.dtype(d)) for _, s, d, _ in buffers]
    kw = {} if vmap_method is None else dict(vmap_method=vmap_method)
    scale = np.float32(softmax_scale)
    if aliased:
        n_in = len(inputs)
        initial = [jax.lax.empty(s, jnp.dtype(d)) if f is None else jnp.full(s, f, dtype=jnp.dtype(d))
                   for _, s, d, f in buffers]
        aliases = {n_in + i: i for i in range(len(buffers))}
        res = jax.ffi.ffi_call(_target(spec, True), result, input_output_aliases=aliases, **kw)(
            *inputs, *initial, softmax_scale=scale)
    else:
        res = jax.ffi.ffi_call(_target(spec, False), result, **kw)(*inputs, softmax_scale=scale)
    return match_varying(res[: len(outputs)], inputs)


def _gemm_target(spec, attr_names: tuple) -> str:
    function, platform = (_provider or _default_provider)(spec)
    name = f"{spec.target_name()}_{platform}"
    if name in _registered:
        return name
    with _lock:
        if name not in _registered:
            _register(name, function, ["args", "rets", *(f"attrs.{a}" for a in attr_names)], platform)
    return name


def call_gemm(spec, inputs, results, attrs: dict, aliases: dict):
    """Run one GEMM launcher of the chunked backward (:class:`xattn.core.gemm_sm90.GemmSpec`).

    ``results``: ``[(shape, dtype)]``; ``attrs``: the launcher's scalars by name, in its order;
    ``aliases``: ``{input index: result index}`` (an accumulator updated in place).
    """
    result = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d)) for s, d in results]
    res = jax.ffi.ffi_call(_gemm_target(spec, tuple(attrs)), result, input_output_aliases=aliases)(*inputs, **attrs)
    return match_varying(res, inputs)
