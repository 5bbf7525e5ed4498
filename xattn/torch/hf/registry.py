"""Registration of ``"ffpa"`` in Hugging Face's attention and mask registries, and NeMo's setup call.

``"ffpa"`` is registered globally, so any HF model may select it with ``attn_implementation="ffpa"``; it
must give what ``"sdpa"`` gives (:mod:`xattn.torch.hf.routing`, :mod:`xattn.torch.hf.mask_factory`).
"""

from __future__ import annotations

import numbers

from .. import cp_group
from . import hooks
from .fallback import logger
from .mask_factory import ffpa_mask
from .routing import ffpa_attention_forward

__all__ = ["register_ffpa_attention", "setup_ffpa_backend", "nemo_state"]

_REGISTERED = False


def nemo_state() -> dict:
    """This module's state under NeMo's names (``_REGISTERED``), read now."""
    return {"_REGISTERED": _REGISTERED}


@hooks.default("register_ffpa_attention")
def register_ffpa_attention() -> bool:
    """Register ``"ffpa"`` in HF's ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent).

    Returns True when this call registered it, False when it was registered already (as NeMo's) or
    transformers is not installed. "Registered" is the flag (NeMo's ``_REGISTERED``) AND both registries
    still holding xattn's functions: a registry that lost (or had replaced) ``"ffpa"`` since gets it again."""
    global _REGISTERED
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    if _REGISTERED and AttentionInterface().get("ffpa") is ffpa_attention_forward \
            and AttentionMaskInterface().get("ffpa") is ffpa_mask:
        return False
    AttentionInterface.register("ffpa", ffpa_attention_forward)
    AttentionMaskInterface.register("ffpa", ffpa_mask)
    _REGISTERED = True
    logger.info("registered ALL_ATTENTION_FUNCTIONS['ffpa'] + ALL_MASK_ATTENTION_FUNCTIONS['ffpa'] (xattn)")
    return True


def setup_ffpa_backend(cp_size: int, has_packed_sequence: bool) -> None:
    """Check the parallel setup, register ``"ffpa"``, and turn context parallelism on (``cp_size > 1``) or off.

    A superset of NeMo's function, which raises for ``cp_size > 1`` and for packed sequences because its
    ``"ffpa"`` can do neither; xattn runs both:

    * ``has_packed_sequence`` true (``cp_size`` 1): accepted; packed documents run on the kernels
      (varlen segments from HF's packed mask, ``cu_seq_lens_q/k`` or restarting ``position_ids``).
    * ``cp_size > 1``: every ``"ffpa"`` layer runs on sequence shards (ring attention) over the group handed
      over with :func:`xattn.torch.set_context_parallel_group` (else the world group, when its size is
      ``cp_size``); see :mod:`xattn.torch.cp_group`.

    Arguments as NeMo takes them: ``cp_size`` an int (None means 1), ``has_packed_sequence`` a bool, an int
    or None (read by truth value). Raises TypeError/ValueError for other types, ``cp_size < 1`` or a missing
    group, NotImplementedError for packed documents under CP, ImportError without transformers."""
    if cp_size is None:
        cp_size = 1
    if isinstance(cp_size, bool) or not isinstance(cp_size, numbers.Integral):
        raise TypeError(f"cp_size: expected an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected a positive int, got {cp_size!r}")
    if has_packed_sequence is not None and not isinstance(has_packed_sequence, (bool, numbers.Integral)):
        raise TypeError(f"has_packed_sequence: expected a bool (or an int, None), got "
                        f"{type(has_packed_sequence).__name__}")
    if cp_size > 1 and has_packed_sequence:
        raise NotImplementedError("cp_size > 1 with packed sequences: context parallelism runs one sequence per "
                                  "row (documents across shards are not supported)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError("attn_implementation='ffpa' needs transformers: pip install 'transformers>=5'") from None
    cp_group.activate(int(cp_size))
    (hooks.replaced("register_ffpa_attention") or register_ffpa_attention)()
