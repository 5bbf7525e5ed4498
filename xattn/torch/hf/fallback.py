"""Exact fallbacks of the ``"ffpa"`` attention function: HF's own SDPA function, the model's own eager
function (softcap, attention sinks), and HF's FlexAttention function (flex ``BlockMask`` layers); and the
one-time warning that names why a layer left the kernels.

The functions are found as NeMo's module finds them, when a call runs: ``_get_sdpa()``, ``_get_eager()``
(HF Gemma 4's eager, for layers whose modeling file has none) and ``_get_flex()``, each of them a hook a
caller may replace on :mod:`xattn.torch.ffpa_attention` (:mod:`xattn.torch.hf.hooks`); the transformers
functions they return are looked up on their modules each time, so a patch of those is seen too.

All take and return what HF's attention interface does: query ``[B, Hq, Nq, D]``, key/value
``[B, Hkv, Nk, D/Dv]``, and return ``(out [B, Nq, Hq, Dv] contiguous, weights)``: ``weights`` are the eager
function's attention probabilities ``[B, Hq, Nq, Nk]`` (as the model's eager path returns them), None for
SDPA and FlexAttention (as theirs). Masks are the exact
4D masks ``[B, 1, Nq, Nk]`` (bool, True = attend; or a caller's additive float mask).

Warnings go to the logger of NeMo's module, ``xattn.torch.ffpa_attention`` (callers filter on that name),
as ``ffpa fallback to <target>: <message> (reason=<reason>)``, once per reason and process.
"""

from __future__ import annotations

import importlib
import logging
import sys

import torch

from . import hooks

__all__ = ["logger", "FALLBACK_WARNED", "FlexUnavailable", "warn_once", "get_sdpa", "get_flex", "get_eager",
           "nemo_state", "run_sdpa", "run_eager", "run_flex", "run_fallback", "run_exact_fallback",
           "eager_attention_forward"]

logger = logging.getLogger("xattn.torch.ffpa_attention")  # NeMo's module logger: the name callers filter on
FALLBACK_WARNED: set[str] = set()  # the reasons warned about so far (NeMo's ``_FALLBACK_WARNED``)
_SDPA_FN = _FLEX_FN = _EAGER_FN = None  # what the getters last found (NeMo's module state)
_MISSING: set[str] = set()  # modules that did not import (not tried again)
# FlexAttention's tiles for head dims over 256 (NeMo's): its default tiles do not fit in shared memory there.
FLEX_LARGE_HEAD_OPTIONS = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32,
                           "BLOCK_N2": 32, "num_stages": 1, "num_warps": 4}


class FlexUnavailable(ImportError, RuntimeError):
    """A flex ``BlockMask`` layer where HF's FlexAttention function is missing (a RuntimeError, as NeMo raises it)."""


def warn_once(reason: str, message: str, target: str = "sdpa") -> None:
    """Log ``ffpa fallback to <target>: <message> (reason=<reason>)`` once per reason and process, as NeMo's
    module logs it (:data:`logger`; the record's ``reason``/``target`` attributes hold both)."""
    if reason not in FALLBACK_WARNED:
        FALLBACK_WARNED.add(reason)
        logger.warning("ffpa fallback to %s: %s (reason=%r)", target, message, reason,
                       extra={"reason": reason, "target": target})


def _attribute_now(module_name: str, name: str):
    """``module_name.name`` as that module holds it now (a patch of it is seen), or None where either is missing.
    The module is imported on first use only; later calls are two lookups."""
    module = sys.modules.get(module_name)
    if module is None and module_name not in _MISSING:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            _MISSING.add(module_name)
    return getattr(module, name, None)


@hooks.default("_get_sdpa")
def get_sdpa():
    """HF's ``sdpa_attention_forward`` (NeMo's ``_get_sdpa``), or None without transformers."""
    global _SDPA_FN
    _SDPA_FN = _attribute_now("transformers.integrations.sdpa_attention", "sdpa_attention_forward")
    return _SDPA_FN


