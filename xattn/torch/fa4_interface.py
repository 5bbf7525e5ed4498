"""FlashAttention 4's entry points on xattn's FA4 launchers, in ``flash_attn.cute``'s calling convention.

:func:`flash_attn_func` and :func:`flash_attn_varlen_func` take ``flash_attn.cute``'s arguments (names, order,
defaults) and return what it returns, ``(out, lse)``, computed by xattn's FA4 launchers (head dims 64, 96,
128, 192/128, 192, 256; fp16/bf16 on sm90) through :func:`xattn.torch.attention.attention_with_lse`.
Layouts are FlashAttention's: dense ``[B, N, H, D]``, varlen ``[T, H, D]`` with int32 ``cu_seqlens``; lse
``[B, H, N]`` / ``[H, T]`` fp32. A call using a feature xattn's launchers lack (``softcap``,
``mask_mod``/``score_mod``, ``deterministic=True``, ...) is handed to ``flash_attn.cute``'s own function with
the same arguments. :func:`load_fa4` returns the pair (NeMo's ``_load_fa4``, :mod:`xattn.torch.fa4`);
:func:`import_fa4_modules` imports the optional FA4 / CuTe DSL modules with one clear error.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from xattn.core.checks import check_window
from xattn.core.device import prepare_dsl_environment
from xattn.core.info import missing_modules
from xattn.core.spec import window_side

from .attention import attention_with_lse
from .kvcache import paged_attention

__all__ = ["import_fa4_modules", "load_fa4", "flash_attn_func", "flash_attn_varlen_func"]

_log = logging.getLogger("xattn.torch.fa4")  # the public module's logger (xattn.torch.fa4), where callers look
_PIP_HINT = "pip install flash-attn-4==4.0.0b36"
_FA4_PACKAGES = ("flash_attn", "cutlass", "tvm_ffi", "quack")  # what xattn's FA4 launchers import


def import_fa4_modules(*names: str) -> tuple[types.ModuleType, ...]:
    """Import the named modules (e.g. ``"flash_attn.cute.interface"``, ``"cutlass.cute"``) and return them as a
    tuple in the order given; no names gives ``()``.

    Every module that fails to import is listed in ONE ``ImportError`` that ends with the pip command for
    FA4. On a machine without a GPU the CuTeDSL target is pinned to sm_90a first (xattn does this before
    any kernel import), so importing cutlass here does not fix it to another arch."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"names: expected module names (str), got {type(name).__name__}")
    if names:
        prepare_dsl_environment()
    modules, missing = [], []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        raise ImportError(f"FlashAttention 4 / CuTe DSL modules missing: {'; '.join(missing)}. {_PIP_HINT}")
    return tuple(modules)


# Arguments that pick how flash_attn.cute splits the work, never the result: accepted and ignored.
_SCHEDULING_HINTS = frozenset({"num_splits", "pack_gqa", "min_seqlen_k", "scheduler_metadata",
                               "seqlen_k_per_split", "disable_scheduler_metadata"})
_SERVED = frozenset({"q", "k", "v", "softmax_scale", "causal", "window_size", "return_lse", "cu_seqlens_q",
                     "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"})


def _missing_packages() -> list[str]:
    return missing_modules(_FA4_PACKAGES)


@functools.cache
def load_fa4() -> tuple[Callable, Callable]:
    """The FA4 dense and varlen entry points ``(flash_attn_func, flash_attn_varlen_func)``, resolved once.

    They take ``flash_attn.cute``'s arguments (names, order, defaults) and return what it returns,
    ``(out, lse)``, but run on xattn's launchers (see :func:`flash_attn_func`). Raises ``ImportError``
    with the pip command when the FA4 stack is not installed (checked without importing it)."""
    missing = _missing_packages()
    if missing:
        raise ImportError(f"FlashAttention 4 needs the Python packages {', '.join(missing)}: {_PIP_HINT}")
    return flash_attn_func, flash_attn_varlen_func


@functools.cache
def _defaults(fn) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def _unserved(fn, given: dict[str, Any]) -> str | None:
    """The first argument of ``fn`` set away from its default that xattn's launchers do not serve, else None."""
    for name, default in _defaults(fn).items():
        if name in _SERVED or name in _SCHEDULING_HINTS:
            continue
        value = given[name]
        if value is default or (not isinstance(value, torch.Tensor) and value == default):
            continue
        return name
    if given["return_lse"] and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (given["q"], given["k"], given["v"])):
        return "return_lse under autograd"  # flash_attn.cute differentiates through its lse; xattn's has no gradient
    return None


_HANDED_OVER: set[str] = set()


def _flash_attn_cute(fn, given: dict[str, Any]):
    """``flash_attn.cute``'s own ``fn`` on the caller's arguments, or None when xattn's launchers serve them all.
    The first hand-over per argument is logged (INFO)."""
    why = _unserved(fn, given)
    if why is None:
        return None
    if why not in _HANDED_OVER:
        _HANDED_OVER.add(why)
        _log.info("xattn fa4: %s runs on flash_attn.cute's own %s (xattn's launchers lack it)", why, fn.__name__)
    (interface,) = import_fa4_modules("flash_attn.cute.interface")
    return getattr(interface, fn.__name__)(**given)


