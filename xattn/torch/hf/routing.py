"""The ``"ffpa"`` attention function: one Hugging Face call routed onto the kernels, where they are exact, or
onto an exact fallback.

* A plan (:class:`~xattn.torch.hf.kernel_mask.KernelMask`, from the mask factory, a 2D padding mask or the
  layer's kwargs: :mod:`xattn.torch.hf.call_plan`) runs on the kernels (FFPA for head_dim 320-512, FA4 for
  <= 256 and windows) when dtype, scaling, head dims and options allow (:mod:`xattn.torch.hf.support`).
* Otherwise it falls back exactly (:mod:`xattn.torch.hf.fallback`): SDPA with the layer's exact mask, the
  model's own eager function for ``softcap`` or ``s_aux`` sinks, FlexAttention for a ``BlockMask``, SDPA
  with the mask as it reads when the factory's mask was edited in place (its plan no longer describes it);
  each reason is logged once.
* Under context parallelism the layer runs on this rank's shard (:mod:`xattn.torch.hf.context_parallel`).
* NeMo's hooks are looked up on :mod:`xattn.torch.ffpa_attention` when the call runs
  (:mod:`xattn.torch.hf.hooks`): ``_is_block_mask``, ``_ffpa_low_level_ready``, the fallback getters, and a
  caller's ``_get_ffpa_high_level``, whose function then runs the dense FFPA calls as NeMo's does.

HF hands ``query [B, Hq, Nq, D]`` and ``key/value [B, Hkv, Nk, D/Dv]`` (SDPA layout); the kernels read
``[B, N, H, D]`` views of them (no copy) and the function returns ``[B, Nq, Hq, Dv]`` contiguous. Never
assumes 1/sqrt(d) (Gemma 4 uses ``scaling=1.0``).
"""

from __future__ import annotations

import functools
import math

import torch

from xattn.core.spec import family_for

from .. import cp_group
from ..ops import attention_op, fwd_lengths
from . import fallback, hooks, support
from .call_plan import layer_window, padding_layout, padding_plan, padding_sdpa_mask, plan_call
from .context_parallel import run_sharded
from .kernel_mask import KernelMask, PlannedMask

__all__ = ["ffpa_attention_forward", "is_block_mask"]


@functools.cache
def _block_mask_type() -> type | None:
    """flex_attention's ``BlockMask`` class (imported once), or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    return BlockMask


@hooks.default("_is_block_mask")
def is_block_mask(mask) -> bool:
    """True for a flex ``BlockMask``: that layer runs on FlexAttention."""
    if mask is None or isinstance(mask, (KernelMask, PlannedMask)):
        return False
    kind = _block_mask_type()
    return kind is not None and isinstance(mask, kind)


def _check_inputs(query, key, value, scaling) -> None:
    """TypeError/ValueError naming the argument for what neither the kernels nor SDPA can run."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor [batch, heads, sequence, head_dim], got "
                            f"{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, sequence, head_dim] (SDPA layout), got shape "
                             f"{tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if scaling is not None and (isinstance(scaling, bool) or not math.isfinite(float(scaling))):
        raise ValueError(f"scaling: expected a finite float, got {scaling!r}")


def attention(q, k, v, *, family: str, softmax_scale: float, causal: bool, window_size, cu_seqlens_q=None,
              cu_seqlens_k=None, max_seqlen_q: int = 0, max_seqlen_k: int = 0, lengths=None):
    """The kernels' op (:func:`xattn.torch.ops.attention_op`) on ``[B, N, H, D]`` / packed ``[T, H, D]`` views;
    returns out. The call's scale and window were checked once, before this (``scaling`` by
    :func:`_check_inputs` and :func:`support.fallback_reason`, a positive finite float; the window is the plan's,
    the kernels' canonical form), so the public entry's checks
    (:func:`xattn.torch.attention.attention_with_lse`) are not run a second time. ``lengths`` (int32 ``[B]``,
    dense views, no gradient): each row's first ``lengths[b]`` keys, on :func:`xattn.torch.ops.fwd_lengths`."""
    left, right = window_size
    if lengths is not None:
        return fwd_lengths(q, k, v, lengths, family, softmax_scale, causal, -1 if left is None else left,
                           -1 if right is None else right)[0]
    return attention_op(q, k, v, family, softmax_scale, causal, -1 if left is None else left,
                        -1 if right is None else right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)[0]


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last stride (the kernels read rows with unit stride), copied only where it has not."""
    return t.contiguous() if t.stride(-1) != 1 and t.shape[-1] > 1 else t


def _run_kernels(plan: KernelMask, query, key, value, scaling):
    """The kernels on ``[B, N, H, D]`` views; returns ``[B, Nq, Hq, Dv]`` contiguous."""
    if plan.kv_start or plan.kv_stop is not None:
        key, value = key[:, :, plan.kv_start:plan.kv_stop], value[:, :, plan.kv_start:plan.kv_stop]
    q, k, v = (_unit_stride(x.transpose(1, 2)) for x in (query, key, value))
    windowed = support.is_windowed(plan.window)
    kw = dict(softmax_scale=float(scaling), causal=plan.causal, window_size=plan.window if windowed else (None, None),
              family=family_for(query.shape[-1], value.shape[-1], windowed))
    if not plan.varlen:
        return attention(q, k, v, **kw)
    if plan.lengths is not None and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))):
        return attention(q, k, v, lengths=plan.lengths, **kw)  # a static cache: the decoding route (split-KV)
    b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    out = attention(q.reshape(b * nq, *q.shape[2:]), k.reshape(b * nk, *k.shape[2:]),
                    v.reshape(b * nk, *v.shape[2:]), cu_seqlens_q=plan.cu_seqlens_q,
                    cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
                    max_seqlen_k=plan.max_seqlen_k, **kw)
    return out.reshape(b, nq, *out.shape[1:])


def _warn(reason: tuple[str, str]) -> None:
    fallback.warn_once(*reason, target="eager" if reason[0] in ("softcap", "s_aux") else "sdpa")


def _warn_mask_fallback(module, query, value, mask, dropout, scaling, softcap, kwargs) -> None:
    """The warning of a 4D mask tensor, which runs as given: in NeMo's order, first why the call's dtype or options
    (then the kernels) would keep it off the kernels anyway, else that the mask does (not for HF's own mask from
    the factory: the factory warned already)."""
    reason = support.option_reason(module, query, dropout, scaling, softcap, kwargs) or support.kernel_reason(
        query, value, (None, None))
    if reason is not None:
        _warn(reason)
    elif not getattr(mask, "_xattn_factory_fallback", False):
        fallback.warn_once("4d_mask", "a mask tensor from outside the ffpa mask factory runs on SDPA as given")


def _high_level_serves(plan: KernelMask, query, value) -> bool:
    """Whether NeMo's dense path (``_get_ffpa_high_level``) serves this plan: one dense FFPA call, causal or not."""
    return not plan.varlen and not support.is_windowed(plan.window) and \
        family_for(query.shape[-1], value.shape[-1], False) == "ffpa"


