"""The ``split-kv`` forward route in JAX (decoding under ``jit``): the family's varlen forward over key splits
through XLA FFI, merged by lse in jnp (XLA fuses the merge; fp32 accumulation, as the combine kernel the torch
front end runs). How and why: :mod:`xattn.core.split_kv` (glossary there); when:
:func:`xattn.core.routes.forward_route`, decided at trace time from static shapes.

JAX arrays are compact, so k/v ``[B, Nk, Hkv, D]`` reshape to the flat key view ``[B Nk, Hkv, D]`` for free
(R = Nk); the split launch reads q ``[B*Nq, Hq, D]`` as it is where the core has a shared-q launch (FA4 d128,
GQA group > 1: :func:`xattn.core.split_kv.shared_queries`), else ``q_split [B*P*Nq, Hq, D]``, one broadcast copy
of q per slot; the cu_seqlens are trace-time constants (from traced lengths: jnp arithmetic). Packed calls
(varlen) run as the dense problem of ``max_seqlen_q`` queries per document on packed keys
(:func:`packed_split_forward`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from xattn.core import split_kv
from xattn.core.device import cuda_gpus
from xattn.core.split_kv import SplitPlan

from . import _ffi

__all__ = ["split_forward", "packed_split_forward", "num_sms", "device_cu_seqlens_k"]


def num_sms() -> int:
    """The SM count of the first GPU (132, an H200's, on a machine without one: the CPU stand-ins decide as
    the H200 would)."""
    gpus = cuda_gpus()
    return gpus[0].num_sms if gpus else 132


def _varlen(cfg, causal: bool, q, k, v, cu_q, cu_k, max_q: int, max_k: int, rows: int | None = None):
    """One varlen forward launch: ``(out [T, Hq, Dv], lse [Hq, T])``, pre-filled 0 / -inf where the spec says;
    the non-causal one is the split launch (with the core's decode tile where it has one). ``rows``: T of a
    shared-q split launch (:func:`xattn.core.split_kv.shared_queries`), whose q ``[B*Nq, Hq, D]`` holds each
    sequence's queries once; it is validated as the call with one q per slot (T rows) that it stands for."""
    c = dataclasses.replace(cfg, causal=causal, window=(None, None))
    t = q.shape[0] if rows is None else rows
    as_validated = q if rows is None else jax.ShapeDtypeStruct((t, *q.shape[1:]), q.dtype)
    spec = c.spec("fwd", as_validated, k, v, cu_q, cu_k, max_q, max_k)
    if not causal:
        spec = split_kv.split_launch_spec(spec, shared_q=rows is not None)
    outs = [("out", (t, q.shape[1], v.shape[-1]), q.dtype), ("lse", (q.shape[1], t), "float32")]
    out, lse = _ffi.call(spec, [q, k, v, cu_q, cu_k], outs, [], c.scale, vmap_method="sequential")
    return out, lse


def device_cu_seqlens_k(plan: SplitPlan, seqlen_q: int, rows: int, key_rows: int, lengths, starts=None):
    """``(cu_k, tail_cu_k)`` int32 from traced per-sequence valid keys ``lengths [B]`` starting every ``rows``
    rows or at ``starts [B]`` (packed keys): the documents of :func:`xattn.core.split_kv.split_cu_seqlens`, each
    sequence's chunk ``plan.chunk`` or its own (``tail_cu_k`` None without a tail)."""
    n = jnp.asarray(lengths).astype(jnp.int32)
    base = jnp.arange(n.shape[0], dtype=jnp.int32) * rows if starts is None else jnp.asarray(starts).astype(jnp.int32)
    full = n - jnp.minimum(n, seqlen_q) if plan.tail else n
    per = plan.splits * split_kv.KEY_TILE
    chunk = jnp.full_like(full, plan.chunk) if plan.chunk else \
        jnp.maximum((full + per - 1) // per, 1) * split_kv.KEY_TILE
    bounds = jnp.minimum(jnp.arange(plan.splits, dtype=jnp.int32)[None] * chunk[:, None], full[:, None])
    edge = (base + full)[:, None]
    starts = jnp.concatenate([base[:, None] + bounds] + [edge] * (2 if plan.tail else 1), axis=1)
    cu_k = jnp.concatenate([starts.reshape(-1), jnp.full((1,), key_rows, jnp.int32)])
    if not plan.tail:
        return cu_k, None
    return cu_k, jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.stack([base + full, base + n], 1).reshape(-1)])


def split_forward(cfg, plan: SplitPlan, q, k, v, lengths=None):
    """``(out [B, Nq, Hq, Dv], lse fp32 [B, Hq, Nq])`` of a dense call by the split route: sequence b holds its
    first ``lengths[b]`` keys (int ``[B]``, traced; clipped to ``[0, Nk]``), or all Nk (``None``). ``cfg``: the
    call's :class:`xattn.jax.attention.Config`."""
    b, nk = q.shape[0], k.shape[1]
    kf, vf = k.reshape(b * nk, *k.shape[2:]), v.reshape(b * nk, *v.shape[2:])
    return _split(cfg, plan, q, kf, vf, nk, lengths if lengths is None else jnp.clip(jnp.asarray(lengths), 0, nk))


