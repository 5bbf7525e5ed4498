"""Hugging Face ``attn_implementation="ffpa"``: a drop-in for NeMo AutoModel's
``nemo_automodel.components.attention.ffpa_attention``.

This module holds NeMo's contract and nothing else: every name of that module's API listing, with its
parameter names, order, defaults, layouts and returns. The code lives in :mod:`xattn.torch.hf`:

* :func:`ffpa_attention_forward` (``ALL_ATTENTION_FUNCTIONS["ffpa"]``, :mod:`~xattn.torch.hf.routing`): HF's
  ``query [B, Hq, N, D]`` and ``key/value [B, Hkv, Nk, D]`` (SDPA layout) in, ``(out [B, N, Hq, Dv]
  contiguous, weights)`` out; on the kernels (FFPA for head_dim 320-512, FA4 for <= 256 and windows) where
  exact, else an exact fallback (SDPA with the layer's exact mask, the model's eager function for
  ``softcap`` / ``s_aux``, FlexAttention for a ``BlockMask``), each reason logged once as NeMo logs it
  (``_warn_once``, ``_FALLBACK_WARNED``, ``logger``). ``_is_block_mask`` marks the FlexAttention layers.
* :func:`ffpa_mask` (``ALL_MASK_ATTENTION_FUNCTIONS["ffpa"]``, :mod:`~xattn.torch.hf.mask_factory`): HF's
  ``sdpa_mask`` arguments; returns ``torch.Tensor | BlockMask | None`` (never None: a
  :class:`~xattn.torch.hf.kernel_mask.PlannedMask` carrying the launch plan, or HF's own mask).
  ``config.ffpa_sliding_attn_backend`` (NeMo's knob; else ``XATTN_SLIDING_BACKEND``) picks "fa4"
  (default), "flex" or "sdpa" for the text model's non-causal layers.
* :func:`register_ffpa_attention` / :func:`setup_ffpa_backend` (:mod:`~xattn.torch.hf.registry`): a
  superset of NeMo's, running packed sequences and context parallelism (``cp_size > 1`` or
  ``xattn.torch.context_parallel(group)``: :mod:`~xattn.torch.hf.context_parallel`).
* ``_ffpa_dense_fwd/_bwd``, ``_ffpa_varlen_fwd/_bwd``, ``_ffpa_low_level_ready``, ``_ffpa_varlen_ready``,
  ``_get_ffpa_high_level`` (:mod:`~xattn.torch.hf.sdpa_layout`): low-level calls on SDPA-layout
  ``[B, H, N, D]`` / packed ``[T, H, D]`` tensors with the caller's out/lse, what ring attention builds on.
* ``_get_sdpa`` / ``_get_flex`` / ``_get_eager`` (:mod:`~xattn.torch.hf.fallback`): the fallback
  functions (HF's SDPA and FlexAttention functions, HF Gemma 4's eager), looked up when called.

NeMo's hooks are live, as in NeMo's module: ``_get_sdpa``, ``_get_eager``, ``_get_flex``, ``_is_block_mask``,
``_ffpa_low_level_ready``, ``_get_ffpa_high_level`` and ``register_ffpa_attention`` (as
``setup_ffpa_backend`` calls it) are looked up here when a call runs, so replacing one on this module
(``monkeypatch.setattr``, ``mock.patch.object``) changes what the next call does (:mod:`xattn.torch.hf.hooks`).

Data: ``_FFPA_HEAD_DIM``, ``_VARLEN_WIN_NONE`` and ``_FALLBACK_WARNED`` are the objects the code uses;
``_REGISTERED``, ``_SDPA_FN``, ``_FLEX_FN``, ``_EAGER_FN``, ``_FFPA_FN``, ``_CUTEDSL_BACKEND`` and
``_FFPA_LOW_LEVEL_READY`` are read live from the module that keeps them (writing them here changes
nothing there).

Determinism: with ``torch.use_deterministic_algorithms(True)`` the backward of a layer that runs on FA4
(head_dim <= 256, sliding layers) raises torch's RuntimeError naming the op (``warn_only=True``: warns
and runs); layers on FFPA (head_dim 320-512) and every forward are bitwise reproducible (see
:mod:`xattn.torch.attention`).
"""

from .hf import fallback as _fallback, registry as _registry, sdpa_layout as _sdpa_layout, support as _support
from .hf.fallback import FALLBACK_WARNED as _FALLBACK_WARNED, logger, warn_once as _warn_once
from .hf.fallback import get_eager as _get_eager, get_flex as _get_flex, get_sdpa as _get_sdpa
from .hf.mask_factory import ffpa_mask
from .hf.registry import register_ffpa_attention, setup_ffpa_backend
from .hf.routing import ffpa_attention_forward, is_block_mask as _is_block_mask
from .hf.sdpa_layout import FFPA_HEAD_DIM as _FFPA_HEAD_DIM, VARLEN_WIN_NONE as _VARLEN_WIN_NONE
from .hf.sdpa_layout import dense_bwd as _ffpa_dense_bwd, dense_fwd as _ffpa_dense_fwd
from .hf.sdpa_layout import high_level as _get_ffpa_high_level
from .hf.sdpa_layout import varlen_bwd as _ffpa_varlen_bwd, varlen_fwd as _ffpa_varlen_fwd
from .hf.sdpa_layout import varlen_ready as _ffpa_varlen_ready
from .hf.support import low_level_ready as _ffpa_low_level_ready

__all__ = ["ffpa_attention_forward", "ffpa_mask", "register_ffpa_attention", "setup_ffpa_backend", "_ffpa_dense_fwd",
           "_ffpa_dense_bwd"]


def __getattr__(name: str):
    """NeMo's module state (``_REGISTERED``, ``_SDPA_FN``, ...), read live from the module that keeps it."""
    for module in (_registry, _fallback, _sdpa_layout, _support):
        state = module.nemo_state()
        if name in state:
            return state[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
