"""Hugging Face continuous batching (``model.generate_batch``, ``init_continuous_batching``) on xattn's kernels.

transformers (5.25) runs continuous batching only under ``"paged|eager"``, ``"sdpa"`` or an implementation whose
name contains ``"flash"`` (``switch_to_cb_friendly_attn``); ``"ffpa"`` is refused there. So xattn registers its
attention function a second time, as :data:`NAME` (``"ffpa_flash"``), with a thin adapter for what continuous
batching hands over:

* every call is packed: ``query [1, Hq, Tq, D]``, ``key/value [1, Hkv, Tk, D]`` (the cache already updated and
  each request's keys gathered contiguously by HF), ``cu_seq_lens_q/k`` int32 and ``max_length_q/k`` ints, prefill
  chunks and decoding steps mixed in one batch; ``"ffpa"``'s packed path (``xattn.torch.hf.routing``) runs them
  on the varlen kernels, sliding layers with their window;
* on layers that reuse another layer's keys (``num_kv_shared_layers``) ``cu_seq_lens_k`` / ``max_length_k`` come
  as a dict keyed by layer type: the adapter picks the layer's own;
* the cache's bookkeeping arguments (``read_index``, ``write_index``, ``logits_indices``, ...) are HF's: dropped;
* HF's decode fast path (``block_table`` with the layer's page views ``k_cache``/``v_cache``; one token per request;
  key/value are the new rows only, not yet in the cache): the new rows are appended through the table and the
  queries attend over the pages (:func:`xattn.torch.attention_with_kvcache` with ``page_table``), as HF's
  FlashAttention path does with ``flash_attn_with_kvcache``. transformers 5.25 turns that path on only for
  FlashAttention 2/3 names and models without sliding layers, so it reaches xattn only when asked for directly.

:func:`enable_continuous_batching` sets the name on a model's config directly: ``set_attn_implementation`` with a
name containing "flash" would try to load a FlashAttention kernel from the Hub. Known limit of transformers 5.25,
not of xattn: its continuous-batching cache sizes every full-attention layer by one head dim, so Gemma 4 models
whose global layers have their own (``global_head_dim``) fail there under every implementation, sdpa included.
"""

from __future__ import annotations

import torch

__all__ = ["NAME", "attention_forward", "paged_decode", "register_continuous_batching", "enable_continuous_batching",
           "batching_config", "unsupported_reason"]

