"""The ``split-kv`` forward route on torch tensors: the family's varlen forward over key splits, then
FlashAttention's combine kernel. How and why: :mod:`xattn.core.split_kv` (glossary there); when:
:func:`xattn.core.routes.forward_route`.

Buffers of one call: ``q_split [B*P*Nq, Hq, D]`` (q once per slot), ``out_partial [B*P*Nq, Hq, Dv]`` (0) and
``lse_partial [Hq, B*P*Nq]`` (-inf); with a causal tail also ``[B*Nq, Hq, Dv]`` / ``[Hq, B*Nq]`` for the tail
launch. The keys are read in place through a flat strided view of k and v (no copy of the cache).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xattn.core import split_kv
from xattn.core.checks import Memo
from xattn.core.split_kv import CombineSpec, SplitPlan

from . import ops

__all__ = ["rows_per_seq", "split_forward", "num_sms"]

_CU = Memo(256)  # (plan, Nq, R, key rows, lengths, device) -> cu_seqlens on the device (host lists: built once)
_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """The SM count of ``device`` (132, an H200's, off CUDA: the CPU stand-ins decide as the H200 would)."""
    if device.type != "cuda":
        return 132
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def rows_per_seq(k: Tensor, v: Tensor) -> int | None:
    """``R``: rows of the flat key view between two sequences' first keys (k and v ``[B, Nk, Hkv, D]``, any
    strides with a unit last one), or ``None`` when their strides put the sequences on no common row stride."""
    b, nk = k.shape[0], k.shape[1]
    if b <= 1:
        return nk
    rows = []
    for t in (k, v):
        s_b, s_n = t.stride(0), t.stride(1)
        if s_n <= 0 or s_b % s_n or s_b // s_n < nk:
            return None
        rows.append(s_b // s_n)
    return rows[0] if rows[0] == rows[1] else None


def _flat(t: Tensor, rows: int, key_rows: int) -> Tensor:
    """``[R (B-1) + Nk, H, D]``: every sequence's keys on one row stride, a view of ``t`` (module docstring)."""
    return t.as_strided((key_rows, t.shape[2], t.shape[3]), (t.stride(1), t.stride(2), t.stride(3)),
                        t.storage_offset())


def _cu_seqlens(plan: SplitPlan, seqlen_q: int, rows: int, key_rows: int, lengths: tuple, device):
    key = (plan, seqlen_q, rows, key_rows, lengths, device)
    hit = _CU.get(key)
    if hit is None:
        cu_q, cu_k, tail_q, tail_k = split_kv.split_cu_seqlens(plan, seqlen_q, rows, list(lengths), key_rows)
        longest = lambda cu: max((b - a for a, b in zip(cu, cu[1:])), default=0)  # noqa: E731
        as_dev = lambda cu: torch.tensor(cu, dtype=torch.int32, device=device) if cu else None  # noqa: E731
        hit = _CU.put(key, (as_dev(cu_q), as_dev(cu_k), longest(cu_k), as_dev(tail_q), as_dev(tail_k),
                            longest(tail_k)))
    return hit


def split_forward(plan: SplitPlan, family: str, q: Tensor, k: Tensor, v: Tensor, scale: float, rows: int,
                  out: Tensor, lse: Tensor) -> None:
    """Write ``out [B, Nq, Hq, Dv]`` and ``lse [B, Hq, Nq]`` (any content before) by the split route: q
    ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]`` whose sequences start every ``rows`` flat rows
    (:func:`rows_per_seq`). Every sequence holds Nk valid keys."""
    b, nq, hq, d = q.shape
    nk, dv = k.shape[1], v.shape[-1]
    p = plan.partials
    key_rows = rows * (b - 1) + nk
    cu_q, cu_k, max_k, tail_q, tail_k, tail_max_k = _cu_seqlens(plan, nq, rows, key_rows, (nk,) * b, q.device)
    kf, vf = _flat(k, rows, key_rows), _flat(v, rows, key_rows)
    q_split = q.unsqueeze(1).expand(b, p, nq, hq, d).reshape(b * p * nq, hq, d)
    out_p = torch.zeros((b * p * nq, hq, dv), dtype=q.dtype, device=q.device)
    lse_p = torch.full((hq, b * p * nq), float("-inf"), dtype=torch.float32, device=q.device)
    _launch_varlen(family, False, q_split, kf, vf, out_p, lse_p, scale, cu_q, cu_k, nq, max_k)
    if plan.tail:
        q_rows = q.reshape(b * nq, hq, d)
        out_t = torch.zeros((b * nq, hq, dv), dtype=q.dtype, device=q.device)
        lse_t = torch.full((hq, b * nq), float("-inf"), dtype=torch.float32, device=q.device)
        _launch_varlen(family, True, q_rows, kf, vf, out_t, lse_t, scale, tail_q, tail_k, nq, tail_max_k)
        out_p.view(b, p, nq, hq, dv)[:, p - 1].copy_(out_t.view(b, nq, hq, dv))
        lse_p.view(hq, b, p, nq)[:, :, p - 1].copy_(lse_t.view(hq, b, nq))
    ops.LAUNCH["combine"](CombineSpec(family, str(q.dtype).removeprefix("torch."), dv),
                          out_p.view(b, p, nq, hq, dv).permute(1, 0, 2, 3, 4),
                          lse_p.view(hq, b, p, nq).permute(2, 1, 3, 0), out, lse.permute(0, 2, 1))


def _launch_varlen(family, causal, q, k, v, out, lse, scale, cu_q, cu_k, max_q, max_k) -> None:
    checked = ops._checked("fwd", family, q, k, v, causal, -1, -1, cu_q, cu_k, max_q, max_k)
    ops.LAUNCH["fwd"](checked, q, k, v, out, lse, softmax_scale=scale, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                      max_seqlen_q=max_q, max_seqlen_k=max_k)
