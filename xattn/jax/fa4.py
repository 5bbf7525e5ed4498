"""FA4 helpers for JAX with the torch semantics (``xattn.torch.fa4``): causal attention and
document-causal attention for a query shard of packed rows. Layout ``[B, N, H, D]``; document ids
``[B, N]`` int with 0 = padding. The segment layout is computed on device (jit-friendly) with a
static bound ``max_segments`` on key runs (default ``B * Nk``: always enough; a tighter bound
launches fewer empty segments). Overflowing the bound turns the output into NaN, never a silent
wrong result.
"""

from __future__ import annotations

import jax.numpy as jnp

from .attention import flash_attention
from .varlen import varlen_attention

__all__ = ["causal_fa4_attention", "document_causal_fa4_attention", "varlen_segments"]


def causal_fa4_attention(query, key, value, scale: float, *, backend: str = "auto"):
    """Causal FA4 attention: query ``[B, Nq, Hq, D]``, key/value ``[B, Nk, Hkv, D]`` -> ``[B, Nq, Hq, Dv]``."""
    return flash_attention(query, key, value, scale=scale, causal=True, backend=backend)


def varlen_segments(kv_doc_ids, q_length: int, q_global_start: int, max_segments: int | None = None):
    """``(cu_q, cu_k, overflow)``: per-document key runs of each row split at the end of the query
    shard (as ``xattn.torch.fa4._varlen_segments``), padded with empty segments to ``max_segments``."""
    b, nk = kv_doc_ids.shape
    end = q_global_start + q_length
    if q_global_start < 0 or end > nk:
        raise ValueError(f"query shard [{q_global_start}, {end}) is outside the {nk} keys")
    max_segments = b * nk if max_segments is None else max_segments
    ids = kv_doc_ids.reshape(-1)
    t = jnp.arange(b * nk)
    local = t % nk
    new_run = (local == 0) | (ids != jnp.roll(ids, 1)) | (local == end)
    run = jnp.cumsum(new_run) - 1
    index = jnp.where(new_run, run, max_segments + 1)
    cu_k = jnp.full((max_segments + 1,), b * nk, jnp.int32).at[index].set(t.astype(jnp.int32), mode="drop")
    start, stop = cu_k[:-1], cu_k[1:]
    row = start // nk
    lstart, lstop = start - row * nk, stop - row * nk
    q_count = jnp.clip(jnp.minimum(lstop, end) - jnp.maximum(lstart, q_global_start), 0)
    q_count = jnp.where(stop > start, q_count, 0)
    cu_q = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(q_count).astype(jnp.int32)])
    return cu_q, cu_k, run[-1] + 1 > max_segments


def document_causal_fa4_attention(query, key, value, q_doc_ids, kv_doc_ids, q_global_start: int, scale: float,
                                  *, max_segments: int | None = None, backend: str = "auto"):
    """Document-causal FA4 attention for a query shard (see :mod:`xattn.torch.fa4`); padding queries -> 0."""
    b, nq = query.shape[:2]
    nk = key.shape[1]
    cu_q, cu_k, overflow = varlen_segments(kv_doc_ids, nq, q_global_start, max_segments)
    out = varlen_attention(query.reshape(b * nq, *query.shape[2:]), key.reshape(b * nk, *key.shape[2:]),
                           value.reshape(b * nk, *value.shape[2:]), cu_q, cu_k, max_seqlen_q=nq, max_seqlen_k=nk,
                           family="fa4", scale=scale, causal=True, backend=backend,
                           check_inputs=False)  # built here from the ids; an overflow turns into NaN below
    out = out.reshape(b, nq, *out.shape[1:]) * (q_doc_ids != 0)[:, :, None, None].astype(out.dtype)
    return jnp.where(overflow, jnp.full_like(out, jnp.nan), out)