@hooks.default("_get_flex")
def get_flex():
    """HF's ``flex_attention_forward`` (NeMo's ``_get_flex``), or None where transformers or FlexAttention is
    missing."""
    global _FLEX_FN
    _FLEX_FN = _attribute_now("transformers.integrations.flex_attention", "flex_attention_forward")
    return _FLEX_FN


@hooks.default("_get_eager")
def get_eager():
    """HF Gemma 4's ``eager_attention_forward`` (NeMo's ``_get_eager``): the eager function of layers whose
    modeling file has none; None where transformers has no Gemma 4."""
    global _EAGER_FN
    _EAGER_FN = _attribute_now("transformers.models.gemma4.modeling_gemma4", "eager_attention_forward")
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
    """The eager function of the module's own modeling file (what ``attn_implementation="eager"`` runs), or None."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if callable(fn) else None


class _WithGroups:
    """A layer without ``num_key_value_groups`` as HF's eager functions read it (they repeat K/V heads by it):
    that attribute from the head counts, every other from the layer."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _eager_for(module, query, key, kwargs):
    """``(fn, module)``: the eager function of this call and the module to hand it.

    The layer's own (its modeling file's); else, for attention sinks, xattn's :func:`eager_attention_forward`
    (Gemma 4's has no ``s_aux``); else ``_get_eager()`` (the facade's hook: HF Gemma 4's), given a view of the
    layer with ``num_key_value_groups`` where it has none; xattn's where that returns None."""
    own = _model_eager(module)
    if own is not None:
        return own, module
    if kwargs.get("s_aux") is not None:
        return eager_attention_forward, module
    fn = (hooks.replaced("_get_eager") or get_eager)()
    if fn is None:
        return eager_attention_forward, module
    if not hasattr(module, "num_key_value_groups"):
        module = _WithGroups(module, query.shape[1] // key.shape[1])
    return fn, module


def _expand_gqa(module, query, key, value):
    """HF's SDPA function expands GQA by ``module.num_key_value_groups``; do it for modules without it."""
    g = query.shape[1] // key.shape[1]
    if g > 1 and getattr(module, "num_key_value_groups", 1) != g:
        return key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    return key, value


def run_sdpa(module, query, key, value, mask, dropout, scaling, kwargs):
    """HF's SDPA function (``_get_sdpa()``) with ``mask`` as given (``None`` only when the caller gave none); the
    eager function where it returns None, as NeMo degrades."""
    sdpa = (hooks.replaced("_get_sdpa") or get_sdpa)()
    if sdpa is None:
        return run_eager(module, query, key, value, mask, dropout, scaling, None, kwargs)
    key, value = _expand_gqa(module, query, key, value)
    kwargs = {n: x for n, x in kwargs.items() if n not in ("softcap", "s_aux")}
    return sdpa(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)


def run_eager(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """The eager function of the layer (:func:`_eager_for`), with an additive float mask as HF's eager masks are."""
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    fn, layer = _eager_for(module, query, key, kwargs)
    out, weights = fn(layer, query, key, value, mask, dropout=dropout, scaling=scaling, softcap=softcap, **kwargs)
    return out.contiguous(), weights


def run_flex(module, query, key, value, block_mask, scaling, softcap, kwargs):
    """HF's FlexAttention function (``_get_flex()``) on a ``BlockMask`` (it applies exactly what the block mask
    carries); head dims over 256 get small tiles (:data:`FLEX_LARGE_HEAD_OPTIONS`) unless ``kernel_options``
    are given. :class:`FlexUnavailable` where the function is missing: there is no exact fallback for it."""
    flex = (hooks.replaced("_get_flex") or get_flex)()
    if flex is None:
        raise FlexUnavailable("a flex BlockMask layer needs transformers' flex_attention_forward (torch >= 2.5, "
                              "pip install 'transformers>=5')")
    if max(query.shape[-1], value.shape[-1]) > 256 and "kernel_options" not in kwargs:
        kwargs = {**kwargs, "kernel_options": dict(FLEX_LARGE_HEAD_OPTIONS)}
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
