"""JAX driver of the chunked-GEMM backward (see :mod:`xattn.core.gemm_bwd_plan` for the math).

The layout glue is jnp (XLA fuses it); the GEMMs are the core's fixed-signature quack launchers
(:mod:`xattn.core.gemm_sm90`) as XLA FFI custom calls, one block at a time. Every block spans
``k8`` keys (its causal limit rounded up to 8, so every row stride is 16-byte aligned); the keys
past the limit (or past Nk: K/V are zero-padded to a multiple of 8) are masked by the
epilogue's position test, so non-causal problems use it too, with every row at the last key.
The launchers read the first rows of whole K/V and of the whole fp32 dK/dV accumulators
(:mod:`xattn.core.gemm_sm90`), so no block copies a key prefix out or back: the accumulators are
threaded through the ``acc`` calls whole (input aliased to output), started by the first block's
``mm_kv`` (fp32) and never zeroed (each ``acc`` reads only the key rows earlier blocks wrote).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from xattn.core import gemm_bwd_plan as plan_mod
from xattn.core.gemm_sm90 import GemmSpec, max_active_clusters

from . import _ffi

__all__ = ["gemm_backward", "gemm_backward_padded"]

LOG2E = 1.4426950408889634
GEMM_DTYPES = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}


def num_sms() -> int:
    from xattn.core.device import cuda_gpus

    gpus = cuda_gpus()
    return gpus[0].num_sms if gpus else 132


def _rows_to_blocks(x, hkv: int, rows: int, padded: int):
    """``[B, N, Hq, D]`` -> ``[B*Hkv, C, rows*g, D]`` (GEMM row ``r*g + i``: query row r, head
    ``kv*g + i``); padded rows are zero. The same order as :mod:`xattn.torch.gemm_bwd`."""
    b, n, hq, d = x.shape
    g, c = hq // hkv, padded // rows
    x = jnp.pad(x, ((0, 0), (0, padded - n), (0, 0), (0, 0)))
    x = x.reshape(b, c, rows, hkv, g, d).transpose(0, 3, 1, 2, 4, 5)
    return x.reshape(b * hkv, c, rows * g, d)


def _blocks_to_rows(xp, b: int, n: int, hq: int, rows: int):
    batches, c, _, d = xp.shape
    hkv, g = batches // b, hq // (batches // b)
    x = xp.reshape(b, hkv, c, rows, g, d).transpose(0, 2, 3, 1, 4, 5)
    return x.reshape(b, c * rows, hq, d)[:, :n]


def _vec_to_blocks(x, hkv: int, rows: int, padded: int, fill: float):
    """``[B, Hq, N]`` fp32 -> ``[B*Hkv, C, rows*g]`` in :func:`_rows_to_blocks`' row order."""
    b, hq, n = x.shape
    g, c = hq // hkv, padded // rows
    x = jnp.pad(x, ((0, 0), (0, 0), (0, padded - n)), constant_values=fill)
    return x.reshape(b, hkv, g, c, rows).transpose(0, 1, 3, 4, 2).reshape(b * hkv, c, rows * g)


def _gemm(kind: str, dtype: str, inputs, results, scale=None, d32=False, aliases=None, c_rows=None):
    spec = GemmSpec(kind, dtype, d32)
    attrs = {"max_clusters": np.int32(max_active_clusters(num_sms()))}
    if scale is not None:
        attrs = {"scale": np.float32(scale), **attrs}
    if c_rows is not None:
        attrs = {"c_rows": np.int32(c_rows), **attrs}
    return _ffi.call_gemm(spec, inputs, results, attrs, aliases or {})