def packed_split_forward(cfg, plan: SplitPlan, q, k, v, cu_q, cu_k, max_seqlen_q: int):
    """``(out [Tq, Hq, Dv], lse fp32 [Hq, Tq])`` of packed queries q ``[Tq, Hq, D]`` (at most ``max_seqlen_q`` per
    document) on packed keys k/v ``[Tk, Hkv, D/Dv]`` by the split route: the dense problem of Nq = ``max_seqlen_q``
    queries per document (:mod:`xattn.core.split_kv`, "Packed queries"), gathered in and out by traced indices;
    rows past ``cu_q[-1]`` read out 0, lse -inf."""
    b, nq = cu_q.shape[0] - 1, max_seqlen_q
    tq, hq, d = q.shape
    dv = v.shape[-1]
    cu_q, cu_k = jnp.asarray(cu_q).astype(jnp.int32), jnp.asarray(cu_k).astype(jnp.int32)
    src = jnp.clip(cu_q[1:, None] - nq + jnp.arange(nq, dtype=jnp.int32), 0, max(tq - 1, 0)).reshape(-1)
    out_d, lse_d = _split(cfg, plan, q[src].reshape(b, nq, hq, d), k, v, 0, cu_k[1:] - cu_k[:-1], cu_k[:-1])
    t = jnp.arange(tq, dtype=jnp.int32)
    doc = jnp.minimum(jnp.searchsorted(cu_q[1:], t, side="right"), max(b - 1, 0))
    row = doc * nq + jnp.clip(t - cu_q[doc + 1] + nq, 0, nq - 1)
    kept = t < cu_q[-1]
    out = jnp.where(kept[:, None, None], out_d.reshape(b * nq, hq, dv)[row], 0).astype(q.dtype)
    lse = jnp.where(kept, jnp.transpose(lse_d, (1, 0, 2)).reshape(hq, b * nq)[:, row], -jnp.inf)
    return out, lse


def _split(cfg, plan: SplitPlan, q, kf, vf, nk: int, lengths, starts=None):
    """:func:`split_forward` on the flat key views ``kf/vf [key_rows, Hkv, D]``: sequence b's keys start at row
    ``b * nk`` (its first ``lengths[b]``, or all nk) or at ``starts[b]`` (traced, with ``lengths``)."""
    b, nq, hq, d = q.shape
    dv = vf.shape[-1]
    p = plan.partials
    key_rows = kf.shape[0]
    cu_q, cu_k, tail_q, tail_k = split_kv.split_cu_seqlens(plan, nq, nk, [nk] * b, key_rows)
    longest = lambda cu: max((y - x for x, y in zip(cu, cu[1:])), default=0)  # noqa: E731
    const = lambda cu: jnp.asarray(np.asarray(cu, dtype=np.int32))  # noqa: E731
    max_k, tail_max_k = longest(cu_k), longest(tail_k)
    cu_k, tail_k = const(cu_k), const(tail_k) if tail_k else None
    if lengths is not None:  # the documents' keys from the traced lengths; the queries' as planned
        cu_k, tail_k = device_cu_seqlens_k(plan, nq, nk, key_rows, lengths, starts)
        max_k = tail_max_k = key_rows
    if split_kv.shared_queries(cfg.family, d, dv, hq // kf.shape[1]):  # the launch reads q's own rows
        out_p, lse_p = _varlen(cfg, False, q.reshape(b * nq, hq, d), kf, vf, const(cu_q), cu_k, nq, max_k,
                               rows=b * p * nq)
    else:  # one copy of q per slot
        q_split = jnp.broadcast_to(q[:, None], (b, p, nq, hq, d)).reshape(b * p * nq, hq, d)
        out_p, lse_p = _varlen(cfg, False, q_split, kf, vf, const(cu_q), cu_k, nq, max_k)
    out_p, lse_p = out_p.reshape(b, p, nq, hq, dv), lse_p.reshape(hq, b, p, nq)
    if plan.tail:
        out_t, lse_t = _varlen(cfg, True, q.reshape(b * nq, hq, d), kf, vf, const(tail_q), tail_k, nq, tail_max_k)
        out_p = out_p.at[:, p - 1].set(out_t.reshape(b, nq, hq, dv))
        lse_p = lse_p.at[:, :, p - 1].set(lse_t.reshape(hq, b, nq))
    return merge(out_p, lse_p, q.dtype)


def merge(out_p, lse_p, dtype):
    """The combine: ``out_p [B, P, Nq, Hq, Dv]``, ``lse_p [Hq, B, P, Nq]`` (fp32) -> ``(out [B, Nq, Hq, Dv]`` in
    ``dtype``, ``lse [B, Hq, Nq])``; a row no slot reaches gets out 0, lse -inf."""
    top = jnp.max(lse_p, axis=2, keepdims=True)
    top = jnp.where(jnp.isneginf(top), 0.0, top)
    weight = jnp.exp(lse_p - top)  # [Hq, B, P, Nq]; 0 for empty slots
    total = jnp.sum(weight, axis=2)  # [Hq, B, Nq]
    lse = jnp.log(total) + top[:, :, 0]  # -inf where every slot is empty
    norm = jnp.where(total > 0, 1.0 / jnp.where(total > 0, total, 1.0), 0.0)
    out = jnp.einsum("hbpn,bpnhd->bnhd", weight * norm[:, :, None], out_p.astype(jnp.float32))
    return out.astype(dtype), jnp.transpose(lse, (1, 0, 2))
