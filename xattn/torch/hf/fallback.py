"""Exact fallbacks of the ``"ffpa"`` attention function: HF's own SDPA function, the model's own eager
function (softcap, attention sinks), and HF's FlexAttention function (flex ``BlockMask`` layers); and the
one-time warning that names why a layer left the kernels.

All take and return what HF's attention interface does: query ``[B, Hq, Nq, D]``, key/value
``[B, Hkv, Nk, D/Dv]``, and return ``(out [B, Nq, Hq, Dv] contiguous, weights)``: ``weights`` are the eager
function's attention probabilities ``[B, Hq, Nq, Nk]`` (as the model's eager path returns them), None for
SDPA and FlexAttention (as theirs). Masks are the exact
4D masks ``[B, 1, Nq, Nk]`` (bool, True = attend; or a caller's additive float mask).

Warnings go to the logger of NeMo's module, ``xattn.torch.ffpa_attention`` (callers filter on that name),
as ``ffpa fallback to <target>: <message> (reason=<reason>)``, once per reason and process.
"""

from __future__ import annotations

import logging
import sys

import torch

__all__ = ["logger", "FALLBACK_WARNED", "warn_once", "get_sdpa", "get_flex", "get_eager", "cached_sdpa",
           "cached_flex", "cached_eager", "nemo_state", "run_sdpa", "run_eager", "run_flex", "run_fallback",
           "run_exact_fallback", "eager_attention_forward"]

logger = logging.getLogger("xattn.torch.ffpa_attention")  # NeMo's module logger: the name callers filter on
FALLBACK_WARNED: set[str] = set()  # the reasons warned about so far (NeMo's ``_FALLBACK_WARNED``)
_SDPA_FN = _FLEX_FN = _EAGER_FN = None  # what the cached getters resolved (NeMo's module state)


def warn_once(reason: str, message: str, target: str = "sdpa") -> None:
    """Log ``ffpa fallback to <target>: <message> (reason=<reason>)`` once per reason and process, as NeMo's
    module logs it (:data:`logger`; the record's ``reason``/``target`` attributes hold both)."""
    if reason not in FALLBACK_WARNED:
        FALLBACK_WARNED.add(reason)
        logger.warning("ffpa fallback to %s: %s (reason=%r)", target, message, reason,
                       extra={"reason": reason, "target": target})


def get_sdpa():
    """HF's ``sdpa_attention_forward``, or None without transformers."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:
        return None
    return sdpa_attention_forward


def get_flex():
    """HF's ``flex_attention_forward``, or None where transformers or FlexAttention is missing."""
    try:
        from transformers.integrations.flex_attention import flex_attention_forward
    except ImportError:
        return None
    return flex_attention_forward


def get_eager():
    """xattn's generic eager attention (softcap and ``s_aux`` sinks), HF signature."""
    return eager_attention_forward


def cached_sdpa():
    """:func:`get_sdpa`, resolved once and kept (NeMo's ``_get_sdpa``)."""
    global _SDPA_FN
    _SDPA_FN = _SDPA_FN or get_sdpa()
    return _SDPA_FN


def cached_flex():
    """:func:`get_flex`, resolved once and kept (NeMo's ``_get_flex``)."""
    global _FLEX_FN
    _FLEX_FN = _FLEX_FN or get_flex()
    return _FLEX_FN


def cached_eager():
    """:func:`get_eager`, resolved once and kept (NeMo's ``_get_eager``)."""
    global _EAGER_FN
    _EAGER_FN = _EAGER_FN or get_eager()
    return _EAGER_FN


def nemo_state() -> dict:
    """This module's state under NeMo's names (``_SDPA_FN``, ``_FLEX_FN``, ``_EAGER_FN``), read now."""
    return {"_SDPA_FN": _SDPA_FN, "_FLEX_FN": _FLEX_FN, "_EAGER_FN": _EAGER_FN}


def eager_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                            softcap=None, s_aux=None, **kwargs):
    """Attention in fp32 scores: ``tanh`` softcap, optional per-head sink logits ``s_aux [Hq]`` (their
    probability mass is dropped, as in gpt-oss), a bool (True = attend) or additive 4D mask."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
            else s + attention_mask.float()
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    p = torch.nn.functional.dropout(p.nan_to_num(0.0), p=dropout, training=getattr(module, "training", False))
    p = p.to(v.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous(), p


def _model_eager(module):
    """The eager function of the module's own modeling file (what ``attn_implementation="eager"`` runs)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else eager_attention_forward


def _expand_gqa(module, query, key, value):
    """HF's SDPA function expands GQA by ``module.num_key_value_groups``; do it for modules without it."""
    g = query.shape[1] // key.shape[1]
    if g > 1 and getattr(module, "num_key_value_groups", 1) != g:
        return key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    return key, value


def run_sdpa(module, query, key, value, mask, dropout, scaling, kwargs):
    """HF's SDPA function with ``mask`` as given (``None`` only when the caller gave none)."""
    sdpa = get_sdpa()
    key, value = _expand_gqa(module, query, key, value)
    if sdpa is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                               scale=scaling)
        return out.transpose(1, 2).contiguous(), None
    kwargs = {n: x for n, x in kwargs.items() if n not in ("softcap", "s_aux")}
    return sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def run_eager(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """The model's own eager function (additive float mask, as HF's eager masks are)."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    out, weights = _model_eager(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                        softcap=softcap, **kwargs)
    return out.contiguous(), weights


def run_flex(module, query, key, value, block_mask, scaling, softcap, kwargs):
    """HF's FlexAttention function on a ``BlockMask`` (it applies exactly what the block mask carries)."""
    flex = get_flex()
    if flex is None:
        raise ImportError("a flex BlockMask needs transformers' flex_attention_forward (torch >= 2.5)")
    out, _ = flex(module, query, key, value, block_mask, scaling=scaling, softcap=softcap, **kwargs)
    return out, None


def run_fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """The exact fallback of a layer: the model's eager function for ``softcap`` / ``s_aux`` sinks, else
    HF's SDPA function, with ``mask`` as given."""
    if softcap is not None or kwargs.get("s_aux") is not None:
        return run_eager(module, query, key, value, mask, dropout, scaling, softcap, kwargs)
    return run_sdpa(module, query, key, value, mask, dropout, scaling, kwargs)


def run_exact_fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """:func:`run_fallback` with a mask xattn built (bool ``[B, 1, Nq, Nk]``): rows that see no key come out 0,
    as on the kernels. SDPA leaves them to its backend (CUDA's memory-efficient kernel returns nonzero
    values there, measured on the H200; the CPU returns 0), so the result would depend on the device."""
    out, weights = run_fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs)
    dead = ~mask.any(-1)  # [B or 1, 1, Nq]
    if bool(dead.any()):
        out = out.masked_fill(dead[:, 0, :, None, None], 0.0)
    return out, weights
