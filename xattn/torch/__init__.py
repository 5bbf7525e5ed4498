"""xattn.torch: the xattn kernels for PyTorch.

* ``attention`` / ``attention_with_lse``: differentiable, over the ``torch.ops.xattn.fwd/bwd`` custom ops;
* ``attention_with_kvcache``: FlashAttention's ``flash_attn_with_kvcache`` (decoding on a KV cache with
  per-sequence lengths, appending in place; the split-KV route of :mod:`xattn.core.split_kv`), also on a paged
  cache (``page_table=``); ``paged_attention``: dense or packed queries on a paged cache (decode and prefill);
* ``xattn.torch.ffpa_attention``: Hugging Face ``attn_implementation="ffpa"`` (``register_ffpa_attention``),
  NeMo's module contract over ``xattn.torch.hf`` (the attention function, mask factory, fallbacks, CP routing);
* ``xattn.torch.fa4``: ``causal_fa4_attention``, ``document_causal_fa4_attention`` (NeMo's module contract over
  ``xattn.torch.fa4_helpers`` and ``xattn.torch.fa4_interface``);
* ``xattn.torch.ring``: context parallelism (``ring_attention``, ``shard_sequence``, ``unshard_sequence``,
  ``sequence_positions``); ``context_parallel`` / ``set_context_parallel_group`` hand a group to "ffpa".
"""

from .attention import attention, attention_with_lse
from .kvcache import attention_with_kvcache, paged_attention
from .fa4 import causal_fa4_attention, document_causal_fa4_attention
from .cp_group import context_parallel, set_context_parallel_group
from .ffpa_attention import register_ffpa_attention, setup_ffpa_backend
from .ring import ring_attention, sequence_positions, shard_sequence, unshard_sequence

__all__ = ["attention", "attention_with_lse", "attention_with_kvcache", "paged_attention", "causal_fa4_attention",
           "document_causal_fa4_attention", "register_ffpa_attention", "setup_ffpa_backend", "ring_attention",
           "shard_sequence", "unshard_sequence", "sequence_positions", "context_parallel", "set_context_parallel_group"]