def _run_high_level(get, plan: KernelMask, query, key, value, scaling):
    """NeMo's dense path through a caller's ``_get_ffpa_high_level``: ``fn, backend = get()``, then ``fn`` with
    SDPA's signature on the SDPA-layout tensors; ``[B, Nq, Hq, Dv]`` contiguous, or None where ``fn`` is None."""
    fn, backend = get()
    if fn is None:
        return None
    if plan.kv_start or plan.kv_stop is not None:
        key, value = key[:, :, plan.kv_start:plan.kv_stop], value[:, :, plan.kv_start:plan.kv_stop]
    out = fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=plan.causal, scale=float(scaling),
             enable_gqa=True, backend=backend)
    return out.transpose(1, 2).contiguous()


def ffpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           softcap=None, **kwargs):
    """HF attention function: query ``[B, Hq, Nq, D]``, key/value ``[B, Hkv, Nk, D/Dv]`` -> ``(out [B, Nq, Hq, Dv]
    contiguous, weights)``; the kernels where exact, else the exact fallback (see the module docstring).
    ``weights`` is None except on the eager fallback (softcap, ``s_aux``), which returns the model's eager
    attention probabilities ``[B, Hq, Nq, Nk]``, as ``attn_implementation="eager"`` does.
    Non-tensor, non-4D or non-floating inputs and a NaN/inf ``scaling`` raise TypeError/ValueError naming
    the argument; ``scaling <= 0`` runs on SDPA (the kernels take a positive scale)."""
    _check_inputs(query, key, value, scaling)
    if isinstance(attention_mask, PlannedMask):
        attention_mask = attention_mask.plan
    if isinstance(attention_mask, KernelMask) and attention_mask.edited():  # its plan no longer describes it
        attention_mask.check(query, key)
        fallback.warn_once("edited_mask", "the ffpa factory's mask was edited in place: it runs on SDPA as it reads")
        return fallback.run_exact_fallback(module, query, key, value, attention_mask.sdpa_mask(), dropout, scaling,
                                           softcap, kwargs)
    group = cp_group.active_group()
    if group is not None:
        return run_sharded(group, module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs), None
    if (hooks.replaced("_is_block_mask") or is_block_mask)(attention_mask):
        return fallback.run_flex(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        keep, base = padding_layout(query, key, attention_mask)
        plan = padding_plan(module, query, key, keep, base, kwargs)
        if plan is None:
            mask = padding_sdpa_mask(query, key, keep, base, layer_window(module, kwargs))
            return fallback.run_exact_fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs)
    elif attention_mask is not None and not isinstance(attention_mask, KernelMask):
        _warn_mask_fallback(module, query, value, attention_mask, dropout, scaling, softcap, kwargs)
        return fallback.run_fallback(module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs)
    else:
        plan = plan_call(module, query, key, attention_mask, kwargs)
    reason = support.fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs)
    if reason is not None:
        _warn(reason)
        return fallback.run_exact_fallback(module, query, key, value, plan.sdpa_mask(), dropout, scaling, softcap,
                                           kwargs)
    high_level = hooks.replaced("_get_ffpa_high_level")
    if high_level is not None and _high_level_serves(plan, query, value):
        out = _run_high_level(high_level, plan, query, key, value, scaling)
        if out is not None:
            return out, None
        fallback.warn_once("ffpa_attn_func_unavailable", "_get_ffpa_high_level() gave no function")
        return fallback.run_exact_fallback(module, query, key, value, plan.sdpa_mask(), dropout, scaling, softcap,
                                           kwargs)
    return _run_kernels(plan, query, key, value, scaling), None
