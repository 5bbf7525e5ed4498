"""FlashAttention's ``flash_attn_with_kvcache`` on xattn's kernels: decoding against a KV cache with per-sequence
valid lengths, appending the new keys and values in place.

Glossary: B batch, Nq new queries per sequence, Nc cache capacity, Nn new keys per sequence, Hq/Hkv heads, D/Dv
head dims. Sequence b attends to its first ``L_b = cache_seqlens[b] + Nn`` cache rows (after the append); causal
and windows are bottom-right aligned on them (query i sits at position ``L_b - Nq + i``), as in FlashAttention.
Served by the route :func:`xattn.core.routes.forward_route` picks: ``split-kv`` (:mod:`xattn.core.split_kv`) or the
family's fused varlen forward, both over a flat strided view of the caches (no copy of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xattn.core import routes
from xattn.core.checks import Memo
from xattn.core.split_kv import MAX_PARTIALS

from . import ops, paged, split_kv
from .attention import as_input, attention_with_lse, checked_scale, default_family, mask_args

__all__ = ["attention_with_kvcache", "paged_attention", "lengths_forward"]

_ROUTES = Memo(256)  # the call's sizes and knobs -> its forward Route
_CU_Q = Memo(256)  # (B, Nq, device) -> the fused route's cu_seqlens_q (sequence b, then a gap document)


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None,
                           causal=False, window_size=(-1, -1), num_splits=0, return_softmax_lse=False, *,
                           page_table=None, block_table=None, family: str | None = None,
                           check_inputs: bool | None = None):
    """FlashAttention's ``flash_attn_with_kvcache`` (its names and layouts; no gradient).

    q ``[B, Nq, Hq, D]``; k_cache/v_cache ``[B, Nc, Hkv, D/Dv]``, any strides with a unit last one (HF's
    ``[B, Hkv, Nc, D]`` cache transposed reads in place); k/v ``[B, Nn, Hkv, D/Dv]`` (optional): written into the
    caches in place at rows ``cache_seqlens[b] + j`` before the attention; cache_seqlens: an int or an int32/int64
    tensor ``[B]`` on q's device (``None``: every cache row is valid, and k/v may not be given).
    ``num_splits``: 0 auto, 1 the fused kernel, n > 1 that many key splits. Returns out ``[B, Nq, Hq, Dv]``, and
    lse ``[B, Hq, Nq]`` (fp32, natural log; -inf for a row that sees no key) with ``return_softmax_lse=True``.

    ``cache_seqlens`` values are trusted (reading them would synchronise): a length past ``Nc - Nn`` writes or
    reads outside the cache. ``check_inputs=True`` (``None``: ``XATTN_CHECK_INPUTS=1``) checks them on the host
    first and raises ``ValueError`` naming the first bad sequence. Rows past ``cache_seqlens[b]`` may hold any
    finite values (stale rows leave the result unchanged) but not NaN or Inf: a key tile loaded past the length is
    masked, yet its values enter P V as 0 x value (FlashAttention-3/4 likewise, Dao-AILab/flash-attention#2374;
    FlashAttention-2 zero-fills them). Allocate caches with ``torch.zeros``, as HF's static and paged caches do.

    **Paged cache** (``page_table``, FlashAttention-3's name; ``block_table``, FlashAttention-2's, is the same):
    k_cache/v_cache are pools ``[num_pages, page_size, Hkv, D/Dv]`` and ``page_table [B, max_pages]`` int32 maps
    sequence b's key j to pool page ``page_table[b, j // page_size]``, row ``j % page_size``
    (:mod:`xattn.core.paged`; FFPA needs page sizes that are multiples of 64). Appended rows go through the
    table. Its values are trusted like ``cache_seqlens``; checked mode raises
    :class:`xattn.core.paged.PageTableError` (a ``ValueError``) for a page past the pool or negative among
    the pages a sequence uses. Rows past a sequence's length in its last page must hold finite values.
    """
    q, k_cache, v_cache = as_input("q", q), as_input("k_cache", k_cache), as_input("v_cache", v_cache)
    if k_cache.dim() != 4 or q.dim() != 4:
        raise ValueError(f"q/k_cache: expected [B, Nq, Hq, D] / [B, Nc, Hkv, D], got {tuple(q.shape)} / "
                         f"{tuple(k_cache.shape)}")
    _check_num_splits(num_splits)
    if block_table is not None:
        if page_table is not None:
            raise ValueError("page_table/block_table: give one (they are the same argument)")
        page_table = block_table
    if page_table is not None:
        return _paged(q, k_cache, v_cache, k, v, cache_seqlens, softmax_scale, causal, window_size, num_splits,
                      return_softmax_lse, as_input("page_table", page_table), family, check_inputs)
    if cache_seqlens is None:
        if k is not None or v is not None:
            raise ValueError("k/v: appending needs cache_seqlens (where each sequence's new rows go)")
        out, lse = attention_with_lse(q, k_cache, v_cache, softmax_scale=softmax_scale, causal=causal,
                                      window_size=window_size, family=family, num_splits=num_splits)
        return (out, lse) if return_softmax_lse else out
    lengths = _lengths(cache_seqlens, q.shape[0], q.device)
    if (k is None) != (v is None):
        raise ValueError("k/v: give both or neither")
    new = 0 if k is None else k.shape[1]
    if ops.checking(check_inputs):
        _check_lengths(lengths, new, k_cache.shape[1])
    if k is not None:
        _append(k_cache, v_cache, as_input("k", k), as_input("v", v), lengths)
        lengths = lengths + new
    family = family or default_family(q.shape[-1], v_cache.shape[-1])
    scale = checked_scale(softmax_scale, q.shape[-1])
    causal, left, right = mask_args(causal, window_size)
    with torch.no_grad():
        out, lse = lengths_forward(q, k_cache, v_cache, lengths, family, scale, causal, left, right, num_splits)
    return (out, lse) if return_softmax_lse else out


def paged_attention(q, k_pages, v_pages, page_table, seqused_k, *, cu_seqlens_q=None, max_seqlen_q=None,
                    softmax_scale=None, causal=False, window_size=(-1, -1), num_splits=0, return_softmax_lse=False,
                    family: str | None = None, check_inputs: bool | None = None):
    """Attention of q on a paged KV cache, FlashAttention's names (no gradient; nothing appended).

    Pools ``k_pages/v_pages [num_pages, page_size, Hkv, D/Dv]``, ``page_table [B, max_pages]`` int32 and
    ``seqused_k [B]`` int32 (each sequence's keys) as in :func:`attention_with_kvcache`. Dense q
    ``[B, Nq, Hq, D]`` (decoding: the split route) -> out ``[B, Nq, Hq, Dv]``, lse ``[B, Hq, Nq]``; packed q
    ``[Tq, Hq, D]`` with ``cu_seqlens_q [B + 1]`` int32 (prefill, or prefill mixed with decoding: vLLM's
    ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=..., seqused_k=..., block_table=...)``) -> out
    ``[Tq, Hq, Dv]``, lse ``[Hq, Tq]``; masks bottom-right aligned on each sequence's keys. ``max_seqlen_q`` (a
    bound on every sequence's queries, as FlashAttention's) lets a packed decoding batch (at most 16 queries per
    sequence) take the split route; without it packed calls run one launch. ``num_splits`` as
    :func:`attention_with_kvcache`. Checked mode as :func:`attention_with_kvcache` (and the cu_seqlens_q rules of
    the varlen entries, ``max_seqlen_q`` included)."""
    q, k_pages, v_pages = as_input("q", q), as_input("k_cache", k_pages), as_input("v_cache", v_pages)
    page_table = as_input("page_table", page_table)
    if cu_seqlens_q is None:
        return attention_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqused_k, softmax_scale=softmax_scale,
                                      causal=causal, window_size=window_size, num_splits=num_splits,
                                      return_softmax_lse=return_softmax_lse, page_table=page_table, family=family,
                                      check_inputs=check_inputs)
    cu_seqlens_q = as_input("cu_seqlens_q", cu_seqlens_q)
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.dim() != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"q/k_cache/v_cache: expected [Tq, Hq, D] / pools [num_pages, page_size, Hkv, D], got "
                         f"{tuple(q.shape)} / {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    b = page_table.shape[0] if page_table.dim() == 2 else -1
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (b + 1,) or cu_seqlens_q.device != q.device:
        raise ValueError(f"cu_seqlens_q: expected int32 [B + 1 = {b + 1}] on {q.device}, got {cu_seqlens_q.dtype} "
                         f"{tuple(cu_seqlens_q.shape)} on {cu_seqlens_q.device}")
    _check_table(q, k_pages, page_table, b, v_pages)
    _check_num_splits(num_splits)
    max_seqlen_q = _max_seqlen(max_seqlen_q)
    lengths = _lengths(seqused_k, b, q.device)
    if ops.checking(check_inputs):
        cu = cu_seqlens_q.tolist()
        for i, (x, y) in enumerate(zip(cu, cu[1:])):
            if cu[0] != 0 or y < x or cu[-1] > q.shape[0]:
                raise ValueError(f"cu_seqlens_q: must start at 0, never decrease and end <= Tq={q.shape[0]}; "
                                 f"got {cu[0]} at 0, {x} -> {y} at {i}, end {cu[-1]}")
            if max_seqlen_q is not None and y - x > max_seqlen_q:
                raise ValueError(f"max_seqlen_q={max_seqlen_q}: sequence {i} has {y - x} queries "
                                 f"(cu_seqlens_q {x} -> {y})")
        _check_lengths(lengths, 0, page_table.shape[1] * k_pages.shape[1])
        paged.check_page_table(page_table, lengths, k_pages.shape[0], k_pages.shape[1])
    family = family or default_family(q.shape[-1], v_pages.shape[-1])
    scale = checked_scale(softmax_scale, q.shape[-1])
    causal, left, right = mask_args(causal, window_size)
    with torch.no_grad():
        out, lse = paged.paged_varlen_forward(q, k_pages, v_pages, cu_seqlens_q, page_table, lengths, family, scale,
                                              causal, left, right, max_seqlen_q, num_splits)
    return (out, lse) if return_softmax_lse else out


def _check_num_splits(num_splits) -> None:
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or not 0 <= num_splits < MAX_PARTIALS:
        raise ValueError(f"num_splits: expected an int in 0-{MAX_PARTIALS - 1} (0 auto, 1 off), got {num_splits!r}")


def _max_seqlen(value) -> int | None:
    """A caller's ``max_seqlen_q`` (None, or a non-negative int)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"max_seqlen_q: expected None or a non-negative int, got {value!r}")
    return value


