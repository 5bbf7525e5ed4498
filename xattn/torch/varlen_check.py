"""Checked varlen inputs for torch: the rules of :mod:`xattn.core.varlen_check` on the tensors' device.

Glossary: S segments, Tq/Tk packed tokens (``q.shape[0]``/``k.shape[0]``), int32 ``cu_seqlens_q/k``
``[S + 1]`` (:func:`cu_seqlens_from_lengths` builds one from host segment lengths).
:func:`check_cu_seqlens` evaluates every rule of both tensors with torch ops where they live, gathers
the results into one small int64 tensor and reads it with a single ``.tolist()``: the only host
synchronisation of checked mode. The unchecked path never calls it (no sync, no cost beyond reading
``XATTN_CHECK_INPUTS`` on varlen calls).

Under ``torch.compile`` the check is a ``torch.compiler.disable`` region: checked mode breaks the
graph around it (``fullgraph=True`` refuses it), and ``XATTN_CHECK_INPUTS`` is read when a function is
compiled, not per call. It cannot run inside CUDA-graph capture, where a host read is illegal. It is
a debugging mode; leave it off for compiled or captured steps.
"""

from __future__ import annotations

import itertools

import torch

from xattn.core import varlen_check as vc

__all__ = ["check_cu_seqlens", "checking", "cu_seqlens_from_lengths"]

checking = vc.checking

_OPS = vc.ArrayOps(
    first_true=lambda mask: mask.to(torch.int32).argmax(),  # argmax returns the first maximum
    take=torch.take,
    stack=lambda values: torch.stack([v.to(torch.int64) for v in values]),
)


def cu_seqlens_from_lengths(lengths, device) -> torch.Tensor:
    """int32 ``cu_seqlens`` ``[S + 1]`` on ``device`` (``0``, then the running sums) of ``S`` host segment lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)


def _metadata(name: str, cu, other=None) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    vc.check_metadata(name, str(cu.dtype).removeprefix("torch."), tuple(cu.shape),
                      None if other is None else tuple(other.shape))


def _not_compiled(fn):
    reason = "xattn checked mode reads cu_seqlens on the host; turn check_inputs / XATTN_CHECK_INPUTS off"
    try:
        return torch.compiler.disable(fn, reason=reason)
    except TypeError:  # torch without the reason keyword
        return torch.compiler.disable(fn)


@_not_compiled
def check_cu_seqlens(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                     max_seqlen_q: int | None = None, max_seqlen_k: int | None = None) -> None:
    """Raise :class:`xattn.core.varlen_check.CuSeqlensError` (a ``ValueError``; ``TypeError`` too for a
    dtype other than int32) naming the argument, the first bad index and the values when ``cu_seqlens_q/k``
    break the varlen contract: int32 ``[S + 1]``, ``cu[0] == 0``, non-decreasing, ``cu[S] <= T`` (Tq =
    ``total_q``, Tk = ``total_k``) and every segment ``<= max_seqlen_q/k`` (when given). One host sync."""
    _metadata("cu_seqlens_q", cu_seqlens_q)
    _metadata("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q)
    if cu_seqlens_k.device != cu_seqlens_q.device:
        raise ValueError(f"cu_seqlens_k: on {cu_seqlens_k.device}, but cu_seqlens_q is on {cu_seqlens_q.device}; "
                         "both must be on the device of q")
    if type(cu_seqlens_q) is not torch.Tensor or type(cu_seqlens_k) is not torch.Tensor:
        return  # fake / functional tensors of a trace carry no values to read
    with torch.no_grad():
        flat = torch.cat([vc.summary(_OPS, cu_seqlens_q, total_q, max_seqlen_q),
                          vc.summary(_OPS, cu_seqlens_k, total_k, max_seqlen_k)])
        values = flat.tolist()  # the one host sync of checked mode
    vc.raise_first(values, cu_seqlens_q.shape[0] - 1, total_q, total_k, max_seqlen_q, max_seqlen_k)