def _accumulate(dtype: str, x, y, acc, written: int, keys: int, out_dtype):
    """``xᵀ y`` (x ``(L, K, m)``) plus the first ``written`` key rows of the fp32 accumulator ``acc``
    (None before any block wrote it), as ``(L, keys, N)`` in ``out_dtype`` (fp32: ``acc`` updated in
    place, aliased); rows from ``m`` on are not written, rows of ``acc`` from ``written`` on never
    read, so the accumulator needs no zeroing."""
    shape = ((x.shape[0], keys, y.shape[2]), out_dtype)
    d32 = jnp.dtype(out_dtype) == jnp.dtype(jnp.float32)
    if written <= 0:
        return _gemm("mm_kv", dtype, [x, y], [shape], d32=d32)[0]
    aliases = {2: 0} if d32 else {}
    return _gemm("acc", dtype, [x, y, acc], [shape], d32=d32, aliases=aliases, c_rows=min(written, x.shape[2]))[0]


def check_buffers(dout, q, out, lse) -> None:
    """Named errors at trace time for the buffers q/k/v's checks do not cover (before any launch)."""
    for name, x in (("dout", dout), ("out", out)):
        if tuple(x.shape) != tuple(q.shape) or jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
            raise ValueError(f"{name}: expected shape {tuple(q.shape)} and dtype {q.dtype} (as q), "
                             f"got {tuple(x.shape)} {x.dtype}")
    b, n, h, _ = q.shape
    if tuple(lse.shape) != (b, h, n) or jnp.dtype(lse.dtype) != jnp.dtype(jnp.float32):
        raise ValueError(f"lse: expected shape {(b, h, n)} float32 ([B, Hq, Nq]), got {tuple(lse.shape)} {lse.dtype}")


