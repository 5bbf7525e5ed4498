"""Low-level kernel calls on SDPA-layout tensors, the building blocks NeMo's ring attention uses (its
``ffpa_attention`` module's ``_ffpa_dense_fwd/_bwd``, ``_ffpa_varlen_fwd/_bwd``, readiness probes and
``_get_ffpa_high_level``; :mod:`xattn.torch.ffpa_attention` publishes them under those names).

Glossary: ``B`` batch, ``Hq/Hkv`` query/key heads (GQA when they differ), ``Nq/Nk`` sequence lengths, ``D``
head dim; packed (varlen) tensors are ``[T, H, D]`` with int32 ``cu_q/cu_k [S + 1]``; lse is fp32. Dense calls
take and return SDPA layout ``[B, H, N, D]`` (the kernels read ``[B, N, H, D]`` views, no copy). Causal is
bottom-right aligned. The forwards are not differentiable: the caller merges out/lse across chunks and
calls the backward with the merged ones.
"""

from __future__ import annotations

import torch

from ..attention import attention, attention_with_lse, default_family
from ..ops import bwd as bwd_op
from . import hooks, support

__all__ = ["dense_fwd", "dense_bwd", "varlen_fwd", "varlen_bwd", "varlen_ready", "high_level",
           "sdpa_on_kernels", "nemo_state", "FFPA_HEAD_DIM", "VARLEN_WIN_NONE"]

FFPA_HEAD_DIM = 512  # NeMo's ``_FFPA_HEAD_DIM`` (the one head dim its FFPA ran; xattn's FFPA runs 320-512)
VARLEN_WIN_NONE = -2 ** 31  # NeMo's "no window" sentinel, ``_VARLEN_WIN_NONE`` (xattn's core takes None)
_FFPA_FN = None
_CUTEDSL_BACKEND = None


def nemo_state() -> dict:
    """This module's state under NeMo's names (``_FFPA_FN``, ``_CUTEDSL_BACKEND``)."""
    return {"_FFPA_FN": _FFPA_FN, "_CUTEDSL_BACKEND": _CUTEDSL_BACKEND}


def varlen_ready() -> bool:
    """Whether the FFPA varlen kernels can run in this process (the same launchers as dense)."""
    return support.low_level_ready()


def sdpa_on_kernels(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
                    enable_gqa: bool = False, backend=None):
    """``scaled_dot_product_attention``'s signature on the kernels (ffpa-attn's ``ffpa_attn_func``):
    ``[B, H, N, D]`` in and out, differentiable.

    ``is_causal`` is bottom-right aligned (as ``ffpa_attn_func``); ``attn_mask`` and dropout raise
    NotImplementedError; Hq != Hkv needs ``enable_gqa=True`` as in SDPA. ``backend`` is the second value
    of :func:`high_level` (``xattn.core``) or None; anything else raises ValueError."""
    import xattn.core

    if backend is not None and backend is not xattn.core:
        raise ValueError(f"backend: expected the backend returned by _get_ffpa_high_level() (xattn.core) or None, "
                         f"got {backend!r}")
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: the kernels take no mask tensor; use is_causal")
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p}: the kernels have no attention dropout")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads, key {key.shape[1]}: pass enable_gqa=True for GQA")
    out = attention(*(t.transpose(1, 2) for t in (query, key, value)), softmax_scale=scale, causal=is_causal)
    return out.transpose(1, 2)


@hooks.default("_get_ffpa_high_level")
def high_level():
    """``(sdpa_like_fn, backend)``: the differentiable SDPA-signature function (:func:`sdpa_on_kernels`) and
    ``xattn.core``, or ``(None, None)`` where the kernels cannot run."""
    global _FFPA_FN, _CUTEDSL_BACKEND
    if not support.low_level_ready():
        return None, None
    import xattn.core

    _FFPA_FN, _CUTEDSL_BACKEND = sdpa_on_kernels, xattn.core
    return _FFPA_FN, _CUTEDSL_BACKEND


def dense_fwd(q, k, v, scale: float, causal: bool):
    """Forward on SDPA layout: q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nk, D]`` -> ``(out [B, Hq, Nq, D], lse [B, Hq, Nq]
    fp32)``. GQA and causal (bottom-right aligned) handled; results are not differentiable (the caller
    merges out/lse and calls :func:`dense_bwd`)."""
    with torch.no_grad():
        out, lse = attention_with_lse(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale, causal=causal,
                                      family=default_family(q.shape[-1], v.shape[-1]))
    return out.transpose(1, 2), lse


def dense_bwd(grad_out, q, k, v, out, lse, scale: float, causal: bool):
    """Backward from the caller's ``out``/``lse`` (e.g. ring-merged), SDPA layout: ``(dq, dk, dv)`` ``[B, H, N, D]``
    with dk/dv reduced to the Hkv heads."""
    t = [x.transpose(1, 2) for x in (grad_out, q, k, v, out)]
    dq, dk, dv = bwd_op(t[0].contiguous(), t[1], t[2], t[3], t[4], lse, default_family(q.shape[-1], v.shape[-1]),
                        float(scale), bool(causal), -1, -1, None, None, 0, 0)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def varlen_fwd(q_pack, k_pack, v_pack, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    """Packed THD forward: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, int32 ``cu_q/cu_k [S + 1]`` ->
    ``(out [Tq, Hq, D], lse [Hq, Tq] fp32)``, not differentiable."""
    with torch.no_grad():
        return attention_with_lse(q_pack, k_pack, v_pack, softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
                                  family=default_family(q_pack.shape[-1], v_pack.shape[-1]))


def varlen_bwd(grad_out_pack, q_pack, k_pack, v_pack, out_pack, lse_pack, cu_q, cu_k, max_q: int, max_k: int,
               scale: float, causal: bool):
    """Packed THD backward from the caller's ``out_pack``/``lse_pack``: ``(dq [Tq, Hq, D], dk, dv [Tk, Hkv, D])``."""
    return bwd_op(grad_out_pack.contiguous(), q_pack, k_pack, v_pack, out_pack, lse_pack,
                  default_family(q_pack.shape[-1], v_pack.shape[-1]), float(scale), bool(causal), -1, -1,
                  cu_q, cu_k, int(max_q), int(max_k))
