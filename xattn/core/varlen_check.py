"""Checked varlen inputs: the ``cu_seqlens`` rules, shared by the core and both front ends.

Glossary: S segments, ``cu`` an int32 ``[S + 1]`` offset array (segment s is packed tokens
``cu[s]:cu[s + 1]``), T the packed length (``q.shape[0]`` for ``cu_seqlens_q``, ``k.shape[0]``
for ``cu_seqlens_k``), M the ``max_seqlen`` of the same side.

The kernels trust ``cu`` (reading it on the host would synchronise): the caller guarantees

1. ``start``: ``cu[0] == 0``;
2. ``order``: ``cu[i - 1] <= cu[i]`` for every i (non-decreasing);
3. ``end``: ``cu[S] <= T``;
4. ``length``: ``cu[s + 1] - cu[s] <= M`` for every segment s.

Unchecked, a ``cu`` that breaks them makes the kernels read and write rows outside the
segment or outside the tensors: wrong output, a crash, or an illegal memory access that
kills the CUDA context. Checked mode (:func:`checking`: the ``check_inputs`` keyword of the
varlen entry points, else ``XATTN_CHECK_INPUTS=1``) tests the rules before any launch and
raises :class:`CuSeqlensError` (a ``ValueError``) naming the argument, the first bad index
and the values, e.g. ``cu_seqlens_q[3] = 17 < cu_seqlens_q[2] = 20: must be non-decreasing``.
Rules are reported in the order above, q before k; within a rule, the lowest index.

How the values are read, per caller:

* front ends: :func:`summary` evaluates every rule with vectorised ops of the array's own
  library on its own device (an :class:`ArrayOps` adapter) into one small integer vector;
  one host copy of it (the one sync) feeds :func:`raise_first`. JAX hands the same entries
  to ``checkify.check`` (:func:`entries`);
* the core, on any DLPack producer: :func:`check_host` copies each ``cu`` to the host
  through DLPack (``__dlpack__(dl_device=CPU, copy=True)``, the producer's own ordered copy;
  one copy when ``cu_seqlens_q is cu_seqlens_k``) and applies :func:`host_summary`.

No torch, jax or numpy here (``tests/core/test_layering.py``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import tvm_ffi

__all__ = ["ENV_VAR", "CuSeqlensError", "CuSeqlensDtypeError", "ArrayOps", "checking", "check_metadata",
           "summary", "host_summary", "entries", "raise_first", "check_host"]

ENV_VAR = "XATTN_CHECK_INPUTS"
_ON = frozenset({"1", "true", "yes", "on"})
_INT32_MAX = 2 ** 31 - 1
_KDLCPU = 1
# (rule, number of values after its ``bad`` flag), in reporting order; see :func:`summary`.
RULES = (("start", 1), ("order", 4), ("end", 1), ("length", 4))
_WIDTH = sum(1 + n for _, n in RULES)  # summary entries per cu tensor


class CuSeqlensError(ValueError):
    """A ``cu_seqlens`` argument breaks the varlen contract (see the module docstring)."""


class CuSeqlensDtypeError(CuSeqlensError, TypeError):
    """``cu_seqlens`` is not int32: both a ``TypeError`` (house style) and a ``CuSeqlensError``."""


def checking(check_inputs: bool | None = None) -> bool:
    """Whether a varlen call checks its ``cu_seqlens``: ``check_inputs`` when given, else
    whether the environment variable ``XATTN_CHECK_INPUTS`` is ``1`` (or true/yes/on), read per call."""
    if check_inputs is None:
        return os.environ.get(ENV_VAR, "").strip().lower() in _ON
    if type(check_inputs) is not bool:
        raise TypeError(f"check_inputs: expected None or a bool, got {type(check_inputs).__name__}")
    return check_inputs


def check_metadata(name: str, dtype: str, shape: tuple, other_shape: tuple | None = None) -> None:
    """The rules that need no values: int32, 1-D ``[S + 1]`` with S >= 1, and (``other_shape``:
    cu_seqlens_q's) one key segment per query segment. ``dtype`` is the DLPack name ("int32")."""
    if dtype != "int32":
        raise CuSeqlensDtypeError(f"{name}: expected dtype int32, got {dtype}")
    shape = tuple(shape)
    if len(shape) != 1:
        raise CuSeqlensError(f"{name}: expected a 1-D tensor [S + 1], got shape {shape}")
    if shape[0] < 2:
        raise CuSeqlensError(f"{name}: expected shape [S + 1] with S >= 1 segments, got {shape}")
    if other_shape is not None and shape != tuple(other_shape):
        raise CuSeqlensError(f"{name}: expected shape {tuple(other_shape)} like cu_seqlens_q (one key segment "
                             f"per query segment), got {shape}")


class ArrayOps(NamedTuple):
    """What :func:`summary` needs from an array library beyond slicing and comparisons; every result
    stays on the input's device (no host synchronisation)."""

    first_true: Callable[[Any], Any]  # 1-D bool array -> 0-d index of its first True (0 when none)
    take: Callable[[Any, Any], Any]  # (1-D array, 0-d index array) -> 0-d element
    stack: Callable[[Sequence[Any]], Any]  # 0-d bool/int arrays -> 1-D integer array


def summary(ops: ArrayOps, cu, total: int, max_seqlen: int | None):
    """Every rule of one ``cu`` (int32 ``[S + 1]``, S >= 1) at once, on its device: a 1-D integer
    array of ``bad, values...`` per rule of ``RULES``; ``values`` are what the message quotes
    (start: cu[0]; order: i, cu[i], i - 1, cu[i - 1]; end: cu[S]; length: s + 1, s, cu[s + 1] - cu[s], s)."""
    limit = _INT32_MAX if max_seqlen is None else min(int(max_seqlen), _INT32_MAX)
    head, tail = cu[:-1], cu[1:]
    drop = ops.first_true(tail < head)
    i = drop + 1
    lengths = tail - head  # meaningful once start/order hold (then in [0, T], no overflow)
    too_long = lengths > limit
    s = ops.first_true(too_long)
    return ops.stack([
        cu[0] != 0, cu[0],
        (tail < head).any(), i, ops.take(cu, i), drop, ops.take(cu, drop),
        cu[-1] > min(int(total), _INT32_MAX), cu[-1],
        too_long.any(), s + 1, s, ops.take(lengths, s), s,
    ])


def host_summary(values: Sequence[int], total: int, max_seqlen: int | None) -> list[int]:
    """:func:`summary` of host integers (pure Python), entry for entry."""
    cu = [int(x) for x in values]
    pairs = list(zip(cu[:-1], cu[1:]))
    drop = next((j for j, (a, b) in enumerate(pairs) if b < a), None)
    long = next((j for j, (a, b) in enumerate(pairs) if max_seqlen is not None and b - a > max_seqlen), None)
    d, s = drop or 0, long or 0
    return [int(cu[0] != 0), cu[0],
            int(drop is not None), d + 1, cu[d + 1], d, cu[d],
            int(cu[-1] > total), cu[-1],
            int(long is not None), s + 1, s, cu[s + 1] - cu[s], s]


def _templates(side: str, segments: int, total: int, max_seqlen: int | None) -> list[str]:
    """Messages of each rule with ``{}`` for the values of :func:`summary` (the static parts filled in)."""
    cu, mx = f"cu_seqlens_{side}", f"max_seqlen_{side}"
    return [
        f"{cu}[0] = {{}}: must be 0 (segment 0 starts at the first packed token)",
        f"{cu}[{{}}] = {{}} < {cu}[{{}}] = {{}}: must be non-decreasing",
        f"{cu}[{segments}] = {{}} > T{side} = {total} ({side}.shape[0], the packed length): "
        "the last offset must not exceed it",
        f"{cu}[{{}}] - {cu}[{{}}] = {{}} > {mx} = {max_seqlen}: segment {{}} is longer than {mx}",
    ]


def entries(segments: int, total_q: int, total_k: int, max_seqlen_q: int | None,
            max_seqlen_k: int | None) -> list[tuple[int, slice, str]]:
    """``(position of bad, slice of values, message template)`` of every rule, in reporting order,
    over the concatenated summaries of cu_seqlens_q then cu_seqlens_k."""
    out, pos = [], 0
    for side, total, mx in (("q", total_q, max_seqlen_q), ("k", total_k, max_seqlen_k)):
        for (_, arity), template in zip(RULES, _templates(side, segments, total, mx)):
            out.append((pos, slice(pos + 1, pos + 1 + arity), template))
            pos += 1 + arity
    return out


def raise_first(flat: Sequence[int], segments: int, total_q: int, total_k: int, max_seqlen_q: int | None,
                max_seqlen_k: int | None) -> None:
    """Raise :class:`CuSeqlensError` for the first violated rule of the host copy ``flat`` of the
    concatenated summaries (q then k); return quietly when every rule holds."""
    flat = [int(x) for x in flat]
    if len(flat) != 2 * _WIDTH:
        raise ValueError(f"flat: expected {2 * _WIDTH} summary entries, got {len(flat)}")
    for bad, values, template in entries(segments, total_q, total_k, max_seqlen_q, max_seqlen_k):
        if flat[bad]:
            raise CuSeqlensError(template.format(*flat[values]))


def _host_ints(x, name: str) -> list[int]:
    """The values of a 1-D int32 DLPack tensor, copied to the host by its producer when on a device."""
    t = x if isinstance(x, tvm_ffi.Tensor) else tvm_ffi.from_dlpack(x)
    if t.device.dlpack_device_type() != _KDLCPU:
        try:
            t = tvm_ffi.from_dlpack(x.__dlpack__(dl_device=(_KDLCPU, 0), copy=True))
        except Exception as exc:  # producers without DLPack 2023.12 copies (or a bare tvm_ffi.Tensor)
            raise TypeError(f"{name}: checked mode copies cu_seqlens to the host through DLPack, and "
                            f"{type(x).__name__}.__dlpack__(dl_device=CPU, copy=True) failed ({exc}); pass a "
                            "torch/CuPy/JAX array, or check_inputs=False") from None
    check_metadata(name, str(t.dtype), tuple(t.shape))
    (n,), (stride,) = t.shape, t.strides
    base = t.data_ptr()
    return [ctypes.c_int32.from_address(base + 4 * stride * i).value for i in range(n)]


def check_host(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int | None = None,
               max_seqlen_k: int | None = None) -> None:
    """Checked mode of the core: every rule on host copies of the two DLPack ``cu`` tensors.

    Raises :class:`CuSeqlensError` (``CuSeqlensDtypeError`` for a dtype other than int32) naming
    the argument, the first bad index and the values; ``TypeError`` when a producer cannot copy
    to the host. One synchronising copy per distinct tensor (none for host tensors)."""
    cq = _host_ints(cu_seqlens_q, "cu_seqlens_q")
    ck = cq if cu_seqlens_k is cu_seqlens_q else _host_ints(cu_seqlens_k, "cu_seqlens_k")
    check_metadata("cu_seqlens_k", "int32", (len(ck),), (len(cq),))
    flat = host_summary(cq, total_q, max_seqlen_q) + host_summary(ck, total_k, max_seqlen_k)
    raise_first(flat, len(cq) - 1, total_q, total_k, max_seqlen_q, max_seqlen_k)
