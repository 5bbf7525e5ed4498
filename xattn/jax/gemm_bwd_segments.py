"""JAX driver of the segmented GEMM backward: a packed batch's d512 backward under ``jit``.

The document lengths are traced, so the launches cannot be shaped per document (as torch's
grouped route does) or padded per document (:func:`xattn.jax.gemm_bwd.gemm_backward_padded`,
which only pays off when the documents are about ``max_seqlen`` long). Instead each row block c of
:func:`xattn.core.gemm_bwd_plan.segment_plan` is five launches over every (KV head, document)
piece with rows in it (:mod:`xattn.core.gemm_segments_sm90`), whose offsets come from int32 tables
built with jnp from ``cu_seqlens`` (:func:`xattn.core.gemm_bwd_plan.segment_block_tables`, which torch's
driver builds with NumPy); q/dout/dq, K/V and the dK/dV accumulators are read and written in place
through them, and only the block's scores (P, dS: ``(rows, kend)``, the pieces' rows packed) are
scratch. Layouts (built once per call): query side ``[Hkv, T, g, D]`` as
``(Hkv·T·g, D)`` rows (a KV head's query heads stacked per token, as the dense route's blocks);
key side ``[Hkv, T + spare, D]`` (``spare`` zero rows for the overlapping view); fp32 accumulators
``[Hkv, acc_rows, D]`` with each document at a multiple of 128 rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from xattn.core import gemm_bwd_plan as plan_mod
from xattn.core.gemm_sm90 import GemmSpec, max_active_clusters

from . import _ffi
from .gemm_bwd import GEMM_DTYPES, LOG2E, check_buffers, num_sms

__all__ = ["gemm_backward_segments"]


def _launch(kind: str, dtype: str, inputs, results, scale=None, aliases=None):
    attrs = {"max_clusters": np.int32(max_active_clusters(num_sms()))}
    if scale is not None:
        attrs = {"scale": np.float32(scale), **attrs}
    return _ffi.call_gemm(GemmSpec(kind, dtype), inputs, results, attrs, aliases or {})


def gemm_backward_segments(dout, q, k, v, out, lse, cu, *, max_seqlen: int, softmax_scale: float, causal: bool,
                           budget: int | None = None, rows: int | None = None):
    """dq ``[Tq, Hq, D]``, dk/dv ``[Tk, Hkv, D]`` of a packed self-attention call (``cu`` int32 ``[S + 1]``
    for both queries and keys, traced, ``cu[-1] <= min(Tq, Tk)``; documents at most ``max_seqlen`` long;
    causal top-left per document) from its out/lse (lse fp32 ``[Hq, Tq]``). Rows past ``cu[-1]`` get zero
    gradients. ``rows`` / ``budget``: :func:`xattn.core.gemm_bwd_plan.segment_plan`'s."""
    check_buffers(dout[None], q[None], out[None], lse[None])
    tq, tk = q.shape[0], k.shape[0]
    if tk != tq:  # rows past cu[-1] belong to no document: the key side takes the query side's row count
        fit = (lambda x: x[:tq]) if tk > tq else (lambda x: jnp.pad(x, ((0, tq - tk), (0, 0), (0, 0))))
        refit = (lambda x: jnp.pad(x, ((0, tk - tq), (0, 0), (0, 0)))) if tk > tq else (lambda x: x[:tk])
        dq, dk, dv = gemm_backward_segments(dout, q, fit(k), fit(v), out, lse, cu, max_seqlen=max_seqlen,
                                            softmax_scale=softmax_scale, causal=causal, budget=budget, rows=rows)
        return dq, refit(dk), refit(dv)
    T, Hq, D = q.shape
    Hkv, S = k.shape[1], cu.shape[0] - 1
    g = Hq // Hkv
    dt = GEMM_DTYPES[jnp.dtype(q.dtype)]
    p = plan_mod.segment_plan(T, S, max_seqlen, Hq, Hkv, causal, budget=budget, rows=rows)
    R, spare, acc_rows = p.rows, p.spare_keys, p.acc_rows

    def query_side(x):
        return x.reshape(T, Hkv, g, D).transpose(1, 0, 2, 3).reshape(Hkv * T * g, D)

    def key_side(x):
        return jnp.pad(x.transpose(1, 0, 2), ((0, 0), (0, spare), (0, 0))).reshape(Hkv * (T + spare), D)

    def row_vector(x):  # [Hq, T] -> the query side's row order
        return x.reshape(Hkv, g, T).transpose(0, 2, 1).reshape(-1)

    qr, dor, kr, vr = query_side(q), query_side(dout), key_side(k), key_side(v)
    lse32 = lse.astype(jnp.float32)
    rowbias = row_vector(jnp.where(jnp.isfinite(lse32), lse32 * -LOG2E, -jnp.inf))
    delta = row_vector(jnp.einsum("thd,thd->ht", dout.astype(jnp.float32), out.astype(jnp.float32)))
    cu = cu.astype(jnp.int32)
    lens, starts, acc_starts = plan_mod.segment_offsets(jnp, cu)
    colpos = jnp.arange(spare, dtype=jnp.float32)
    dq = jnp.zeros((Hkv * T * g, D), q.dtype)
    dk_acc = jnp.zeros((Hkv * acc_rows, D), jnp.float32)
    dv_acc = jnp.zeros((Hkv * acc_rows, D), jnp.float32)
    scale_log2 = softmax_scale * LOG2E
    for first, count in p.head_groups:
        heads = np.arange(first, first + count)
        for c, (kend, max_rows) in enumerate(p.blocks):
            # one block's scratch at a time: without this XLA may run every block's independent P GEMM
            # first and hold all their scores at once (the identity otherwise)
            qr, dor, kr, vr, dq, dk_acc, dv_acc = jax.lax.optimization_barrier((qr, dor, kr, vr, dq, dk_acc, dv_acc))
            tables, cu_rows = plan_mod.segment_block_tables(jnp, lens, starts, acc_starts, heads, c, R, kend, T,
                                                            spare, acc_rows, g)
            m = count * g * max_rows  # the scratch's rows (a bound; the pieces' rows come first)
            r = jnp.arange(m, dtype=jnp.int32)
            piece = jnp.clip(jnp.searchsorted(cu_rows, r, side="right") - 1, 0, count * S - 1)
            within = r - cu_rows[piece]
            qrow = jnp.clip(tables[0, piece] + within, 0, Hkv * T * g - 1)
            if causal:
                rowpos = (c * R + within // g).astype(jnp.float32)
            else:  # every key of the document; the view's keys past it are masked
                rowpos = (lens[piece % S] - 1).astype(jnp.float32)
            rb, dl = jnp.take(rowbias, qrow), jnp.take(delta, qrow)
            pb, pf = _launch("seg_probs", dt, [qr, kr, tables, cu_rows, rb, rowpos, colpos],
                             [((m, kend), q.dtype), ((m, kend), jnp.float16)], scale=scale_log2)
            (ds,) = _launch("seg_grad_scores", dt, [dor, vr, tables, cu_rows, pf, dl], [((m, kend), q.dtype)],
                            scale=softmax_scale)
            (dq,) = _launch("seg_mm_dq", dt, [ds, kr, tables, cu_rows, dq], [(dq.shape, q.dtype)], aliases={4: 0})
            (dv_acc,) = _launch("seg_acc", dt, [pb, dor, tables, cu_rows, dv_acc], [(dv_acc.shape, jnp.float32)],
                                aliases={4: 0})
            (dk_acc,) = _launch("seg_acc", dt, [ds, qr, tables, cu_rows, dk_acc], [(dk_acc.shape, jnp.float32)],
                                aliases={4: 0})
    tok = jnp.arange(T, dtype=jnp.int32)
    doc = jnp.clip(jnp.searchsorted(cu, tok, side="right") - 1, 0, S - 1)
    inside = tok < cu[-1]
    acc_row = jnp.where(inside, acc_starts[doc] + tok - starts[doc], 0)

    def unpack(acc):  # [Hkv * acc_rows, D] fp32 -> [T, Hkv, D]
        x = jnp.take(acc.reshape(Hkv, acc_rows, D), acc_row, axis=1).transpose(1, 0, 2)
        return jnp.where(inside[:, None, None], x, 0).astype(k.dtype)

    dq = dq.reshape(Hkv, T, g, D).transpose(1, 0, 2, 3).reshape(T, Hq, D)
    return dq, unpack(dk_acc), unpack(dv_acc)
