"""Validation of every core call, before any launch: a bad input must never reach a kernel.

Buffers arrive as any DLPack producer (torch, CuPy, JAX arrays for read-only inputs) and
are viewed as ``tvm_ffi.Tensor``. Each failure raises ``TypeError`` (dtype / not a
tensor), ``ValueError`` (shape, stride, device, scalars) or ``NotImplementedError``
(an unsupported head dim or option), naming the argument, what it got and what was
expected.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import tvm_ffi

from .device import no_gpu_reason
from .spec import DTYPES, KernelSpec, canonical_mask, supports
from .varlen_check import check_metadata

__all__ = ["Meta", "Memo", "Problem", "validate", "buffer_shapes", "as_tensor", "check_attention", "check_buffers",
           "check_layout_sizes", "check_scale", "check_sizes", "check_window", "check_workspace", "quick_check"]

_KDLCUDA = 2
_HALF_DIV = 8  # elements per 16 bytes for fp16/bf16
INT32_MAX = 2 ** 31 - 1  # the launchers' symbolic shapes and the kernels' row counts are 32-bit
GRID_YZ_MAX = 65535  # CUDA grid dims y/z: dense launches put heads on y and the batch on z


class Memo(dict):
    """The one memo of validation: answers derived from a call's metadata (the validator's ``(spec, problem)``,
    and what the front ends derive from it), keyed by that metadata. Bounded: cleared whole once it holds
    ``maxsize`` entries (a process that sees ever new shapes never grows without bound)."""

    def __init__(self, maxsize: int = 4096):
        super().__init__()
        self.maxsize = maxsize

    def put(self, key, value):
        """Store ``value`` under ``key`` (clearing first when full); returns ``value``."""
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value
        return value


class Problem(NamedTuple):
    """Concrete sizes of a validated call (varlen: ``seqlen_*`` are the max_seqlen values)."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    total_q: int
    total_k: int
    heads_q: int
    heads_kv: int
    device_index: int


_WRITABLE_TYPES: set = set()  # producer types seen to be non-JAX (hot-path memo)


def _is_jax_array(x) -> bool:
    cls = type(x)
    if cls in _WRITABLE_TYPES:
        return False
    if cls.__module__.split(".", 1)[0] in ("jax", "jaxlib"):
        return True
    _WRITABLE_TYPES.add(cls)
    return False


def as_tensor(x, name: str, writable: bool = False) -> tvm_ffi.Tensor:
    """View ``x`` as a ``tvm_ffi.Tensor`` (no copy); refuse JAX arrays as outputs."""
    if writable and _is_jax_array(x):
        raise TypeError(f"{name}: JAX arrays are immutable and cannot be written by a kernel; "
                        "call xattn.jax, which reaches the kernels through XLA FFI")
    if isinstance(x, tvm_ffi.Tensor):
        return x
    try:
        return tvm_ffi.from_dlpack(x)
    except Exception as exc:
        raise TypeError(f"{name}: expected a DLPack tensor (torch.Tensor, cupy.ndarray, ...), "
                        f"got {type(x).__name__} ({exc})") from None


def _check_device(t, name: str, index: int | None) -> int:
    dev = t.device
    if dev.dlpack_device_type() != _KDLCUDA:
        hint = no_gpu_reason()
        where = f"; this machine has no usable GPU: {hint}" if hint else ""
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {dev}{where}")
    if index is not None and dev.index != index:
        raise ValueError(f"{name}: on cuda:{dev.index}, but q is on cuda:{index}; all buffers must share one GPU")
    return dev.index