NAME = "ffpa_flash"
_HF_ONLY = ("read_index", "write_index", "logits_indices", "logits_processor_args", "block_table", "k_cache",
            "v_cache")


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``"ffpa"``'s attention function (:func:`xattn.torch.ffpa_attention.ffpa_attention_forward`) on a continuous
    batching call: returns ``(out [1, Tq, Hq, Dv], None)``."""
    from xattn.torch import ffpa_attention

    for name in ("cu_seq_lens_k", "max_length_k"):
        if isinstance(kwargs.get(name), dict):  # a layer reusing another's keys: its layer type's entry
            kwargs[name] = kwargs[name][module.layer_type]
    if kwargs.get("block_table") is not None:
        return paged_decode(module, query, key, value, **kwargs), None
    for name in _HF_ONLY:
        kwargs.pop(name, None)
    return ffpa_attention.ffpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def paged_decode(module, query, key, value, *, block_table, k_cache, v_cache, cu_seq_lens_k, scaling=None,
                 dropout: float = 0.0, softcap=None, **kwargs):
    """HF's decode fast path: query ``[1, Hq, n, D]`` and the new key/value ``[1, Hkv, n, D/Dv]`` of n requests (one
    token each), the layer's page views ``k_cache/v_cache [num_pages, page_size, Hkv, D/Dv]``, ``block_table [n,
    max_pages]`` int32 and ``cu_seq_lens_k`` counting the new token: appends the rows at each request's length and
    returns ``out [1, n, Hq, Dv]``. Options with no paged kernel (dropout, softcap, sinks) raise."""
    from xattn.torch import attention_with_kvcache

    from .call_plan import layer_window

    if dropout or softcap or kwargs.get("s_aux") is not None:
        raise NotImplementedError("continuous batching's block-table decode: dropout, softcap and attention sinks "
                                  "have no paged kernel; turn the decode fast path off (max_blocks_per_request=0)")
    n, hq, hkv = query.shape[2], query.shape[1], key.shape[1]
    if query.shape[0] != 1 or key.shape[2] != n or block_table.shape[0] < n:
        raise ValueError(f"block_table decode: expected query [1, Hq, n, D] with one key row per request and a table "
                         f"of n rows, got {tuple(query.shape)} / {tuple(key.shape)} / {tuple(block_table.shape)}")
    rows = lambda t, h: t.transpose(1, 2).reshape(n, 1, h, t.shape[-1])  # noqa: E731  [n, 1, H, D]
    cache_seqlens = (cu_seq_lens_k[1:n + 1] - cu_seq_lens_k[:n] - 1).to(torch.int32)
    left, right = layer_window(module, kwargs)
    out = attention_with_kvcache(rows(query, hq), k_cache, v_cache, rows(key, hkv), rows(value, hkv),
                                 cache_seqlens=cache_seqlens, softmax_scale=scaling, causal=True,
                                 window_size=(-1 if left is None else left, -1 if right is None else right),
                                 page_table=block_table[:n])
    return out.view(1, n, hq, out.shape[-1])


def register_continuous_batching() -> str:
    """Register :data:`NAME` with HF's attention and mask interfaces (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from xattn.torch import ffpa_attention

    ffpa_attention.register_ffpa_attention()
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, ffpa_attention.ffpa_mask)
    return NAME


def enable_continuous_batching(model) -> None:
    """Run ``model``'s attention as :data:`NAME`, so ``model.generate_batch(...)`` keeps xattn's kernels (ordinary
    ``generate``/``forward`` calls run the same function). Sets the name on the model's (text) config.
    RuntimeError (:func:`unsupported_reason`) on a transformers whose continuous batching has the older contract."""
    reason = unsupported_reason()
    if reason:
        raise RuntimeError(reason)
    register_continuous_batching()
    configs = {id(model.config): model.config}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None:
        configs[id(text)] = text
    for config in configs.values():
        config._attn_implementation = NAME


def unsupported_reason() -> str | None:
    """Why this transformers' continuous batching cannot run xattn's adapter, or None. Before the contract this
    module serves (transformers 5.25: HF updates the paged cache and gathers each request's keys), continuous
    batching called ``"paged|<name>"`` attention functions that update the cache themselves (transformers 5.17
    registers ``"paged|sdpa"``, ``"paged|flash_attention_2"``, ...) and refuses any other name."""
    import transformers
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS.valid_keys():
        return (f"transformers {transformers.__version__}: its continuous batching runs 'paged|' attention functions "
                f"that update the paged cache themselves; xattn's adapter serves the later contract (transformers "
                f"5.25, where HF updates the cache and passes each request's keys): upgrade transformers")
    return None


def batching_config(page_size: int | None = None, **kwargs):
    """transformers' ``ContinuousBatchingConfig(**kwargs)`` across its versions, for a run that compares attention
    implementations: ``page_size`` (rows per cache page) goes to the field of that name (5.17 and later) or to
    ``block_size`` (before), and ``auto_switch_to_flash=False`` is set where the field exists (5.25), so a model
    loaded with ``"sdpa"`` stays on sdpa instead of being moved to a FlashAttention build. Any other keyword is
    passed as given (a name this transformers lacks raises its TypeError)."""
    import dataclasses

    from transformers.generation import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if page_size is not None:
        kwargs["page_size" if "page_size" in fields else "block_size"] = page_size
    if "auto_switch_to_flash" in fields:
        kwargs.setdefault("auto_switch_to_flash", False)
    return ContinuousBatchingConfig(**kwargs)
