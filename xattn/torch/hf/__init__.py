"""Hugging Face ``attn_implementation="ffpa"``: the attention function, its mask factory, registration.

One job per module:

* ``routing``: :func:`ffpa_attention_forward`, one HF call onto the kernels or an exact fallback;
* ``call_plan``: the launch plan of one call from what the layer hands over (mask, padding, kwargs);
* ``support``: whether a call can run on the kernels (the one check behind routing and its warnings);
* ``fallback``: the exact fallbacks (HF's SDPA, the model's eager, FlexAttention) and their warning;
* ``mask_factory``: :func:`ffpa_mask`, HF's ``sdpa_mask`` arguments in, a planned mask out;
* ``masks``: HF masks in kernel terms (``Pattern``, ``describe``, ``plan_hf_mask``: a mask's plan);
* ``kernel_mask``: the plan types (``KernelMask``, ``PlannedMask``) and the SDPA masks they stand for;
* ``context_parallel``: layers on sequence shards (ring attention) while a CP group is active;
* ``registry``: :func:`register_ffpa_attention`, :func:`setup_ffpa_backend`;
* ``sdpa_layout``: low-level fwd/bwd on SDPA-layout tensors (what NeMo's ring attention builds on).

:mod:`xattn.torch.ffpa_attention` publishes all of it under NeMo's module contract.
"""

from .mask_factory import ffpa_mask
from .registry import register_ffpa_attention, setup_ffpa_backend
from .routing import ffpa_attention_forward

__all__ = ["ffpa_attention_forward", "ffpa_mask", "register_ffpa_attention", "setup_ffpa_backend"]
