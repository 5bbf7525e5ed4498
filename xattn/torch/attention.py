"""Differentiable attention on torch tensors (the ``xattn::fwd`` custom op under torch.compile).

q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]`` (or varlen ``[T, H, D]`` with int32
``cu_seqlens_q/k`` and ``max_seqlen_q/k``), fp16/bf16 CUDA tensors. Causal and windows are
bottom-right aligned (FlashAttention); ``window_size=(left, right)``, ``None`` = unbounded, and
``causal=True`` with a left window is the window ``(left, 0)``. ``family`` defaults by head dim
(:func:`xattn.core.spec.family_for`); unsupported dims get the core's NotImplementedError.

Determinism (:mod:`xattn.core.determinism`): the forward of both families and the FFPA backward
(every config, GQA and varlen included) give bitwise identical results run to run. The FA4 backward
does not: it adds fp32 partials of dQ (over key blocks) and, under GQA, of dK/dV (over the q heads
of a group) with reduce-add in scheduling order. Under ``torch.use_deterministic_algorithms(True)``
an FA4 backward raises torch's RuntimeError naming the op; with ``warn_only=True`` it warns and runs.
"""

from __future__ import annotations

import math

import torch

from xattn.core.spec import canonical_mask, family_for

from .ops import attention_op

__all__ = ["attention", "attention_with_lse", "default_family"]


def default_family(head_dim: int, head_dim_v: int | None = None) -> str:
    """The family serving these head dims; for unsupported ones the family whose range is
    closest, so the core raises its NotImplementedError with the supported dims."""
    return family_for(head_dim, head_dim_v) or ("ffpa" if head_dim > 256 else "fa4")


def attention_with_lse(q, k, v, *, softmax_scale: float | None = None, causal: bool = False,
                       window_size=(None, None), cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                       family: str | None = None,
                       check_inputs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; out is differentiable (lse is not). See the module docstring for layouts and
    determinism (the FA4 backward alerts under ``torch.use_deterministic_algorithms(True)``).

    Varlen contract: ``0 = cu[0] <= cu[1] <= ... <= cu[S] <= T`` and segments ``<= max_seqlen``, for q
    and k. By default it is trusted, not read (reading would synchronise): bad cu_seqlens are undefined
    behaviour (wrong output or an illegal memory access). ``check_inputs=True`` (``None``: when
    ``XATTN_CHECK_INPUTS=1``) checks it on the tensors' device with one host sync and raises a
    ``ValueError`` naming the first bad index (:mod:`xattn.torch.varlen_check`)."""
    family = family or default_family(q.shape[-1], v.shape[-1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    causal, left, right = canonical_mask(bool(causal), *window_size)
    varlen = cu_seqlens_q is not None
    if varlen and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("max_seqlen_q/max_seqlen_k: required with cu_seqlens_q/cu_seqlens_k")
    return attention_op(q, k, v, family, scale, causal, -1 if left is None else left,
                        -1 if right is None else right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or 0,
                        max_seqlen_k or 0, check_inputs=check_inputs)


def attention(q, k, v, **kwargs) -> torch.Tensor:
    """Attention output only; same arguments as :func:`attention_with_lse`."""
    return attention_with_lse(q, k, v, **kwargs)[0]
