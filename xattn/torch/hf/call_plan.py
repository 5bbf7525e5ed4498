"""The launch plan of one Hugging Face ``"ffpa"`` call, from what the layer hands over: the factory's
:class:`~xattn.torch.hf.kernel_mask.KernelMask`, a caller's 2D padding mask, or no mask at all (causality and
``sliding_window`` from the layer, FlashAttention-style ``cu_seq_lens_q/k`` or restarting ``position_ids``
for packed rows).

HF hands ``query [B, Hq, Nq, D]`` and ``key [B, Hkv, Nk, D]`` (SDPA layout). Windows are bottom-right
aligned (FlashAttention); ``sliding_window=w`` is HF's FlashAttention convention ``(w-1, 0)`` causal,
``(w-1, w-1)`` not.
"""

from __future__ import annotations

import torch

from .fallback import warn_once
from .kernel_mask import KernelMask, plan_without_mask, window_mask
from .masks import Pattern, hf_window, plan_hf_mask

__all__ = ["layer_is_causal", "layer_window", "plan_call", "padding_layout", "padding_plan", "padding_sdpa_mask"]


def layer_is_causal(module, kwargs) -> bool:
    """The layer's causality: ``is_causal`` from its kwargs, else ``module.is_causal`` (default True)."""
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def layer_window(module, kwargs) -> tuple[int | None, int | None]:
    """The kernel window of a layer without a factory mask (:func:`layer_is_causal`, ``sliding_window``)."""
    return hf_window(layer_is_causal(module, kwargs), kwargs.get("sliding_window"))


def _packed_kwargs(kwargs, batch: int, q_len: int):
    """``((cu_q, cu_k), (max_q, max_k))`` from ``cu_seq_lens_q/k`` or restarting ``position_ids``, else None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or batch != 1:
            raise ValueError("cu_seq_lens_q/cu_seq_lens_k: give both, with batch size 1 (packed rows)")
        mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        mq = int((cu_q[1:] - cu_q[:-1]).max()) if mq is None else int(mq)
        mk = int((cu_k[1:] - cu_k[:-1]).max()) if mk is None else int(mk)
        return (cu_q, cu_k), (mq, mk)
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or pos.dim() != 2 or pos.shape[-1] != q_len:
        return None
    starts = torch.nonzero(pos[0, 1:] - pos[0, :-1] != 1).flatten() + 1  # HF's rule: a step other than +1
    if starts.numel() == 0:
        return None
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([q_len])])
    longest = int((bounds[1:] - bounds[:-1]).max())
    return (bounds, bounds), (longest, longest)


def plan_call(module, query, key, attention_mask: KernelMask | None, kwargs) -> KernelMask:
    """The layer's plan: the factory's mask (plus FA-style ``cu_seq_lens_*`` documents) or one from kwargs."""
    if isinstance(attention_mask, KernelMask):
        attention_mask.check(query, key)
        if kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is None or attention_mask.varlen:
            _note_unseparated_documents(attention_mask, kwargs.get("position_ids"))
            return attention_mask
        if attention_mask.q_length != attention_mask.kv_length:
            raise ValueError("cu_seq_lens_q/k: packed documents with a KV cache are not supported")
        window = attention_mask.window
    else:
        window = layer_window(module, kwargs)
    packed = _packed_kwargs(kwargs, query.shape[0], query.shape[2])
    return plan_without_mask(query, key, window, *(packed or (None, None)))


def _note_unseparated_documents(plan: KernelMask, position_ids) -> None:
    """Restarting ``position_ids`` on a mask that does not separate documents (HF builds such masks
    when a cache is in use): run as SDPA does, documents attending to each other, and say so once."""
    if plan.varlen or plan.notes.get("positions_checked") or position_ids is None or position_ids.dim() != 2 \
            or plan.batch_size != 1 or plan.q_length != plan.kv_length or position_ids.shape[-1] != plan.q_length:
        return
    plan.notes["positions_checked"] = True
    if bool((position_ids[0, 1:] - position_ids[0, :-1] != 1).any()):
        warn_once("packed_position_ids", "position_ids restart, but HF's mask does not separate the documents "
                  "(a cache is in use): they attend to each other, as under sdpa. Pass use_cache=False, or "
                  "cu_seq_lens_q/k, to keep them apart", target="the mask as given")


def padding_layout(query, key, attention_mask) -> tuple[torch.Tensor, int]:
    """``(keep [B, Nk] bool, base)`` of a caller's 2D padding mask ``[B, W]`` (True/1 = real token):
    query ``i`` sits at key position ``base + i``.

    As HF's FlashAttention path (``_upad_input``) and NeMo read it: a mask as wide as the keys covers
    them; a wider one (sliding-window cache) covers the last ``Nk`` keys (``[:, -Nk:]``); a narrower
    one (static cache) covers the first ``W`` keys, the rest are empty cache slots that no query sees,
    and the queries are the last ``Nq`` of those ``W``. ValueError for a batch or width that cannot
    describe these keys."""
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask.shape[0] != b:
        raise ValueError(f"attention_mask: a 2D padding mask [batch, keys] needs batch {b}, got shape "
                         f"{tuple(attention_mask.shape)}")
    width = attention_mask.shape[1]
    keep = attention_mask.bool()
    if width >= nk:
        return keep[:, width - nk:], nk - nq
    if width < nq:
        raise ValueError(f"attention_mask: a 2D padding mask of {width} keys is narrower than the {nq} queries "
                         f"(key length {nk}); it must cover at least the queries' own positions")
    return torch.cat([keep, keep.new_zeros(b, nk - width)], dim=1), width - nq


def padding_plan(module, query, key, keep, base, kwargs) -> KernelMask | None:
    """The plan of a 2D padding mask (:func:`padding_layout`); causality and ``sliding_window`` from kwargs
    (HF's FlashAttention convention). None (after a warning) where SDPA would differ from the kernels
    (e.g. uneven right padding)."""
    window = layer_window(module, kwargs)
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    plan = plan_hf_mask(Pattern(*window), b, nq, nk, base, 0, keep, query.device,
                        lambda: padding_sdpa_mask(query, key, keep, base, window))
    if isinstance(plan, str):
        warn_once("mask", plan)
        return None
    return plan


def padding_sdpa_mask(query, key, keep, base, window) -> torch.Tensor:
    """The exact SDPA mask ``[B, 1, Nq, Nk]`` of a 2D padding mask (:func:`padding_layout`)."""
    return window_mask(query.shape[2], key.shape[2], base, window, query.device)[None, None] & keep[:, None, None, :]
