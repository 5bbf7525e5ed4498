"""Paged attention for JAX (issue #44): ``jax.experimental.pallas.ops.gpu.paged_attention``'s signature and layout
on xattn's kernels (FFPA for head dims 320-512, FA4 for <= 256), jit-able with traced lengths.

Pools ``k_pages/v_pages [Hkv, total_pages, page_size, D]`` (the heads-first layout Pallas uses; the launchers read
it through a permuted layout, no copy), ``block_tables [B, pages_per_sequence]`` int32, ``lengths [B]`` int32.
A call is the virtual batch of :mod:`xattn.core.paged`: ``S * B`` entries (slot-major), each one query row of
sequence b on its split's pages, one paged launch through XLA FFI, then the merge by lse in jnp
(:func:`xattn.jax.split_kv.merge`); one split: one launch, no merge.
"""

from __future__ import annotations

import jax.numpy as jnp

from xattn.core import paged, routes
from xattn.core import varlen_check as vc
from xattn.core.spec import KernelSpec, family_for, supports
from xattn.core.split_kv import MAX_PARTIALS, split_launch_spec

from . import _ffi
from .split_kv import merge, num_sms

__all__ = ["paged_attention"]

_NAMES = ("block_tables", "lengths")  # the peer's names, in checked mode's messages