def _paged_served(given: dict[str, Any]) -> bool:
    """A paged call xattn's paged launchers serve (:func:`xattn.torch.paged_attention`): ``page_table`` and
    ``seqused_k`` with q packed by ``cu_seqlens_q`` or dense, keys only through the table (no
    ``cu_seqlens_k``), no gradient, and nothing else xattn lacks. Any head dim xattn runs (d512 on FFPA: the
    call vLLM makes for Gemma 4's global layers)."""
    if given["page_table"] is None or given["seqused_k"] is None or given["cu_seqlens_k"] is not None:
        return False
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (given["q"], given["k"], given["v"])):
        return False
    return _unserved(flash_attn_varlen_func, {**given, "page_table": None, "seqused_k": None}) is None


def _fa4_window(causal: bool, window_size) -> tuple:
    """flash_attn.cute's reading of ``window_size``: ``(-1, -1)`` means unbounded; causal forces right = 0.
    Each side is first judged as everywhere in xattn (``None`` / ``-1`` unbounded, other negatives raise),
    also the right side that causality then overrides."""
    left, right = check_window(window_size)
    window_side("left", left)
    window_side("right", right)
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal and (left is not None or right is not None):
        right = 0
    return left, right


def _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse, **varlen):
    """``(out, lse)`` as flash_attn.cute returns them: lse is None unless asked for or q/k/v require grad."""
    needs_grad = any(t.requires_grad for t in (q, k, v))
    out, lse = attention_with_lse(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=_fa4_window(causal, window_size), family="fa4", **varlen)
    return out, (lse if return_lse or needs_grad else None)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """``flash_attn.cute.flash_attn_func`` on xattn's FA4 launchers: q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]``
    -> ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] fp32 or None)``; out is differentiable.

    Served: ``softmax_scale`` (None = 1/sqrt(D)), ``causal`` and ``window_size`` (bottom-right aligned),
    ``return_lse`` (outside autograd). Scheduling hints (``num_splits``, ``pack_gqa``) are ignored. A call
    with any other argument away from its default (``qv``, ``softcap``, ``learnable_sink``,
    ``score_mod``/``mask_mod``, block sparsity, ``deterministic=True``, the sparse-MLA gather options) or
    ``return_lse=True`` under autograd runs on ``flash_attn.cute.flash_attn_func`` itself, same arguments
    (ImportError with the pip command where it is not installed)."""
    handed = _flash_attn_cute(flash_attn_func, locals())
    if handed is not None:
        return handed
    return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse)


def _max_len(cu_seqlens, given) -> int:
    if given is not None:
        return int(given)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """``flash_attn.cute.flash_attn_varlen_func`` on xattn's FA4 launchers: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D/Dv]``,
    int32 ``cu_seqlens_q/k [S + 1]`` -> ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32 or None)``.

    As :func:`flash_attn_func`, plus: ``max_seqlen_q/k`` default to the longest segment (read on the
    host); without cu_seqlens, q/k/v are dense ``[B, N, H, D]``. A paged call (``page_table`` with
    ``seqused_k``, k/v pools ``[num_pages, page_size, Hkv, D]``, no ``cu_seqlens_k``, no gradient) runs on
    xattn's paged launchers (:func:`xattn.torch.paged_attention`, any head dim xattn runs). ``seqused_q``,
    a ``page_table`` without ``seqused_k`` and the other unserved arguments hand the call to
    ``flash_attn.cute.flash_attn_varlen_func`` itself.

    Checked mode: the signature is flash_attn.cute's, so there is no ``check_inputs`` keyword here;
    ``XATTN_CHECK_INPUTS=1`` checks cu_seqlens on their device before the launch (int32, start 0,
    non-decreasing, end <= T, segments <= max_seqlen; one host sync; a ``ValueError`` naming the first
    bad index). Unchecked (the default), bad cu_seqlens are undefined behaviour, as in flash_attn.cute."""
    given = dict(locals())
    if _paged_served(given):
        out, lse = paged_attention(q, k, v, page_table, seqused_k, cu_seqlens_q=cu_seqlens_q,
                                   max_seqlen_q=max_seqlen_q if cu_seqlens_q is not None else None,
                                   softmax_scale=softmax_scale, causal=causal,
                                   window_size=_fa4_window(causal, window_size), return_softmax_lse=True)
        return out, (lse if return_lse else None)
    handed = _flash_attn_cute(flash_attn_varlen_func, given)
    if handed is not None:
        return handed
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse)
    if cu_seqlens_q is None or cu_seqlens_k is None:  # one side packed: flash_attn.cute's own function
        (interface,) = import_fa4_modules("flash_attn.cute.interface")
        return interface.flash_attn_varlen_func(**given)
    return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=_max_len(cu_seqlens_q, max_seqlen_q),
                    max_seqlen_k=_max_len(cu_seqlens_k, max_seqlen_k))
