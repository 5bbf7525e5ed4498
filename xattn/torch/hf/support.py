"""Whether one Hugging Face ``"ffpa"`` call can run on the kernels: the one support check of its routing.

:func:`fallback_reason` answers for a call (its dtype, options and planned window) and drives the
exact fallback and its warning (:mod:`xattn.torch.hf.routing`), the refusal under context parallelism
(:mod:`xattn.torch.hf.context_parallel`) and, through :func:`kernels_available`, the readiness probes of
the low-level calls (:mod:`xattn.torch.hf.sdpa_layout`). Tests swap :func:`kernels_available` here to
run on the stand-in kernels. It asks, in NeMo's order, about the call's dtype and options
(:func:`option_reason`), then about the kernels (:func:`kernel_reason`: head dims, and the facade's
``_ffpa_low_level_ready()`` hook, :func:`low_level_ready` unless a caller replaced it).

HF hands ``query [B, Hq, N, D]`` and ``value [B, Hkv, Nk, Dv]`` (SDPA layout).
"""

from __future__ import annotations

import functools

import torch

from xattn.core.api import launch_fwd
from xattn.core.spec import family_for

from .. import ops
from . import hooks

__all__ = ["kernels_available", "low_level_ready", "option_reason", "kernel_reason", "fallback_reason",
           "is_windowed", "nemo_state"]

_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels take
_FFPA_LOW_LEVEL_READY: bool | None = None  # what low_level_ready() last found (NeMo's state)


@torch.compiler.assume_constant_result  # torch.compile reads the answer at trace time (the probe is not traceable)
def kernels_available() -> str | None:
    """``None`` when the sm90 kernels can run here, else why not (probed once per process)."""
    return _probe_kernels()


@functools.cache
def _probe_kernels() -> str | None:
    from xattn.core.info import collect

    fams = collect()["families"]
    return None if fams["ffpa"]["can_run"] else fams["ffpa"]["why_not_run"]


def is_windowed(window) -> bool:
    """Whether a bottom-right aligned ``(left, right)`` window bounds more than causality (needs FA4)."""
    return window not in ((None, None), (None, 0))


@hooks.default("_ffpa_low_level_ready")
def low_level_ready() -> bool:
    """Whether the FFPA kernels can run in this process (NeMo's ``_ffpa_low_level_ready``)."""
    global _FFPA_LOW_LEVEL_READY
    _FFPA_LOW_LEVEL_READY = kernels_available() is None
    return _FFPA_LOW_LEVEL_READY


def nemo_state() -> dict:
    """This module's state under NeMo's names (``_FFPA_LOW_LEVEL_READY``), read now."""
    return {"_FFPA_LOW_LEVEL_READY": _FFPA_LOW_LEVEL_READY}


def option_reason(module, query, dropout, scaling, softcap, kwargs) -> tuple[str, str] | None:
    """``(reason, message)`` when the call's dtype or options keep it off the kernels, else None; in NeMo's
    order (dtype, softcap, dropout, scaling), before anything about its mask."""
    if query.dtype not in _DTYPES:
        return "dtype", f"{query.dtype} is not float16/bfloat16"
    if softcap is not None:
        return "softcap", f"softcap={softcap} has no kernel here"
    if kwargs.get("s_aux") is not None:
        return "s_aux", "attention sinks (s_aux) have no kernel"
    if dropout and getattr(module, "training", False):
        return "dropout", f"attention dropout {dropout} while training"
    if scaling is None:
        return "scaling", "no explicit scaling given (never assumed 1/sqrt(d))"
    if scaling <= 0:
        return "scaling", f"scaling={scaling}: the kernels take a positive scale only"
    if kwargs.get("position_bias") is not None:
        return "position_bias", "an additive position bias has no kernel"
    return None


def kernel_reason(query, value, window) -> tuple[str, str] | None:
    """``("ffpa_unavailable", why)`` when no kernel runs these head dims with ``window`` (bottom-right
    ``(left, right)``) on these tensors here, else None.

    A caller's ``_ffpa_low_level_ready`` (the facade's hook, replaced) decides alone, as in NeMo. Otherwise the
    kernels must run in this process (:func:`low_level_ready`) and take the tensors: on a machine with a GPU
    the core's launchers take CUDA tensors only, so a CPU model there runs on the fallback. Where the probe
    says yes without a GPU, or launchers were put in place of the core's (``xattn.torch.ops.LAUNCH``), the
    kernels are stand-ins (tests, host-cost tools), which take the CPU's tensors."""
    windowed = is_windowed(window)
    if family_for(query.shape[-1], value.shape[-1], windowed) is None:
        what = "with a sliding window " if windowed else ""
        return "ffpa_unavailable", f"no kernel {what}for head dims {query.shape[-1]}/{value.shape[-1]}"
    ready = hooks.replaced("_ffpa_low_level_ready")
    if ready is not None:
        return None if ready() else ("ffpa_unavailable", "_ffpa_low_level_ready() is False")
    if not low_level_ready():
        return "ffpa_unavailable", kernels_available()
    if query.device.type != "cuda" and torch.cuda.is_available() and ops.LAUNCH["fwd"] is launch_fwd:
        return "ffpa_unavailable", f"tensors on {query.device}: the kernels take CUDA tensors"
    return None


def fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs) -> tuple[str, str] | None:
    """``(reason, message)`` when the kernels cannot run this call exactly (``plan``: its
    :class:`~xattn.torch.hf.kernel_mask.KernelMask`; ``kwargs``: the layer's extra arguments), else None."""
    return option_reason(module, query, dropout, scaling, softcap, kwargs) or kernel_reason(query, value,
                                                                                             plan.window)