def _check_table(q, k_pages, page_table, b: int, v_pages=None) -> None:
    """The paged call's metadata checks, before anything is written or launched."""
    for name, pool in (("k_cache", k_pages), ("v_cache", v_pages)):
        if pool is not None and (pool.device != q.device or pool.dtype != q.dtype):
            raise ValueError(f"{name}: expected {q.dtype} on {q.device} (as q), got {pool.dtype} on {pool.device}")
    if page_table.dim() != 2 or page_table.shape[0] != b or page_table.dtype != torch.int32:
        raise ValueError(f"page_table: expected int32 [B={b}, max_pages], got {page_table.dtype} "
                         f"{tuple(page_table.shape)}")
    if page_table.device != q.device:
        raise ValueError(f"page_table: expected on {q.device} (as q), got {page_table.device}")
    if q.shape[-2] % k_pages.shape[2]:
        raise ValueError(f"q/k_cache: Hq={q.shape[-2]} must be a multiple of Hkv={k_pages.shape[2]}")


def _paged(q, k_pages, v_pages, k, v, cache_seqlens, softmax_scale, causal, window_size, num_splits,
           return_softmax_lse, page_table, family, check_inputs):
    """:func:`attention_with_kvcache` on a paged cache."""
    if q.dim() != 4 or k_pages.dim() != 4 or v_pages.dim() != 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise ValueError(f"q/k_cache/v_cache: expected [B, Nq, Hq, D] / pools [num_pages, page_size, Hkv, D], got "
                         f"{tuple(q.shape)} / {tuple(k_pages.shape)} / {tuple(v_pages.shape)}")
    b = q.shape[0]
    _check_table(q, k_pages, page_table, b, v_pages)
    ps, capacity = k_pages.shape[1], page_table.shape[1] * k_pages.shape[1]
    lengths = _lengths(capacity if cache_seqlens is None else cache_seqlens, b, q.device)
    if (k is None) != (v is None):
        raise ValueError("k/v: give both or neither")
    if k is not None and cache_seqlens is None:
        raise ValueError("k/v: appending needs cache_seqlens (where each sequence's new rows go)")
    new = 0 if k is None else k.shape[1]
    if ops.checking(check_inputs):
        _check_lengths(lengths, new, capacity)
        paged.check_page_table(page_table, lengths + new, k_pages.shape[0], ps)
    if k is not None:
        paged.append_paged(k_pages, v_pages, page_table, as_input("k", k), as_input("v", v), lengths)
        lengths = lengths + new
    family = family or default_family(q.shape[-1], v_pages.shape[-1])
    scale = checked_scale(softmax_scale, q.shape[-1])
    causal, left, right = mask_args(causal, window_size)
    with torch.no_grad():
        out, lse = paged.paged_forward(q, k_pages, v_pages, page_table, lengths, family, scale, causal, left, right,
                                       num_splits)
    return (out, lse) if return_softmax_lse else out


