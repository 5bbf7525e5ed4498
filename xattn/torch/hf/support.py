"""Whether one Hugging Face ``"ffpa"`` call can run on the kernels: the one support check of its routing.

:func:`fallback_reason` answers for a call (its dtype, options and planned window) and drives the
exact fallback and its warning (:mod:`xattn.torch.hf.routing`), the refusal under context parallelism
(:mod:`xattn.torch.hf.context_parallel`) and, through :func:`kernels_available`, the readiness probes of
the low-level calls (:mod:`xattn.torch.hf.sdpa_layout`). Tests swap :func:`kernels_available` here to
run on the stand-in kernels.

HF hands ``query [B, Hq, N, D]`` and ``value [B, Hkv, Nk, Dv]`` (SDPA layout).
"""

from __future__ import annotations

import functools

import torch

from xattn.core.spec import family_for

__all__ = ["kernels_available", "fallback_reason", "is_windowed"]

_DTYPES = (torch.bfloat16, torch.float16)  # what the kernels take


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


def fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs) -> tuple[str, str] | None:
    """``(reason, message)`` when the kernels cannot run this call exactly (``plan``: its
    :class:`~xattn.torch.hf.kernel_mask.KernelMask`; ``kwargs``: the layer's extra arguments), else None."""
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
    windowed = is_windowed(plan.window)
    if family_for(query.shape[-1], value.shape[-1], windowed) is None:
        what = "with a sliding window " if windowed else ""
        return "ffpa_unavailable", f"no kernel {what}for head dims {query.shape[-1]}/{value.shape[-1]}"
    why = kernels_available()
    if why is not None:
        return "ffpa_unavailable", why
    return None