def gemm_backward(dout, q, k, v, out, lse, *, softmax_scale: float, causal: bool, rows: int | None = None,
                  budget: int | None = None, positions=None, shift: int | None = None):
    """dq ``[B, Nq, Hq, D]``, dk/dv ``[B, Nk, Hkv, D]`` from the given out/lse (lse fp32
    ``[B, Hq, Nq]``); causal is bottom-right aligned. ``rows`` overrides the block rows that
    ``budget`` (bytes; default ``XATTN_GEMM_BWD_BUDGET_MIB``) gives. ``positions`` (fp32 ``[B, Nq]``)
    replaces the mask: row i of batch b sees keys ``j <= positions[b, i]`` (padded documents,
    :func:`gemm_backward_padded`); ``causal`` then only lets blocks skip the keys past the causal
    limit, so positions must stay within it (``positions[b, i] <= i + shift``; ``shift`` defaults to
    ``Nk - Nq`` and may only be larger)."""
    check_buffers(dout, q, out, lse)
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    g, L = Hq // Hkv, B * Hkv
    dt = GEMM_DTYPES[jnp.dtype(q.dtype)]
    shift = Nk - Nq if shift is None else max(shift, Nk - Nq)
    p = plan_mod.plan(B, Nq, Nk, Hq, causal, budget=budget, rows=rows, shift=shift)
    R, C, Np, nk8 = p.rows, p.num_blocks, p.padded_q, p.keys_stride

    qp = _rows_to_blocks(q, Hkv, R, Np)
    dop = _rows_to_blocks(dout, Hkv, R, Np)
    pad_keys = lambda x: jnp.pad(x.transpose(0, 2, 1, 3).reshape(L, Nk, D), ((0, 0), (0, nk8 - Nk), (0, 0)))  # noqa: E731
    kp, vp = pad_keys(k), pad_keys(v)
    lse32 = lse.astype(jnp.float32)
    rowbias = _vec_to_blocks(jnp.where(jnp.isfinite(lse32), lse32 * -LOG2E, -jnp.inf), Hkv, R, Np, -math.inf)
    delta = jnp.einsum("bnhd,bnhd->bhn", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = _vec_to_blocks(delta, Hkv, R, Np, 0.0)
    if positions is not None:
        pos = jnp.pad(positions.astype(jnp.float32), ((0, 0), (0, Np - Nq)))  # padded rows: bias -inf
        rowpos = jnp.broadcast_to(pos.reshape(B, 1, C, R, 1), (B, Hkv, C, R, g)).reshape(L, C, R * g)
    else:
        if causal:
            pos = jnp.arange(Np, dtype=jnp.float32) + (Nk - Nq)
        else:  # every row sees every real key; only the padded keys (>= Nk) are masked
            pos = jnp.full((Np,), Nk - 1, jnp.float32)
        rowpos = jnp.broadcast_to(jnp.repeat(pos.reshape(C, R), g, axis=1)[None], (L, C, R * g))
    colpos = jnp.broadcast_to(jnp.arange(nk8, dtype=jnp.float32)[None], (L, nk8))
    assert p.blocks[-1][1] == Nk  # the last block's rows reach the last key (causal bottom-right too)
    dk_acc = dv_acc = None  # fp32 (L, nk8, D) over the blocks; their first `written` key rows hold sums
    written = 0
    dq_blocks = []
    scale_log2 = softmax_scale * LOG2E
    dk = dv = None
    for c, (_, kend) in enumerate(p.blocks):
        if kend <= 0:  # every row of the block is before the first key
            dq_blocks.append(jnp.zeros((L, R * g, D), q.dtype))
            continue
        k8 = -(-kend // plan_mod.ROW_ALIGN) * plan_mod.ROW_ALIGN
        # whole kp / vp / colpos / accumulators: the launchers use their first k8 rows in place
        # P twice: in q's dtype for dV, in fp16 (GemmSpec.p_dtype) for dS
        pb, pf = _gemm("probs_causal", dt, [qp[:, c], kp, rowbias[:, c], rowpos[:, c], colpos],
                       [((L, R * g, k8), q.dtype), ((L, R * g, k8), jnp.float16)], scale=scale_log2)
        (dsb,) = _gemm("grad_scores", dt, [dop[:, c], vp, pf, delta[:, c]], [((L, R * g, k8), q.dtype)],
                       scale=softmax_scale)
        if c < C - 1:
            dv_acc = _accumulate(dt, pb, dop[:, c], dv_acc, written, nk8, jnp.float32)
            dk_acc = _accumulate(dt, dsb, qp[:, c], dk_acc, written, nk8, jnp.float32)
        else:  # the last block reaches the last key (k8 == nk8): it writes the 16-bit results
            dv = _accumulate(dt, pb, dop[:, c], dv_acc, written, nk8, q.dtype)
            dk = _accumulate(dt, dsb, qp[:, c], dk_acc, written, nk8, q.dtype)
        written = max(written, kend)
        (dqc,) = _gemm("mm_dq", dt, [dsb, kp], [((L, R * g, D), q.dtype)])
        dq_blocks.append(dqc)
    dq = _blocks_to_rows(jnp.stack(dq_blocks, axis=1), B, Nq, Hq, R)
    unblock = lambda x: x[:, :Nk].reshape(B, Hkv, Nk, D).transpose(0, 2, 1, 3)  # noqa: E731
    return dq, unblock(dk), unblock(dv)



def gemm_backward_padded(dout, q, k, v, out, lse, cu_q, cu_k, *, max_seqlen_q: int, max_seqlen_k: int,
                         softmax_scale: float, causal: bool, same_segments: bool = False, budget: int | None = None):
    """The packed backward on the GEMM route with static shapes (route ``gemm-padded``): q/dout/out
    ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, lse fp32 ``[Hq, Tq]``, cu_seqlens int32 ``[B + 1]`` (traced values,
    anything the varlen contract allows: empty documents, rows after ``cu[-1]``). Every document is padded to
    ``max_seqlen_q`` / ``max_seqlen_k`` and the B documents run as one dense batch (per-row positions mask the
    padding and each document's bottom-right causal limit), so it is efficient when the documents are about
    that long. Where ``B · max_seqlen`` is the token count on both sides, a batch whose documents all have
    exactly those lengths (checked on the device: ``lax.cond``) uses the packed tensors in place.

    Causal blocks skip the keys past ``(c+1)·rows + shift``, a static bound on every document's ``nk − nq``:
    ``max(max_seqlen_k − max_seqlen_q, 0)`` when ``same_segments`` (one cu_seqlens for both sides, so
    ``nk == nq``), else ``max_seqlen_k`` (no skipping). Returns dq, dk, dv in the packed layouts, 0 outside
    every document."""
    B, Nq, Nk = cu_q.shape[0] - 1, max_seqlen_q, max_seqlen_k
    shift = max(Nk - Nq, 0) if same_segments else Nk
    kw = dict(softmax_scale=softmax_scale, causal=causal, budget=budget, shift=shift)
    gathered = _padded_gathered(dout, q, k, v, out, lse, cu_q, cu_k, Nq, Nk, **kw)
    if not (B * Nq == q.shape[0] and B * Nk == k.shape[0]):
        return gathered()
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    exact = jnp.all(lq == Nq) & jnp.all(lk == Nk)  # then cu = [0, N, 2N, ...] on both sides

    def in_place():  # the packed tensors are the dense batch as they are (no gather, no scatter)
        pos = jnp.arange(Nq)[None] + (Nk - Nq) if causal else jnp.full((B, Nq), Nk - 1)
        pos = jnp.broadcast_to(pos, (B, Nq))
        batch = lambda x, n: x.reshape(B, n, *x.shape[1:])  # noqa: E731
        lse_d = lse.reshape(lse.shape[0], B, Nq).transpose(1, 0, 2)
        dq, dk, dv = gemm_backward(batch(dout, Nq), batch(q, Nq), batch(k, Nk), batch(v, Nk), batch(out, Nq), lse_d,
                                   positions=pos.astype(jnp.float32), **kw)
        return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape)

    return jax.lax.cond(exact, in_place, gathered)


def _padded_gathered(dout, q, k, v, out, lse, cu_q, cu_k, Nq: int, Nk: int, **kw):
    """:func:`gemm_backward_padded` with every document gathered into its padded slot (a thunk)."""
    Tq, Tk = q.shape[0], k.shape[0]
    lq, lk = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    tq, tk = jnp.arange(Nq), jnp.arange(Nk)

    def run():
        tok_q = cu_q[:-1, None] + jnp.minimum(tq[None], jnp.maximum(lq - 1, 0)[:, None])  # padding repeats a row
        tok_k = cu_k[:-1, None] + jnp.minimum(tk[None], jnp.maximum(lk - 1, 0)[:, None])
        valid_q, valid_k = tq[None] < lq[:, None], tk[None] < lk[:, None]
        take = lambda x, tok: jnp.take(x, tok, axis=0, mode="clip")  # noqa: E731  ([B, N, H, D])
        lse_d = jnp.where(valid_q[:, None], jnp.take(lse, tok_q, axis=1, mode="clip").transpose(1, 0, 2), -jnp.inf)
        if kw["causal"]:  # row t of a document sees keys j <= t + nk - nq
            pos = tq[None] + (lk - lq)[:, None]
        else:
            pos = jnp.broadcast_to((lk - 1)[:, None], (lq.shape[0], Nq))
        dq, dk, dv = gemm_backward(take(dout, tok_q), take(q, tok_q), take(k, tok_k), take(v, tok_k),
                                   take(out, tok_q), lse_d, positions=pos.astype(jnp.float32), **kw)
        dst_q = jnp.where(valid_q, tok_q, Tq).reshape(-1)  # padding lands on a dropped row
        dst_k = jnp.where(valid_k, tok_k, Tk).reshape(-1)

        def scatter(total, dst, x):
            rows = x.reshape(-1, *x.shape[2:])
            return jnp.zeros((total + 1, *rows.shape[1:]), x.dtype).at[dst].set(rows)[:total]

        return scatter(Tq, dst_q, dq), scatter(Tk, dst_k, dk), scatter(Tk, dst_k, dv)

    return run
