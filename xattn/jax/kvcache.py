"""FlashAttention's ``flash_attn_with_kvcache`` for JAX: decoding against a KV cache with per-sequence valid
lengths (traced under ``jit``), the new keys and values appended functionally.

Glossary as :mod:`xattn.torch.kvcache`: B batch, Nq new queries per sequence, Nc cache capacity, Nn new keys per
sequence, Hq/Hkv heads, D/Dv head dims. Sequence b attends to its first ``L_b = cache_seqlens[b] + Nn`` cache rows
(after the append), causal and windows bottom-right aligned on them. Served by the route
:func:`xattn.core.routes.forward_route` picks: ``split-kv`` (:mod:`xattn.jax.split_kv`) or the family's fused varlen
forward over per-sequence documents; ``backend="reference"`` (or ``"auto"`` off-GPU) computes the same in jnp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from xattn.core import routes
from xattn.core.checks import check_window
from xattn.core.spec import canonical_mask, family_for

from . import _ffi, split_kv
from .attention import Config, resolve_backend, static_scale

__all__ = ["attention_with_kvcache"]


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, scale: float | None = None,
                           causal: bool = False, window_size=(None, None), return_softmax_lse: bool = False,
                           family: str | None = None, backend: str = "auto"):
    """FlashAttention's ``flash_attn_with_kvcache`` in JAX (no gradient). Returns ``(out, k_cache, v_cache)``, or
    ``(out, lse, k_cache, v_cache)`` with ``return_softmax_lse``: out ``[B, Nq, Hq, Dv]``, lse fp32 ``[B, Hq, Nq]``
    (-inf for a row that sees no key), and the caches with k/v ``[B, Nn, Hkv, D/Dv]`` written at rows
    ``cache_seqlens[b] + j`` (functional: donate the caches to ``jax.jit``, ``donate_argnames=("k_cache",
    "v_cache")``, and XLA updates them in place).

    q ``[B, Nq, Hq, D]``; k_cache/v_cache ``[B, Nc, Hkv, D/Dv]``; ``cache_seqlens``: an int or an int array ``[B]``
    (traced values are fine), trusted: rows past the cache are not written (``mode="drop"``) and lengths are
    clipped to ``[0, Nc]``. Rows past a sequence's length may hold any finite values, not NaN or Inf (a masked
    key's value still enters P V as 0 x value; ``jnp.zeros`` caches are safe). ``causal``/``window_size`` as
    :func:`xattn.jax.flash_attention`; the route reads ``XATTN_FWD_ROUTE`` (``routes.forced_forward`` in tests).
    """
    b, nq, hq, d = q.shape
    nc, hkv = k_cache.shape[1], k_cache.shape[2]
    family = family or family_for(d, v_cache.shape[-1]) or ("ffpa" if d > 256 else "fa4")
    scale = static_scale(scale, d)
    causal, left, right = canonical_mask(bool(causal), *check_window(window_size))
    lengths = jnp.broadcast_to(jnp.asarray(cache_seqlens, jnp.int32), (b,))
    if (k is None) != (v is None):
        raise ValueError("k/v: give both or neither")
    if k is not None:
        if k.shape[0] != b or k.shape[2:] != k_cache.shape[2:] or v.shape[:2] != k.shape[:2]:
            raise ValueError(f"k/v: expected [B, Nn, Hkv, D] matching the caches {k_cache.shape}, got {k.shape}")
        rows = lengths[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)
        batch = jnp.arange(b)[:, None]
        k_cache = k_cache.at[batch, rows].set(k.astype(k_cache.dtype), mode="drop")
        v_cache = v_cache.at[batch, rows].set(v.astype(v_cache.dtype), mode="drop")
        lengths = lengths + k.shape[1]
    lengths = jnp.clip(lengths, 0, nc)
    cfg = Config(family, scale, causal, (left, right), resolve_backend(backend), kernel_rules=backend != "reference")
    cfg.checked("fwd", q, k_cache, v_cache)  # the one validator (dtypes, head dims, GQA, sizes)
    if cfg.backend == "reference":
        out, lse = _reference(q, k_cache, v_cache, lengths, cfg)
    else:
        problem = routes.FwdProblem(family, b, hkv, hq // hkv, nq, nc, causal=causal,
                                    local=left is not None or right is not None, num_sms=split_kv.num_sms(),
                                    traced=True)
        route = routes.forward_route(problem, cfg.fwd_route)
        if route.name == "split-kv":
            out, lse = split_kv.split_forward(cfg, route.plan, q, k_cache, v_cache, lengths=lengths)
        else:
            out, lse = _fused(cfg, q, k_cache, v_cache, lengths)
    out, lse = jax.lax.stop_gradient(out), jax.lax.stop_gradient(lse)
    return (out, lse, k_cache, v_cache) if return_softmax_lse else (out, k_cache, v_cache)


def _fused(cfg: Config, q, k_cache, v_cache, lengths):
    """The family's varlen forward over per-sequence documents: sequence b (Nq queries, its first ``L_b`` keys),
    then the rest of its cache rows without a query."""
    b, nq, hq, d = q.shape
    nc, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    base = jnp.arange(b, dtype=jnp.int32) * nc
    zero = jnp.zeros((1,), jnp.int32)
    cu_k = jnp.concatenate([zero, jnp.stack([base + lengths, base + nc], 1).reshape(-1)])
    cu_q = (jnp.arange(1, 2 * b + 2, dtype=jnp.int32) // 2) * nq
    qf, kf, vf = q.reshape(b * nq, hq, d), k_cache.reshape(b * nc, hkv, d), v_cache.reshape(b * nc, hkv, dv)
    spec = cfg.spec("fwd", qf, kf, vf, cu_q, cu_k, nq, nc)
    outs = [("out", (b * nq, hq, dv), q.dtype), ("lse", (hq, b * nq), "float32")]
    out, lse = _ffi.call(spec, [qf, kf, vf, cu_q, cu_k], outs, [], cfg.scale, vmap_method="sequential")
    return out.reshape(b, nq, hq, dv), lse.reshape(hq, b, nq).transpose(1, 0, 2)


def _reference(q, k_cache, v_cache, lengths, cfg: Config):
    """The same attention in jnp: query i of sequence b sits at ``L_b - Nq + i``."""
    from .reference import attention_reference

    b, nq = q.shape[0], q.shape[1]
    nc = k_cache.shape[1]
    at = lengths[:, None, None] - nq + jnp.arange(nq)[None, :, None]  # [B, Nq, 1] each query's position
    j = jnp.arange(nc)[None, None, :]
    mask = j < lengths[:, None, None]
    left, right = cfg.window
    if cfg.causal:
        right = 0
    if right is not None:
        mask &= j <= at + right
    if left is not None:
        mask &= j >= at - left
    return attention_reference(q, k_cache, v_cache, scale=cfg.scale, mask=jnp.broadcast_to(mask, (b, nq, nc)))
