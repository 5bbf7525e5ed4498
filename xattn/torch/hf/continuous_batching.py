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
* the cache's bookkeeping arguments (``read_index``, ``write_index``, ``logits_indices``, ...) are HF's: dropped.

:func:`enable_continuous_batching` sets the name on a model's config directly: ``set_attn_implementation`` with a
name containing "flash" would try to load a FlashAttention kernel from the Hub. Known limit of transformers 5.25,
not of xattn: its continuous-batching cache sizes every full-attention layer by one head dim, so Gemma 4 models
whose global layers have their own (``global_head_dim``) fail there under every implementation, sdpa included.
"""

from __future__ import annotations

__all__ = ["NAME", "attention_forward", "register_continuous_batching", "enable_continuous_batching"]

NAME = "ffpa_flash"
_HF_ONLY = ("read_index", "write_index", "logits_indices", "logits_processor_args", "block_table")


def attention_forward(module, query, key, value, attention_mask, **kwargs):
    """``"ffpa"``'s attention function (:func:`xattn.torch.ffpa_attention.ffpa_attention_forward`) on a continuous
    batching call: returns ``(out [1, Tq, Hq, Dv], None)``."""
    from xattn.torch import ffpa_attention

    for name in ("cu_seq_lens_k", "max_length_k"):
        if isinstance(kwargs.get(name), dict):  # a layer reusing another's keys: its layer type's entry
            kwargs[name] = kwargs[name][module.layer_type]
    for name in _HF_ONLY:
        kwargs.pop(name, None)
    return ffpa_attention.ffpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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
    ``generate``/``forward`` calls run the same function). Sets the name on the model's (text) config."""
    register_continuous_batching()
    configs = {id(model.config): model.config}
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text is not None:
        configs[id(text)] = text
    for config in configs.values():
        config._attn_implementation = NAME