def _check(t, name: str, shape: tuple, labels: str, dtype: str, div: int, align: int) -> None:
    """dtype, exact shape, unit innermost stride, other strides % div, pointer % align bytes."""
    if str(t.dtype) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    got = t.shape
    if got != shape:
        raise ValueError(f"{name}: expected shape {shape} {labels}, got {tuple(got)}")
    if 0 in got:
        return
    strides = t.strides
    if strides[-1] != 1 and got[-1] != 1:
        raise ValueError(f"{name}: needs unit stride in the last dim, got strides {tuple(strides)} "
                         "(call .contiguous())")
    for st in strides[:-1]:
        if st % div:
            raise ValueError(f"{name}: strides other than the last must be multiples of {div} elements "
                             f"(16 bytes), got {tuple(strides)} (call .contiguous())")
    if t.data_ptr() % align:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned, got {t.data_ptr():#x}")


@functools.lru_cache(maxsize=None)
def _spec(*fields) -> tuple[KernelSpec, str | None]:
    spec = KernelSpec(*fields)
    return spec, supports(spec)


def check_scale(value, *, name: str = "softmax_scale", head_dim: int | None = None, convert: bool = False) -> float:
    """The one scale check of every front end: ``value`` as a Python float, or a TypeError /
    ValueError naming ``name`` (FlashAttention's ``softmax_scale``; jax.nn's ``scale``) unless it is
    a finite positive real number (never a bool or a string). ``None`` means ``1/sqrt(head_dim)``
    where a ``head_dim`` is given (head_dim 0: the spec check names the unsupported dim).
    ``convert``: also take what ``float()`` takes (a 0-d torch tensor; torch's front end)."""
    if value is None and head_dim is not None:
        return 1.0 / math.sqrt(max(head_dim, 1))
    if isinstance(value, (bool, str, bytes)) or not (convert or isinstance(value, numbers.Real)):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    try:
        scale = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}") from None
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name}: expected a finite positive float, got {value!r}")
    return scale


def check_sizes(q_shape, k_shape, v_shape, varlen: bool) -> None:
    """``ValueError`` naming the first buffer the kernels cannot index, from shapes alone (so a front
    end can call it before allocating anything): every dim and the row counts ``B * N`` must fit
    in int32 (the launchers' symbolic shapes and the kernels' row arithmetic are 32-bit), and dense
    calls launch B and Hq on the CUDA grid's z and y dims (<= 65535 each)."""
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        shape = tuple(shape)
        for i, size in enumerate(shape):
            if size > INT32_MAX:
                raise ValueError(f"{name}: dim {i} is {size}, past the kernels' 32-bit index range "
                                 f"(2**31 - 1); got shape {shape}")
        if not varlen and len(shape) == 4 and shape[0] * shape[1] > INT32_MAX:
            raise ValueError(f"{name}: B * N = {shape[0] * shape[1]} rows, past the kernels' 32-bit index "
                             f"range (2**31 - 1); got shape {shape}")
    if not varlen and len(q_shape) == 4:
        b, hq = q_shape[0], q_shape[2]
        if b > GRID_YZ_MAX:
            raise ValueError(f"q: batch {b} exceeds {GRID_YZ_MAX} (the CUDA grid's z dim); pack the rows as "
                             "varlen [T, H, D] with cu_seqlens, or split the batch")
        if hq > GRID_YZ_MAX:
            raise ValueError(f"q: {hq} heads exceed {GRID_YZ_MAX} (the CUDA grid's y dim)")


def check_window(window_size) -> tuple:
    """``window_size`` as a ``(left, right)`` tuple; TypeError naming it for anything else (the sides
    themselves are judged by :func:`~xattn.core.spec.supports`)."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size: expected a (left, right) pair (None = unbounded), got {window_size!r}")
    return tuple(window_size)


def check_layout_sizes(layout) -> None:
    """``ValueError`` naming the first workspace buffer of ``layout`` ``[(name, shape, dtype, fill)]``
    with a dim past int32 (e.g. FA4's dq_accum, ``Nq * D`` per head, at >= 8M tokens of d256)."""
    for name, shape, *_ in layout:
        if any(size > INT32_MAX for size in shape):
            raise ValueError(f"workspace[{name}]: shape {tuple(shape)} has a dim past the kernels' 32-bit index "
                             "range (2**31 - 1); use shorter sequences per call")


def _check_max_seqlen(value, name: str, cu_name: str) -> int:
    if value is None:
        raise ValueError(f"{name}: required with {cu_name} (the longest sequence in the batch)")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}: expected a non-negative int, got {value!r}")
    return value


