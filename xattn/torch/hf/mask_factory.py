"""The mask factory of ``"ffpa"`` (``ALL_MASK_ATTENTION_FUNCTIONS["ffpa"]``): HF's ``sdpa_mask`` arguments in,
the layer's launch plan out (:class:`~xattn.torch.hf.kernel_mask.PlannedMask`), or HF's own mask where the kernels
cannot reproduce it.

Shapes: ``B`` batch, ``Nq`` = ``q_length`` queries, ``Nk`` = ``kv_length`` keys; masks are ``[B, 1, Nq, Nk]``
bool (True = attend). ``config.ffpa_sliding_attn_backend`` (NeMo's knob; else :data:`SLIDING_BACKEND`, from
``XATTN_SLIDING_BACKEND``) picks the backend of the text model's non-causal layers.
"""

from __future__ import annotations

import functools
import os

import torch

from .. import cp_group
from .context_parallel import sharded_plan
from .fallback import warn_once
from .kernel_mask import KernelMask, PlannedMask
from .masks import describe, plan_hf_mask

__all__ = ["ffpa_mask", "SLIDING_BACKEND"]

# The backend of layers whose mask is not plain causal (sliding windows, documents, bidirectional blocks):
# a model config's ``ffpa_sliding_attn_backend`` (NeMo's knob) wins, else this default.
SLIDING_BACKEND = os.environ.get("XATTN_SLIDING_BACKEND", "fa4")
_SLIDING_BACKENDS = ("fa4", "flex", "sdpa")


def _sliding_backend(config) -> str:
    """The backend of non-causal layers: ``config.ffpa_sliding_attn_backend`` when the model config has it
    (NeMo: "flex" or "sdpa"; xattn adds "fa4", the kernels), else ``XATTN_SLIDING_BACKEND`` (default "fa4").
    ValueError for anything else, as NeMo raises it."""
    value = getattr(config, "ffpa_sliding_attn_backend", None)
    name = "ffpa_sliding_attn_backend" if value is not None else "XATTN_SLIDING_BACKEND"
    backend = str(SLIDING_BACKEND if value is None else value).lower()
    if backend not in _SLIDING_BACKENDS:
        raise ValueError(f"{name} must be 'flex', 'sdpa' or 'fa4', got {backend!r}.")
    return backend


def _is_sub_encoder(config) -> bool:
    """Vision / audio towers (``config.model_type`` containing "vision" or "audio", e.g. Gemma 4's) share the
    registry with the text model."""
    model_type = getattr(config, "model_type", "") or ""
    return "vision" in model_type or "audio" in model_type


def _hf_sdpa_mask(args: dict, extra: dict, **skip):
    """HF's own SDPA mask for the factory's arguments, marked as the factory's (the attention function knows
    it is HF's exact mask and does not warn again)."""
    from transformers import masking_utils as mu

    mask = mu.sdpa_mask(**args, **{"allow_is_causal_skip": False, **skip}, **extra)
    if mask is not None:
        mask._xattn_factory_fallback = True
    return mask


def ffpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask=None, dtype: torch.dtype = torch.float32, **kwargs):
    """Mask factory of ``"ffpa"`` (``ALL_MASK_ATTENTION_FUNCTIONS["ffpa"]``), same arguments as HF's ``sdpa_mask``.

    Returns ``torch.Tensor | BlockMask | None`` (NeMo's annotation; xattn never returns None):

    * a :class:`~xattn.torch.hf.kernel_mask.PlannedMask`: HF's exact SDPA mask (bool ``[B, 1, q_length,
      kv_length]``, True = attend, built only if read) carrying the launch plan, for every pattern the
      kernels run exactly (plain causal too, padding, sliding windows, packed documents, bidirectional,
      caches). NeMo returns None for plain causal layers without padding; that leaves the layer's
      kwargs (``is_causal``, ``sliding_window``) to decide a mask the factory knew, which they can
      contradict (the GPU fuzz found such calls), so the plan always travels with the mask.
    * HF's own SDPA mask (4D bool) where the kernels cannot reproduce the mask (chunked layers,
      image-token blocks, custom overlays, uneven right padding), with a warning naming the reason.
    * for non-causal masks (``mask_function`` other than HF's ``causal_mask_function``), the
      backend ``config.ffpa_sliding_attn_backend`` names (else ``XATTN_SLIDING_BACKEND``): "fa4" (the
      kernels, default), "flex" (HF's ``BlockMask``; the layer runs FlexAttention) or "sdpa" (HF's SDPA
      mask); anything else raises ValueError.
    * vision / audio sub-encoders (``config.model_type`` with "vision" or "audio", e.g. Gemma 4's towers)
      are planned like any layer (bidirectional over their padded patches: a PlannedMask), and the
      sliding backend setting does not apply to them. NeMo returns None there, which drops the
      sub-encoder's padding mask; xattn keeps sdpa's results.

    ``attention_mask`` is HF's 2D padding mask ``[B, >= kv_length]`` (its last ``kv_length`` columns are read).
    """
    from transformers import masking_utils as mu

    if isinstance(attention_mask, (KernelMask, PlannedMask)):
        return attention_mask  # prepared earlier (generate() with a static cache), as HF returns 4D masks
    q_length, kv_length, kv_offset = (int(x) for x in (q_length, kv_length, kv_offset))
    if not isinstance(q_offset, torch.Tensor):  # a static cache's is a device tensor: planned there, no sync
        q_offset = int(q_offset)
    config = kwargs.get("config")
    device = kwargs.pop("device", None) or (attention_mask.device if attention_mask is not None else "cpu")
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function or mu.causal_mask_function,
                attention_mask=attention_mask, device=device)
    extra = {n: x for n, x in kwargs.items() if n != "allow_is_causal_skip"}
    if not _is_sub_encoder(config) and mask_function is not None and mask_function is not mu.causal_mask_function:
        backend = _sliding_backend(config)
        if backend == "flex":
            return mu.flex_attention_mask(**args, **extra)
        if backend == "sdpa":
            return _hf_sdpa_mask(args, extra, allow_is_causal_skip=kwargs.get("allow_is_causal_skip", True))
    pattern = describe(args["mask_function"]) if attention_mask is None or attention_mask.dim() == 2 else None
    if cp_group.active_group() is not None:
        return PlannedMask(sharded_plan(pattern, args["mask_function"], args), device)
    return _planned_or_hf_mask(pattern, args, extra)


def _planned_or_hf_mask(pattern, args: dict, extra: dict):
    """The factory's answer on one device (no context parallelism): the :class:`PlannedMask` of ``pattern``
    (the :class:`~xattn.torch.hf.masks.Pattern` of ``args["mask_function"]``, None where it has none) with
    the padding of ``args["attention_mask"]``, or HF's SDPA mask after a warning naming why not."""
    from transformers import masking_utils as mu

    hf_sdpa_mask = functools.partial(_hf_sdpa_mask, args, extra)
    if pattern is None:
        fn = args["mask_function"]
        warn_once("mask_function", f"{getattr(fn, '__qualname__', fn)} is not a pattern the kernels reproduce "
                  "exactly (chunked, blockwise or custom masks)")
        return hf_sdpa_mask()
    attention_mask, kv_length, kv_offset = args["attention_mask"], args["kv_length"], args["kv_offset"]
    keep = padding_mask = None
    if attention_mask is not None:
        keep = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
        if attention_mask.shape[-1] >= kv_offset + kv_length:  # keep is a slice of it (nothing padded on)
            padding_mask = attention_mask
    plan = plan_hf_mask(pattern, args["batch_size"], args["q_length"], kv_length, args["q_offset"], kv_offset, keep,
                        args["device"], hf_sdpa_mask, padding_mask=padding_mask)
    if isinstance(plan, str):
        warn_once("mask", plan)
        return hf_sdpa_mask()
    return PlannedMask(plan, args["device"])