_PALLAS_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, k_scales_pages=None, v_scales_pages=None, *,
                    block_h: int = 16, pages_per_compute_block: int = 8, k_splits: int = 16, num_warps: int = 8,
                    num_stages: int = 2, interpret: bool = False, debug: bool = False,
                    mask_value: float = _PALLAS_MASK_VALUE, attn_logits_soft_cap: float | None = None,
                    num_splits: int = 0, check_inputs: bool | None = None):
    """Pallas' GPU ``paged_attention`` on xattn's kernels: q ``[B, Hq, D]`` -> out ``[B, Hq, Dv]`` (q's dtype).

    As the peer: no softmax scale (scale q yourself), sequence b attends to its first ``lengths[b]`` keys
    (``lengths=None``: every page of its table), key j of sequence b is row ``j % page_size`` of page
    ``block_tables[b, j // page_size]`` in each head's pool. The peer's tiling arguments (``block_h``,
    ``pages_per_compute_block``, ``k_splits``, ``num_warps``, ``num_stages``, ``interpret``, ``debug``) are
    accepted and ignored: xattn splits the keys by its own rule (:func:`xattn.core.routes.forward_route`;
    ``num_splits``: 0 auto, 1 one launch, n at most n splits).
    ``mask_value`` only shapes rows without keys, which xattn writes as 0. Quantized pools (``k_scales_pages``,
    ``v_scales_pages``) and ``attn_logits_soft_cap`` raise ``NotImplementedError``. Page sizes: 16-256 for
    FA4, multiples of 64 for FFPA. Rows past a sequence's length in its last page must hold finite values (a
    masked key's value still enters P V as 0 x value). Table values and lengths are trusted (as the peer's)
    unless ``check_inputs`` (``None``: ``XATTN_CHECK_INPUTS=1``): then a length outside the table or a used page
    outside the pool raises :class:`xattn.core.paged.PageTableError` (a ``ValueError``) naming it, eagerly (one
    device-to-host copy), or, under ``jit``, as a ``checkify`` user check (wrap the function in
    ``checkify.checkify``; a failed check launches on an empty table), as :func:`xattn.jax.varlen_attention`
    checks its cu_seqlens."""
    del block_h, pages_per_compute_block, k_splits, num_warps, num_stages, interpret, debug, mask_value
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits < MAX_PARTIALS:
        raise ValueError(f"num_splits: expected an int in 0-{MAX_PARTIALS - 1} (0 auto, 1 off), got {num_splits!r}")
    if k_scales_pages is not None or v_scales_pages is not None or attn_logits_soft_cap is not None:
        raise NotImplementedError("paged_attention: quantized pools (k/v_scales_pages) and attn_logits_soft_cap "
                                  "are not in xattn's kernels")
    if q.ndim != 3 or k_pages.ndim != 4 or v_pages.shape[:3] != k_pages.shape[:3] or q.shape[-1] != k_pages.shape[-1]:
        raise ValueError(f"q/k_pages/v_pages: expected [B, Hq, D] / [Hkv, pages, page_size, D] (same D), got "
                         f"{q.shape} / {k_pages.shape} / {v_pages.shape}")
    b, hq, d = q.shape
    hkv, num_pages, ps, _ = k_pages.shape
    dv = v_pages.shape[-1]
    if block_tables.ndim != 2 or block_tables.shape[0] != b or hq % hkv:
        raise ValueError(f"block_tables: expected [B={b}, pages_per_sequence] and Hq % Hkv == 0, got "
                         f"{block_tables.shape}, Hq={hq}, Hkv={hkv}")
    family = family_for(d, dv)
    spec = split_launch_spec(KernelSpec(family or "fa4", "fwd", jnp.dtype(q.dtype).name, d, dv, hq // hkv,
                                        page_size=ps, kv_heads_first=True))  # the decode tile where pages fit it
    reason = supports(spec) if family else f"no kernel family runs head dims {d}/{dv}"
    if reason:
        raise NotImplementedError(f"paged_attention: {reason}")
    max_pages = block_tables.shape[1]
    table = block_tables.astype(jnp.int32)
    n = table.shape[1] * ps * jnp.ones((b,), jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    if vc.checking(check_inputs):
        table, n = _checked_table(table, n, num_pages, ps)
    if family == "ffpa":  # the flat [Hkv, pages * page_size, D] view of each head's pool
        k_pages, v_pages = k_pages.reshape(hkv, num_pages * ps, d), v_pages.reshape(hkv, num_pages * ps, dv)
    problem = routes.FwdProblem(family, b, hkv, hq // hkv, 1, max_pages * ps, num_sms=num_sms(),
                                num_splits=num_splits, traced=True)
    route = routes.forward_route(problem)  # XATTN_FWD_ROUTE and num_splits as on contiguous caches
    plan = paged.plan_paged(route.plan.splits if route.name == "split-kv" else 1, False, 1, max_pages)
    s, pps = plan.splits, plan.pages_per_split
    span = pps * ps
    keys = jnp.clip(n[None, :] - jnp.arange(s, dtype=jnp.int32)[:, None] * span, 0, span)  # [S, B]
    if plan.padded:
        table = jnp.pad(table, ((0, 0), (0, s * pps - max_pages)))
    cols = table.reshape(b, s, pps).transpose(1, 0, 2)
    meta = jnp.concatenate([keys[..., None], cols], axis=2).reshape(s * b, 1 + pps)
    q_entries = jnp.broadcast_to(q[None, :, None], (s, b, 1, hq, d)).reshape(s * b, 1, hq, d)
    outs = [("out", (s * b, 1, hq, dv), q.dtype), ("lse", (s * b, hq, 1), "float32")]
    out, lse = _ffi.call(spec, [q_entries, k_pages, v_pages, meta], outs, [], 1.0, vmap_method="sequential")
    if s == 1:
        return out.reshape(b, hq, dv)
    out_p = out.reshape(s, b, 1, hq, dv).transpose(1, 0, 2, 3, 4)  # [B, P, Nq, Hq, Dv]
    lse_p = lse.reshape(s, b, hq, 1).transpose(2, 1, 0, 3)  # [Hq, B, P, Nq]
    merged, _ = merge(out_p, lse_p, q.dtype)
    return merged.reshape(b, hq, dv)


def _checked_table(table, n, num_pages: int, page_size: int):
    """Checked mode (:func:`xattn.core.paged.page_table_problem`'s rules): concrete values are read once on the host
    and a broken rule raises :class:`~xattn.core.paged.PageTableError`; traced ones become checkify user checks
    naming the first bad sequence and page, and a failed check hands the launch an empty table (lengths 0, pages
    0: nothing outside the pool is read). Returns the ``(table, lengths)`` to launch with."""
    import jax
    import numpy as np
    from jax.experimental import checkify

    if not isinstance(table, jax.core.Tracer) and not isinstance(n, jax.core.Tracer):
        why = paged.page_table_problem(np.asarray(table).tolist(), np.asarray(n).tolist(), num_pages, page_size,
                                       _NAMES)
        if why:
            raise paged.PageTableError(why)
        return table, n
    b, columns = table.shape
    bad_len = (n < 0) | (n > columns * page_size)
    used = (jnp.clip(n, 0, columns * page_size) + page_size - 1) // page_size
    in_use = jnp.arange(columns)[None, :] < used[:, None]
    bad_page = in_use & ((table < 0) | (table >= num_pages)) & ~bad_len[:, None]
    first = jnp.argmax(bad_len)
    checkify.check(~jnp.any(bad_len), paged.length_message(_NAMES, "{}", "{}", columns, page_size), first, n[first])
    flat = jnp.argmax(bad_page.reshape(-1))
    rb, rj = flat // columns, flat % columns
    checkify.check(~jnp.any(bad_page), paged.page_message(_NAMES, "{}", "{}", "{}", num_pages, "{}"), rb, rj,
                   table[rb, rj], rb, used[rb] - 1)
    ok = ~jnp.any(bad_len) & ~jnp.any(bad_page)
    return jnp.where(ok, table, 0), jnp.where(ok, n, 0)
