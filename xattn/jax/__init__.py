"""xattn.jax: the xattn kernels for JAX, as ``custom_vjp`` functions over XLA FFI targets.

Layouts follow ``jax.nn.dot_product_attention`` (``[B, N, H, D]``). ``dot_product_attention``
is jax.nn's drop-in: its causal masks and local windows are top-left aligned as in jax.nn; the
other functions are FlashAttention's: bottom-right aligned when Nq != Nk. ``backend="reference"`` runs the same
math in pure jnp on any device (``"auto"`` picks it off-GPU).
"""

from ._ffi import check_pairing

check_pairing()  # an actionable ImportError now beats an opaque XLA FFI failure later

from .attention import fa4_bwd, fa4_fwd, ffpa_attention, ffpa_bwd, ffpa_fwd, flash_attention  # noqa: E402
from .fa4 import causal_fa4_attention, document_causal_fa4_attention  # noqa: E402
from .kvcache import attention_with_kvcache  # noqa: E402
from .nn import dot_product_attention  # noqa: E402
from .paged import paged_attention  # noqa: E402
from .reference import attention_reference  # noqa: E402
from .ring import ring_attention, sequence_positions, shard_sequence, unshard_sequence  # noqa: E402
from .varlen import (  # noqa: E402
    packed_attention,
    segment_ids_to_cu_seqlens,
    varlen_attention,
    varlen_bwd,
    varlen_fwd,
)

__all__ = ["ffpa_attention", "flash_attention", "dot_product_attention", "attention_with_kvcache", "paged_attention",
           "varlen_attention",
           "packed_attention", "segment_ids_to_cu_seqlens", "ffpa_fwd", "ffpa_bwd", "fa4_fwd", "fa4_bwd",
           "varlen_fwd", "varlen_bwd", "attention_reference", "causal_fa4_attention",
           "document_causal_fa4_attention", "ring_attention", "shard_sequence",
           "unshard_sequence", "sequence_positions"]
