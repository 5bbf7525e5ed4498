"""Pure-jnp attention with the kernels' exact semantics (and lse): the CPU path and test oracle.

Glossary: B batch, Nq/Nk lengths, Hq/Hkv heads (Hq % Hkv == 0), D/Dv head dims.
Masks are bottom-right aligned like FlashAttention: query i sees key j iff
``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (``causal``: right = 0, left unbounded).
With ``q_segment_ids``/``kv_segment_ids`` (``[B, N]`` int, equal ids attend; 0 = padding),
positions are compared inside the packed row, so causal is per-document when q and kv are
the same packed sequence. Rows that see no key give out = 0 and lse = -inf; their
gradients are 0. Math runs in float32; out is returned in q's dtype, lse in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["attention_reference", "attention_reference_bwd", "visible", "varlen_visible", "segment_visible"]


def visible(nq: int, nk: int, causal: bool, window=(None, None)) -> jax.Array:
    """Bool ``[Nq, Nk]``: which keys each query sees (bottom-right aligned)."""
    i = jnp.arange(nq)[:, None] + (nk - nq)
    j = jnp.arange(nk)[None, :]
    left, right = window
    if causal:
        right = 0
    mask = jnp.ones((nq, nk), dtype=bool)
    if right is not None:
        mask &= j <= i + right
    if left is not None:
        mask &= j >= i - left
    return mask


def varlen_visible(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, causal: bool,
                   window=(None, None)) -> jax.Array:
    """Bool ``[Tq, Tk]`` for packed sequences: same segment, bottom-right aligned per segment.

    Tokens past ``cu[-1]`` belong to no segment and see nothing.
    """
    cu_seqlens_q, cu_seqlens_k = jnp.asarray(cu_seqlens_q), jnp.asarray(cu_seqlens_k)  # NumPy ones too, under jit
    nseg = cu_seqlens_q.shape[0] - 1

    def locate(cu, total):
        t = jnp.arange(total)
        seg = jnp.where(t < cu[-1], jnp.searchsorted(cu, t, side="right") - 1, -1)
        return seg, t - cu[jnp.clip(seg, 0, nseg - 1)]
    sq, pq = locate(cu_seqlens_q, total_q)
    sk, pk = locate(cu_seqlens_k, total_k)
    seg = jnp.clip(sq, 0, nseg - 1)
    offset = (cu_seqlens_k[seg + 1] - cu_seqlens_k[seg]) - (cu_seqlens_q[seg + 1] - cu_seqlens_q[seg])
    ii, jj = (pq + offset)[:, None], pk[None, :]
    mask = (sq[:, None] == sk[None, :]) & (sq[:, None] >= 0)
    left, right = window
    if causal:
        right = 0
    if right is not None:
        mask &= jj <= ii + right
    if left is not None:
        mask &= jj >= ii - left
    return mask


def segment_visible(q_segment_ids, kv_segment_ids, causal: bool, window=(None, None)) -> jax.Array:
    """Bool ``[B, Nq, Nk]`` for the ``segment_ids`` convention (0 = padding, positions in the row)."""
    nq, nk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
    same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] > 0)
    return same & visible(nq, nk, causal, window)[None]


def attention_reference(q, k, v, *, scale: float, causal: bool = False, window=(None, None), mask=None):
    """``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq])`` for q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]``.

    ``mask``: optional bool ``[Nq, Nk]`` or ``[B, Nq, Nk]`` replacing the causal/window mask.
    """
    b, nq, hq, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qf = q.astype(jnp.float32).reshape(b, nq, hkv, g, q.shape[-1])
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(jnp.float32)) * scale
    m = visible(nq, nk, causal, window) if mask is None else mask
    m = jnp.broadcast_to(m if m.ndim == 3 else m[None], (b, nq, nk))[:, None, None]
    m = jnp.broadcast_to(m, s.shape)
    any_key = m.any(-1)
    s = jnp.where(m, s, -1e30)
    p = jax.nn.softmax(s, axis=-1) * any_key[..., None]
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(jnp.float32)).reshape(b, nq, hq, v.shape[-1])
    lse = jnp.where(any_key, jax.nn.logsumexp(s, axis=-1), -jnp.inf).reshape(b, hq, nq)
    return out.astype(q.dtype), lse


def attention_reference_bwd(dout, q, k, v, out, lse, *, scale: float, causal: bool = False,
                            window=(None, None), mask=None):
    """``(dq, dk, dv)`` from the SUPPLIED out and lse, like the kernels (FlashAttention's formulas).

    P = exp(scale * q k^T - lse) on visible keys; dV = P^T dO; dS = P (dO V^T - rowsum(dO * O));
    dQ = scale dS K; dK = scale dS^T Q (summed over each GQA group).
    """
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    f32 = jnp.float32
    qf = q.astype(f32).reshape(b, nq, hkv, g, d)
    dof = dout.astype(f32).reshape(b, nq, hkv, g, dout.shape[-1])
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, k.astype(f32)) * scale
    m = visible(nq, nk, causal, window) if mask is None else mask
    m = jnp.broadcast_to(jnp.broadcast_to(m if m.ndim == 3 else m[None], (b, nq, nk))[:, None, None], s.shape)
    lse_g = lse.astype(f32).reshape(b, hkv, g, nq)[..., None]
    p = jnp.where(m & jnp.isfinite(lse_g), jnp.exp(jnp.where(m, s, 0.0) - jnp.where(jnp.isfinite(lse_g), lse_g, 0.0)),
                  0.0)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dof)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dof, v.astype(f32))
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", dof, out.astype(f32).reshape(dof.shape))[..., None]
    ds = p * (dp - delta)
    dq = (jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(f32)) * scale).reshape(q.shape)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, qf) * scale
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
