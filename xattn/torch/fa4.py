"""FA4 helpers for torch: a drop-in for NeMo AutoModel's ``nemo_automodel.components.attention.fa4``.

This module holds NeMo's contract and nothing else: the same functions, parameter names, defaults, layouts
and results as that module, with the attention computed by xattn's FA4 launchers (head dims 64, 96, 128,
192/128, 192, 256; fp16/bf16 on sm90) instead of ``flash_attn.cute``'s own autograd functions. The code
lives in :mod:`xattn.torch.fa4_helpers` and :mod:`xattn.torch.fa4_interface`.

* :func:`causal_fa4_attention` and :func:`document_causal_fa4_attention` take and return SDPA layout
  ``[batch, heads, sequence, head_dim]`` (K/V may have fewer heads than Q: GQA); dimension 1 is ALWAYS read
  as heads, so transpose FlashAttention-layout tensors first. Document ids are integer tensors
  ``[batch, sequence]``: documents numbered from 1, ids ``<= 0`` for padding (``_PAD_DOC_ID``, 0); padding
  queries return zeros.
* ``_varlen_segments`` / ``_varlen_layout``: the FA4 varlen segments of a query shard, and their
  ``cu_seqlens`` cached for the step (``_LAYOUT_CACHE``, ``_LAYOUT_GENERATION``: the objects the helpers
  use, mutated in place).
* ``_load_fa4()``: the FA4 entry points ``(flash_attn_func, flash_attn_varlen_func)`` in FlashAttention's
  layouts (dense ``[B, N, H, D]``, varlen ``[T, H, D]``) on xattn's launchers; a call using a feature they
  lack is handed to ``flash_attn.cute``'s own function, as NeMo's ``_load_fa4`` returns those functions.
* :func:`import_fa4_modules`: the optional FA4 / CuTe DSL modules, with one ``ImportError`` naming all that
  are missing ("could not import ...") and the pip command. Each goes through ``safe_import`` (``(ok,
  module)``) as this module holds it when called: NeMo's hook, replaceable here as in NeMo.
"""

from .fa4_helpers import LAYOUT_CACHE as _LAYOUT_CACHE, LAYOUT_GENERATION as _LAYOUT_GENERATION
from .fa4_helpers import PAD_DOC_ID as _PAD_DOC_ID
from .fa4_helpers import causal_fa4_attention, document_causal_fa4_attention, import_fa4_modules, safe_import
from .fa4_helpers import varlen_layout as _varlen_layout, varlen_segments as _varlen_segments
from .fa4_interface import load_fa4 as _load_fa4

__all__ = ["import_fa4_modules", "causal_fa4_attention", "document_causal_fa4_attention"]