def _lengths(cache_seqlens, b: int, device) -> Tensor:
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((b,), cache_seqlens, dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, Tensor) or cache_seqlens.shape != (b,) or \
            cache_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cache_seqlens: expected an int or an int32/int64 tensor [B={b}], got "
                         f"{getattr(cache_seqlens, 'shape', type(cache_seqlens).__name__)}")
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens: expected on {device} (as q), got {cache_seqlens.device}")
    return cache_seqlens.to(torch.int32)


def _append(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> None:
    """Write k/v ``[B, Nn, ..]`` into the caches at rows ``lengths[b] + j`` (device indices, no sync)."""
    b, new = k.shape[0], k.shape[1]
    if k.shape[0] != k_cache.shape[0] or k.shape[2:] != k_cache.shape[2:] or v.shape[:2] != k.shape[:2] or \
            v.shape[2:] != v_cache.shape[2:]:
        raise ValueError(f"k/v: expected [B, Nn, Hkv, D] matching the caches {tuple(k_cache.shape)} / "
                         f"{tuple(v_cache.shape)}, got {tuple(k.shape)} / {tuple(v.shape)}")
    rows = lengths.to(torch.int64)[:, None] + torch.arange(new, device=k.device)
    batch = torch.arange(b, device=k.device)[:, None].expand(b, new)
    k_cache[batch, rows] = k.to(k_cache.dtype)
    v_cache[batch, rows] = v.to(v_cache.dtype)


def _check_lengths(cache_seqlens: Tensor, new: int, capacity: int) -> None:
    """Checked mode: every length in ``0 .. capacity - new`` (one host copy)."""
    for i, n in enumerate(cache_seqlens.tolist()):
        if not 0 <= n <= capacity - new:
            raise ValueError(f"cache_seqlens[{i}] = {n}: with {new} new rows it must lie in 0-{capacity - new} "
                             f"(the cache holds {capacity} rows)")


def lengths_forward(q, k_cache, v_cache, lengths, family: str, scale: float, causal: bool, left, right,
                    num_splits: int = 0):
    """``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq])`` of q on each sequence's first ``lengths[b]`` cache rows (int32
    ``[B]`` on the device), on the route :func:`xattn.core.routes.forward_route` picks; window sides None =
    unbounded. The body of :func:`attention_with_kvcache` and of the ``xattn::fwd_lengths`` op (no gradient)."""
    b, nq, hq, _ = q.shape
    nc, hkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[-1]
    rows = split_kv.rows_per_seq(k_cache, v_cache)
    if rows is None:
        raise ValueError("k_cache/v_cache: their strides put the sequences on no common row stride "
                         "(k_cache.stride(0) must be a multiple of k_cache.stride(1), the same for v_cache)")
    request = routes.requested_forward()
    key = (family, b, hkv, hq, nq, nc, causal, left, right, num_splits, request, q.device)
    route = _ROUTES.get(key)  # a decode loop asks every step: the sizes alone decide
    if route is None:
        problem = routes.FwdProblem(family, b, hkv, hq // hkv, nq, nc, causal=causal,
                                    local=left is not None or right is not None, flat_kv=True,
                                    num_sms=split_kv.num_sms(q.device), num_splits=num_splits, traced=True)
        route = _ROUTES.put(key, routes.forward_route(problem, request))
    out = torch.empty((b, nq, hq, dv), dtype=q.dtype, device=q.device)
    if route.name == "split-kv":
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
        split_kv.split_forward(route.plan, family, q, k_cache, v_cache, scale, rows, out, lse, lengths)
        return out, lse
    key_rows = rows * (b - 1) + nc
    kf, vf = split_kv.flat_keys(k_cache, key_rows), split_kv.flat_keys(v_cache, key_rows)
    base = torch.arange(b, device=q.device, dtype=torch.int64) * rows
    ends = torch.stack([base + lengths, (base + rows).clamp(max=key_rows)], dim=1).flatten()
    cu_k = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)  # sequence b's keys, then the rows up to b + 1
    cu_q = _CU_Q.get((b, nq, q.device))
    if cu_q is None:
        cu_q = _CU_Q.put((b, nq, q.device), split_kv.outside_graph_pools(  # kept past the call: not a graph's pool
            lambda: (torch.arange(1, 2 * b + 2, device=q.device) // 2 * nq).to(torch.int32), q.device))
    out_rows = out.view(b * nq, hq, dv)
    lse_rows = torch.full((hq, b * nq), float("-inf"), dtype=torch.float32, device=q.device)
    out_rows.zero_()  # FFPA skips a sequence without keys: its rows read as "no key"
    q_rows = q.reshape(b * nq, hq, q.shape[-1])
    checked = ops._checked("fwd", family, q_rows, kf, vf, causal, -1 if left is None else left,
                           -1 if right is None else right, cu_q, cu_k, nq, key_rows)
    ops.LAUNCH["fwd"](checked, q_rows, kf, vf, out_rows, lse_rows, softmax_scale=scale, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k, max_seqlen_q=nq, max_seqlen_k=key_rows)
    return out, lse_rows.view(hq, b, nq).permute(1, 0, 2).contiguous()