def _view(x):
    return x if isinstance(x, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(x)


def _shape(x):
    """``x.shape`` (the Array API attribute every producer we know has), else via DLPack."""
    shape = getattr(x, "shape", None)
    return shape if isinstance(shape, tuple) else _view(x).shape


_DTYPE_NAMES: dict = {}  # (producer type, producer dtype) -> DLPack dtype name (hot-path memo)


def _dtype_name(x, view) -> str:
    try:
        key = (type(x), x.dtype)
        return _DTYPE_NAMES[key]
    except (AttributeError, TypeError):  # no (hashable) dtype attribute
        return str(view.dtype)
    except KeyError:
        name = _DTYPE_NAMES[key] = str(view.dtype)
        return name


class Meta(NamedTuple):
    """What :func:`validate` reads of one array: its shape and dtype name ("bfloat16", "int32", ...)."""

    shape: tuple
    dtype: str


def _expect(name: str, got: tuple, shape: tuple, labels: str) -> None:
    if tuple(got) != shape:
        raise ValueError(f"{name}: expected shape {shape} {labels}, got {tuple(got)}")


def validate(family: str, direction: str, q: Meta, k: Meta, v: Meta, *, causal=False, window=(None, None),
             cu_seqlens_q: Meta | None = None, cu_seqlens_k: Meta | None = None, max_seqlen_q=None,
             max_seqlen_k=None, device_index: int = 0, allow_no_keys: bool = False,
             kernel_rules: bool = True) -> tuple[KernelSpec, Problem]:
    """The one validator of every call, from metadata alone: ``(spec, problem)`` or a named error.

    ``q``/``k``/``v`` are :class:`Meta` of ``[B, N, H, D]`` (dense) or ``[T, H, D]`` (varlen: give
    ``cu_seqlens_q/k`` Metas of int32 ``[B + 1]`` and ``max_seqlen_q/k``). ``causal``/``window`` in any
    spelling :func:`~xattn.core.spec.canonical_mask` takes; the spec holds the canonical one. Checks, in
    order: mask arguments, varlen pairing, ranks, dtypes (q fp16/bf16, k and v as q), GQA, k's head dim,
    the family's support matrix (``NotImplementedError``), the kernels' size limits, the shapes of k
    and v against q, cu_seqlens and max_seqlen, and a call with query rows but no key (refused unless
    ``allow_no_keys``: front ends that write that result themselves, out 0 / lse -inf). What metadata
    cannot tell (strides, alignment, devices) is checked on the buffers (:func:`check_buffers`).
    ``kernel_rules=False`` keeps the shape rules only (no dtype list, support matrix or kernel size limits):
    for a reference computation that runs any float dtype and head dim (``xattn.jax``'s
    ``backend="reference"`` asked for by name)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    causal, left, right = canonical_mask(causal, *check_window(window))
    varlen = cu_seqlens_q is not None
    if varlen != (cu_seqlens_k is not None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k: give both (varlen) or neither (dense)")
    rank = 3 if varlen else 4
    for n, m in (("q", q), ("k", k), ("v", v)):
        if len(m.shape) != rank:
            what = "[T, H, D] (varlen)" if varlen else "[B, N, H, D] (dense)"
            raise ValueError(f"{n}: expected rank {rank} {what}, got shape {tuple(m.shape)}")
    dtype = q.dtype
    if dtype not in DTYPES and kernel_rules:
        raise TypeError(f"q: expected dtype float16 or bfloat16, got {dtype}")
    for n, m in (("k", k), ("v", v)):
        if m.dtype != dtype:
            raise TypeError(f"{n}: expected dtype {dtype} (as q), got {m.dtype}")
    *lead_q, hq, d = q.shape
    *lead_k, hkv, d_k = k.shape
    dv = v.shape[-1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"k: Hkv={hkv} must divide Hq={hq} (grouped-query attention)")
    if d_k != d:
        lab = "[T, Hkv, D]" if varlen else "[B, N, Hkv, D]"
        raise ValueError(f"k: expected shape {(*lead_k, hkv, d)} {lab} (q and k share the head dim D = {d}), "
                         f"got {tuple(k.shape)}")
    spec, reason = _spec(family, direction, dtype, d, dv, hq // hkv, causal, varlen, left, right)
    if kernel_rules:
        if reason is not None:
            raise NotImplementedError(reason)
        check_sizes(q.shape, k.shape, v.shape, varlen)
    if varlen:
        (tq,), (tk,) = lead_q, lead_k
        check_metadata("cu_seqlens_q", cu_seqlens_q.dtype, cu_seqlens_q.shape)
        check_metadata("cu_seqlens_k", cu_seqlens_k.dtype, cu_seqlens_k.shape, cu_seqlens_q.shape)
        batch = cu_seqlens_q.shape[0] - 1
        nq = _check_max_seqlen(max_seqlen_q, "max_seqlen_q", "cu_seqlens_q")
        nk = _check_max_seqlen(max_seqlen_k, "max_seqlen_k", "cu_seqlens_k")
        rows_k = (tk,)
    else:
        (batch, nq), (bk, nk) = lead_q, lead_k
        if bk != batch:
            raise ValueError(f"k: expected batch {batch} (as q), got shape {tuple(k.shape)}")
        tq, tk = batch * nq, batch * nk
        rows_k = (batch, nk)
    lab = "[T, " if varlen else "[B, N, "
    _expect("v", v.shape, (*rows_k, hkv, dv), lab + "Hkv, Dv]")
    if tk == 0 and tq > 0 and not allow_no_keys:
        raise ValueError(f"k: no keys at all (shape {tuple(k.shape)}) for {tq} query rows; "
                         "attention over an empty key set is undefined")
    return spec, Problem(batch, nq, nk, tq, tk, hq, hkv, device_index)


def buffer_shapes(spec: KernelSpec, p: Problem) -> dict:
    """``{name: (shape, labels)}`` of every attention buffer of a validated call (lse included)."""
    d, dv, hq, hkv = spec.head_dim, spec.head_dim_v, p.heads_q, p.heads_kv
    if spec.varlen:
        rows_q, rows_k, lab = (p.total_q,), (p.total_k,), "[T, "
        lse = ((hq, p.total_q), "[Hq, Tq]")
    else:
        rows_q, rows_k, lab = (p.batch, p.seqlen_q), (p.batch, p.seqlen_k), "[B, N, "
        lse = ((p.batch, hq, p.seqlen_q), "[B, Hq, Nq]")
    return {
        "q": ((*rows_q, hq, d), lab + "Hq, D]"),
        "k": ((*rows_k, hkv, d), lab + "Hkv, D]"),
        "v": ((*rows_k, hkv, dv), lab + "Hkv, Dv]"),
        "out": ((*rows_q, hq, dv), lab + "Hq, Dv]"),
        "dout": ((*rows_q, hq, dv), lab + "Hq, Dv]"),
        "dq": ((*rows_q, hq, d), lab + "Hq, D]"),
        "dk": ((*rows_k, hkv, d), lab + "Hkv, D]"),
        "dv": ((*rows_k, hkv, dv), lab + "Hkv, Dv]"),
        "lse": lse,
    }


def _meta(t) -> Meta:
    return Meta(tuple(t.shape), str(t.dtype))


def quick_check(family: str, direction: str, buffers: dict, causal, cu_seqlens_q, cu_seqlens_k,
                max_seqlen_q, max_seqlen_k, window):
    """:func:`validate` on q, k, v (and cu_seqlens) metadata, memoised by that metadata (hot path).

    Returns ``(spec, problem)``, or ``None`` when anything is off; the caller then runs
    :func:`check_attention` for a named error. The remaining per-buffer checks (dtype, shape against
    q/k, strides, 16-byte alignment, device) run in C in the compiled launcher's TVM-FFI entry before
    any kernel starts; the caller diagnoses their failures with :func:`check_attention` too.
    """
    try:
        if type(causal) is not bool:
            return None
        for n in (("out", "lse") if direction == "fwd" else ("dq", "dk", "dv")):
            if _is_jax_array(buffers[n]):
                return None
        q_raw, k_raw, v_raw = buffers["q"], buffers["k"], buffers["v"]
        q = _view(q_raw)
        dev = q.device
        if dev.dlpack_device_type() != _KDLCUDA:
            return None
        varlen = cu_seqlens_q is not None
        key = (family, direction, causal, window, type(q_raw), getattr(q_raw, "dtype", None), _shape(q_raw),
               _shape(k_raw), _shape(v_raw), None if not varlen else _shape(cu_seqlens_q),
               cu_seqlens_k is None, max_seqlen_q, max_seqlen_k, dev.index)
        hit = _QUICK.get(key)
        if hit is None:
            cu = {}
            if varlen:
                cu = dict(cu_seqlens_q=_meta(_view(cu_seqlens_q)), cu_seqlens_k=_meta(_view(cu_seqlens_k)))
            metas = [Meta(tuple(_shape(x)), _dtype_name(x, _view(x))) for x in (q_raw, k_raw, v_raw)]
            hit = validate(family, direction, *metas, causal=causal, window=window, max_seqlen_q=max_seqlen_q,
                           max_seqlen_k=max_seqlen_k, device_index=dev.index, **cu)
            _QUICK.put(key, hit)
        return hit
    except Exception:  # anything unexpected: let the full check name it
        return None


# (family, direction, causal, window, producer type/dtype, q/k/v/cu shapes, max_seqlens, device) ->
# (spec, problem):
# everything quick_check derives from metadata that does not change between calls of one model.
_QUICK = Memo()


def check_attention(family: str, direction: str, buffers: dict, causal: bool = False,
                    cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    window=(None, None), allow_no_keys: bool = False) -> tuple[KernelSpec, Problem, dict]:
    """Validate one call on its buffers: :func:`validate` on their metadata, then :func:`check_buffers`.
    Returns the compile key, the sizes and the buffers as tvm_ffi tensors.

    ``buffers`` maps argument names (q, k, v, out, lse, and dout, dq, dk, dv for backward)
    to DLPack tensors. Inputs are read-only; out/lse (forward) and dq/dk/dv are written.
    ``allow_no_keys`` as in :func:`validate`.
    """
    outputs = ("out", "lse") if direction == "fwd" else ("dq", "dk", "dv")
    ts = {n: as_tensor(x, n, writable=n in outputs) for n, x in buffers.items()}
    cu = {}
    if cu_seqlens_q is not None:
        cu["cu_seqlens_q"] = _meta(as_tensor(cu_seqlens_q, "cu_seqlens_q"))
    if cu_seqlens_k is not None:
        cu["cu_seqlens_k"] = _meta(as_tensor(cu_seqlens_k, "cu_seqlens_k"))
    spec, problem = validate(family, direction, _meta(ts["q"]), _meta(ts["k"]), _meta(ts["v"]), causal=causal,
                             window=window, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             allow_no_keys=allow_no_keys, **cu)
    if spec.varlen:
        ts["cu_seqlens_q"], ts["cu_seqlens_k"] = _view(cu_seqlens_q), _view(cu_seqlens_k)
    index = check_buffers(spec, problem, ts)
    return spec, problem._replace(device_index=index), ts


def check_buffers(spec: KernelSpec, problem: Problem, ts: dict) -> int:
    """The checks metadata cannot make, on the ``tvm_ffi.Tensor`` views ``ts`` of a call that
    :func:`validate` accepted: each buffer's dtype and exact shape, unit innermost stride, 16-byte strides
    and alignment, and one CUDA device for all. Returns that device's index."""
    expect = buffer_shapes(spec, problem)
    for n, t in ts.items():
        if n in expect and n != "lse":
            _check(t, n, *expect[n], spec.dtype, _HALF_DIV, 16)
        elif n.startswith("cu_seqlens"):
            _check(t, n, (problem.batch + 1,), "[B + 1]", "int32", 1, 4)
    if "lse" in ts:
        _check(ts["lse"], "lse", *expect["lse"], "float32", 1, 4)
    index = _check_device(ts["q"], "q", None)
    for n, t in ts.items():
        _check_device(t, n, index)
    return index


def check_workspace(workspace, layout: list, index: int) -> list:
    """Check caller-supplied scratch buffers against ``layout`` ``[(name, shape, dtype, fill)]``."""
    if workspace is None:
        raise ValueError("workspace: required; allocate the buffers listed by "
                         "xattn.core.bwd_workspace(...) (shapes and dtypes) and pass them in order")
    workspace = list(workspace)
    if len(workspace) != len(layout):
        names = [entry[0] for entry in layout]
        raise ValueError(f"workspace: expected {len(layout)} buffers {names}, got {len(workspace)}")
    out = []
    for x, (name, shape, dtype, _) in zip(workspace, layout):
        t = as_tensor(x, f"workspace[{name}]", writable=True)
        _check(t, f"workspace[{name}]", tuple(shape), "", dtype, 4 if dtype == "float32" else 1, 16)
        out.append(t)
    for t, (name, *_) in zip(out, layout):
        _check_device(t, f"workspace[{name}]", index)
    return out
