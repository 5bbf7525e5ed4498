"""Differentiable attention on torch tensors (the ``xattn::fwd`` custom op under torch.compile).

q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]`` (or varlen ``[T, H, D]`` with int32
``cu_seqlens_q/k`` and ``max_seqlen_q/k``), fp16/bf16 CUDA tensors. Causal and windows are
bottom-right aligned (FlashAttention); ``window_size=(left, right)``, ``None`` or ``-1`` = unbounded
(other negative sides raise ValueError), and ``causal=True`` with a left window is the window ``(left, 0)``
(``causal=True, window_size=(-1, -1)`` is plain causal). FFPA (head_dim 320-512) has no window kernel: a
bounded window raises NotImplementedError. ``family`` defaults by head dim
(:func:`xattn.core.spec.family_for`); unsupported dims get the core's NotImplementedError.

Edge cases: an input whose last dim is not contiguous is copied to a contiguous one (as FlashAttention);
``softmax_scale`` must be finite and > 0 (ValueError); B = 0 or Nq = 0 gives an empty result, Nk = 0
(or Tk = 0) rows of 0 with lse -inf ("rows that see no key"), with zero gradients and no launch; sizes
past the kernels' 32-bit indexing or the CUDA grid raise ValueError before anything is allocated.

Determinism (:mod:`xattn.core.determinism`): the forward of both families and the FFPA backward
(every config, GQA and varlen included) give bitwise identical results run to run. The FA4 backward
does not: it adds fp32 partials of dQ (over key blocks) and, under GQA, of dK/dV (over the q heads
of a group) with reduce-add in scheduling order. Under ``torch.use_deterministic_algorithms(True)``
an FA4 backward raises torch's RuntimeError naming the op; with ``warn_only=True`` it warns and runs.
"""

from __future__ import annotations


import torch
from numpy import bool_ as np_bool

from xattn.core.checks import check_scale, check_window
from xattn.core.spec import canonical_mask, family_for
from xattn.core.split_kv import MAX_PARTIALS

from .ops import attention_op

__all__ = ["attention", "attention_with_lse", "default_family"]


def default_family(head_dim: int, head_dim_v: int | None = None) -> str:
    """The family serving these head dims; for unsupported ones the family whose range is
    closest, so the core raises its NotImplementedError with the supported dims."""
    return family_for(head_dim, head_dim_v) or ("ffpa" if head_dim > 256 else "fa4")


def as_input(name: str, t) -> torch.Tensor:
    """A torch tensor, made contiguous in its last dim where it is not (as FlashAttention's
    ``maybe_contiguous``): the kernels read rows with unit stride."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return t.contiguous() if t.dim() and t.stride(-1) != 1 and t.shape[-1] > 1 else t


def checked_scale(softmax_scale, head_dim: int) -> float:
    return check_scale(softmax_scale, head_dim=head_dim, convert=True)  # a 0-d tensor too


def mask_args(causal, window_size):
    if not isinstance(causal, (int, np_bool)):  # bool, or 0/1 as FlashAttention takes it; never a string
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    return canonical_mask(bool(causal), *check_window(window_size))


def attention_with_lse(q, k, v, *, softmax_scale: float | None = None, causal: bool = False,
                       window_size=(None, None), cu_seqlens_q=None, cu_seqlens_k=None,
                       max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                       family: str | None = None, num_splits: int = 0,
                       check_inputs: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)``; out is differentiable (lse is not). See the module docstring for layouts and
    determinism (the FA4 backward alerts under ``torch.use_deterministic_algorithms(True)``).

    Varlen contract: ``0 = cu[0] <= cu[1] <= ... <= cu[S] <= T`` and segments ``<= max_seqlen``, for q
    and k. By default it is trusted, not read (reading would synchronise): bad cu_seqlens are undefined
    behaviour (wrong output or an illegal memory access). ``check_inputs=True`` (``None``: when
    ``XATTN_CHECK_INPUTS=1``) checks it on the tensors' device with one host sync and raises a
    ``ValueError`` naming the first bad index (:mod:`xattn.torch.varlen_check`).

    ``num_splits`` (FlashAttention's): 0 lets :func:`xattn.core.routes.forward_route` decide whether a
    decoding forward (at most 16 queries per sequence: dense q, or packed with ``max_seqlen_q <= 16``; no window)
    splits the keys over CTAs (``split-kv``: :mod:`xattn.core.split_kv`), 1 never splits, n > 1 asks for n splits
    (at most 127)."""
    q, k, v = as_input("q", q), as_input("k", k), as_input("v", v)
    family = family or default_family(q.shape[-1] if q.dim() else 0, v.shape[-1] if v.dim() else 0)
    scale = checked_scale(softmax_scale, q.shape[-1] if q.dim() else 0)
    causal, left, right = mask_args(causal, window_size)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits < MAX_PARTIALS:
        raise ValueError(f"num_splits: expected an int in 0-{MAX_PARTIALS - 1} (0 auto, 1 off), got {num_splits!r}")
    varlen = cu_seqlens_q is not None
    if varlen and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("max_seqlen_q/max_seqlen_k: required with cu_seqlens_q/cu_seqlens_k")
    return attention_op(q, k, v, family, scale, causal, -1 if left is None else left,
                        -1 if right is None else right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q or 0,
                        max_seqlen_k or 0, check_inputs=check_inputs, num_splits=num_splits)


def attention(q, k, v, **kwargs) -> torch.Tensor:
    """Attention output only; same arguments as :func:`attention_with_lse`."""
    return attention_with_lse(q, k, v, **kwargs)[0]
