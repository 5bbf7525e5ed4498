"""``xattn.jax.dot_product_attention``: the ``jax.nn`` / Flax ``attention_fn`` calling convention.

Use as ``flax.nnx.MultiHeadAttention(..., attention_fn=xattn.jax.dot_product_attention)`` (or
linen's). Routes head_dim 320-512 to FFPA and head dims FA4 supports to FA4; everything the
kernels cannot run raises a clear error, or runs the explicit pure-jnp reference when
``backend="reference"`` is asked for: never a silent change of result.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from xattn.core.spec import FA4_HEAD_DIMS, family_for

from .attention import flash_attention, ffpa_attention, resolve_backend
from .reference import attention_reference

__all__ = ["dot_product_attention"]


def _family(d: int, dv: int) -> str:
    family = family_for(d, dv)
    if family is not None:
        return family
    raise NotImplementedError(f"head dims {d}/{dv}: no xattn kernel (FFPA: 320-512 step 16; FA4: "
                              f"{', '.join(f'{a}/{b}' for a, b in FA4_HEAD_DIMS)}); pass backend='reference'")


def dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                          dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = True,
                          dtype=None, precision=None, module=None, *, scale: float | None = None,
                          is_causal: bool = False, backend: str = "auto", **unused):
    """Attention over ``[..., N, H, D]`` inputs (any leading batch dims), Flax-compatible.

    query ``[..., Nq, Hq, D]``, key/value ``[..., Nk, Hkv, D/Dv]`` (GQA when Hq > Hkv). ``scale``
    defaults to 1/sqrt(D); ``is_causal`` is bottom-right aligned (== jax.nn's when Nq == Nk).
    ``mask`` (bool, broadcastable to ``[B, 1, Nq, Nk]``) and ``bias`` only run on
    ``backend="reference"``; with the kernels they raise ``ValueError`` naming the fix.
    Dropout (``dropout_rate > 0`` and not ``deterministic``) raises ``NotImplementedError``.
    """
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError("dropout: the xattn kernels have no attention dropout; use dropout_rate=0")
    backend = resolve_backend(backend)
    lead = query.shape[:-3]
    q, k, v = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if backend == "reference":
        m = None
        if mask is not None:
            mm = jnp.asarray(mask)
            if mm.ndim != 4 or mm.shape[1] != 1:
                raise ValueError(f"mask: expected [B, 1, Nq, Nk] (head-independent), got {mm.shape}")
            m = jnp.broadcast_to(mm[:, 0], (q.shape[0], q.shape[1], k.shape[1]))
            if is_causal:
                from .reference import visible

                m = m & visible(q.shape[1], k.shape[1], True)[None]
        if bias is not None:
            raise ValueError("bias: not supported by xattn (kernels or reference)")
        out, _ = attention_reference(q, k, v, scale=scale, causal=is_causal and m is None, mask=m)
    else:
        if mask is not None or bias is not None:
            raise ValueError("mask/bias: the xattn kernels take no mask array; use is_causal=True for causal "
                             "attention, xattn.jax.packed_attention for packed documents, or backend='reference'")
        fn = ffpa_attention if _family(q.shape[-1], v.shape[-1]) == "ffpa" else flash_attention
        out = fn(q, k, v, scale=scale, causal=is_causal, backend=backend)
    out = out.reshape(*lead, *out.shape[1:])
    return out.astype(dtype) if dtype is not None else out
