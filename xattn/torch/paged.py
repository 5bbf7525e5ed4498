"""Decoding against a paged KV cache on torch tensors (issue #44); plans and rules: :mod:`xattn.core.paged`.

Pools ``k_pages/v_pages [NP, PS, Hkv, D/Dv]``, ``page_table [B, P]`` int32, ``lengths [B]`` int32 on the device
(never read on the host). One call is one or two paged launches and FlashAttention's combine:

* the **splits**: a virtual batch of ``S * B`` entries, slot-major (entry ``s * B + b``: sequence b's split s),
  so the partials are ``[S, B, ...]`` as the combine reads them; ``kv_meta [S * B, 1 + pps]`` holds each
  entry's keys and its page-table columns, written with the tail's and the partials' lse pre-fill by one index
  kernel (:mod:`xattn.core.paged_meta_sm90`: no sync, CUDA-graph safe, one launch instead of 4-14 small ones);
* the **causal tail** (Nq > 1): one causal entry per sequence from the page holding key ``L - Nq``, on a second
  stream beside the splits (as the contiguous route's);
* on route ``fused`` (:func:`xattn.core.routes.forward_route`: a window, a short table, ``num_splits=1``): a single
  launch over each sequence's whole table (no combine).

Packed queries (``cu_seqlens_q``, vLLM's varlen call) with at most 16 per sequence run the same way, as the dense
problem of ``max_seqlen_q`` queries (the index kernel gathers them in and the rows back out); others one launch.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from xattn.core import paged, routes
from xattn.core.checks import Memo
from xattn.core.split_kv import CombineSpec, combine_chunk, split_launch_spec

from . import ops, split_kv as split_kv_torch
from .split_kv import num_sms

__all__ = ["paged_forward", "paged_varlen_forward", "append_paged", "check_page_table"]


def paged_forward(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, lengths: Tensor, family: str,
                  scale: float, causal: bool, left, right, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] fp32)`` of q ``[B, Nq, Hq, D]`` on each sequence's first
    ``lengths[b]`` keys of the paged cache; window sides None = unbounded; ``num_splits`` as FlashAttention's
    (0 auto, 1 one launch, n > 1 at most n splits)."""
    b, nq, hq, d = q.shape
    ps, hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[-1]
    max_pages = page_table.shape[1]
    local = left is not None or right is not None
    rows = _split_rows(family, d, dv, k_pages, v_pages)  # the split launches' pages: rows of a pool page's tiles
    problem = routes.FwdProblem(family, b, hkv, hq // hkv, nq, max_pages * ps, causal=causal, local=local,
                                num_sms=num_sms(q.device), num_splits=num_splits,
                                split_refused=_split_refusal(family, q.dtype, q.shape[-1], dv, hq // hkv, rows))
    request = routes.requested_forward()
    route = _ROUTES.get((problem, request))
    if route is None:
        route = _ROUTES.put((problem, request), routes.forward_route(problem, request))
    kp, vp = _pools(family, k_pages, v_pages)
    table = page_table.to(torch.int32)
    if route.name != "split-kv":  # one entry per sequence, its whole table: the kernel masks as asked
        meta = torch.cat([lengths.to(torch.int32)[:, None], table], dim=1)
        return _launch(family, q, kp, vp, meta, ps, causal, left, right, scale)
    return _split(family, q, None, nq, k_pages, v_pages, table, lengths, rows, route.plan.splits, causal, scale)


def _split(family: str, q: Tensor, cu_seqlens_q: Tensor | None, nq: int, k_pages: Tensor, v_pages: Tensor,
           table: Tensor, lengths: Tensor, rows: int, splits: int, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """The split route over the pages: dense q ``[B, Nq, Hq, D]`` -> ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq])``, or
    packed q ``[Tq, Hq, D]`` with ``cu_seqlens_q`` (at most Nq queries per sequence) -> ``(out [Tq, Hq, Dv], lse
    [Hq, Tq])``, run as the dense problem. ``rows``: the split launches' page size (:func:`_split_rows`)."""
    hq, d = q.shape[-2], q.shape[-1]
    b, max_pages = table.shape
    ps, hkv, dv = k_pages.shape[1], k_pages.shape[2], v_pages.shape[-1]
    dev, packed = q.device, cu_seqlens_q is not None
    kp, vp = _pools(family, k_pages, v_pages)
    r = ps // rows
    if r > 1:  # FA4: each pool page read as r pages of its key tile (TMA); the index kernel maps the table
        kp, vp = kp.view(-1, rows, hkv, d), vp.view(-1, rows, hkv, dv)
    plan = paged.plan_paged(splits, causal, nq, max_pages * r)
    pps, s, slots = plan.pages_per_split, plan.splits, plan.partials
    meta = torch.empty((s * b, 1 + pps), dtype=torch.int32, device=dev)
    tail_meta = torch.empty((b, 1 + paged.tail_pages(rows, nq)), dtype=torch.int32, device=dev) if plan.tail else meta
    bhn, rows_d = b * hq * nq, b * nq
    # lse: the partials, then (packed) the combined [Hq, B Nq + 1] with a sentinel column; all -inf first. out:
    # (packed) the combined [B Nq + 1, Hq, Dv] with a zero sentinel row. Packed rows outside every sequence read the
    # sentinels: out 0, lse -inf
    lse_all = torch.empty(slots * bhn + (hq * (rows_d + 1) if packed else 0), dtype=torch.float32, device=dev)
    out_p = torch.empty((slots, b, nq, hq, dv), dtype=q.dtype, device=dev)
    lse_p = lse_all[:slots * bhn].view(slots, b, hq, nq)
    gathers = None
    if packed:
        out_all = torch.empty((rows_d + 1, hq, dv), dtype=q.dtype, device=dev)
        lse_rows = lse_all[slots * bhn:].view(hq, rows_d + 1)
        gathers = (cu_seqlens_q.to(torch.int32), torch.empty(rows_d, dtype=torch.int32, device=dev),
                   torch.empty(q.shape[0], dtype=torch.int32, device=dev), out_all[rows_d].view(-1).view(torch.int32))
    # one kernel: every entry's keys and table columns, the tail's, the packed gathers, and lse -inf in every partial
    # row (FFPA skips an entry without keys; the combine skips a row of lse -inf, so no out needs a fill)
    ops.LAUNCH["paged_meta"](_meta_spec(family, plan.tail, packed), lengths.to(torch.int32), table, meta, tail_meta,
                             lse_all, gathers, page_size=rows, seqlen_q=nq, tiles_per_page=r)
    if packed:
        q = q.index_select(0, gathers[1]).view(b, nq, hq, d)
    q_entries = q.unsqueeze(0).expand(s, b, nq, hq, d).reshape(s * b, nq, hq, d)  # a view at B = 1
    side = split_kv_torch.Side(dev) if plan.tail else None
    if side:  # the causal tail beside the splits (its few CTAs take SMs the splits leave idle), as the dense route
        with side.fork():
            _launch(family, q, kp, vp, tail_meta, rows, True, None, None, scale, out_p[s], lse_p[s], partial=True)
    _launch(family, q_entries, kp, vp, meta, rows, False, None, None, scale, out_p[:s].view(s * b, nq, hq, dv),
            lse_p[:s].view(s * b, hq, nq), partial=True, split=True)
    if side:
        side.join()
    if packed:  # the combine writes lse [B, Nq, Hq] as a view of [Hq, B Nq]: the packed rows are one gather each
        out, lse_view = out_all[:rows_d].view(b, nq, hq, dv), lse_rows[:, :rows_d].view(hq, b, nq).permute(1, 2, 0)
    else:
        out = torch.empty((b, nq, hq, dv), dtype=q.dtype, device=dev)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=dev)
        lse_view = lse.permute(0, 2, 1)
    ops.LAUNCH["combine"](_combine_spec(family, str(q.dtype).removeprefix("torch."), dv, combine_chunk(slots)), out_p,
                          lse_p.permute(0, 1, 3, 2), out, lse_view)
    if packed:
        return out_all.index_select(0, gathers[2]), lse_rows.index_select(1, gathers[2])
    return out, lse


def _split_rows(family: str, d: int, dv: int, k_pages: Tensor, v_pages: Tensor) -> int:
    """Rows per page of the split launches (:func:`xattn.core.paged.tma_page_rows`); a pool whose pages are not
    each one block of memory keeps its own page size (its view as smaller pages would be a copy)."""
    ps = k_pages.shape[1]
    rows = paged.tma_page_rows(family, d, dv, ps)
    if rows != ps and any(t.stride(0) != ps * t.stride(1) for t in (k_pages, v_pages)):
        return ps
    return rows


_REFUSALS = Memo(256)  # (paged_spec, sizes) -> str: a refusal is worked out once, not raised on every step


def _split_refusal(family: str, dtype: torch.dtype, d: int, dv: int, g: int, ps: int) -> str:
    """Why the split route's launches (no mask: the keys before the causal tail) have no paged kernel here, or ""."""
    key = (ops.paged_spec, family, dtype, d, dv, g, ps)
    hit = _REFUSALS.get(key)
    if hit is None:
        try:
            ops.paged_spec(family, str(dtype).removeprefix("torch."), d, dv, g, False, None, None, ps)
            hit = ""
        except NotImplementedError as exc:
            hit = str(exc)
        _REFUSALS.put(key, hit)
    return hit


def paged_varlen_forward(q: Tensor, k_pages: Tensor, v_pages: Tensor, cu_seqlens_q: Tensor, page_table: Tensor,
                         lengths: Tensor, family: str, scale: float, causal: bool, left, right,
                         max_seqlen_q: int | None = None, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32)`` of packed queries q ``[Tq, Hq, D]`` (sequence b: rows
    ``cu_seqlens_q[b]..[b + 1]``) on each sequence's first ``lengths[b]`` paged keys, masks bottom-right aligned on
    them; rows past ``cu_seqlens_q[-1]`` read out 0, lse -inf. With ``max_seqlen_q`` (a bound on every sequence's
    queries) the forward route decides (:func:`xattn.core.routes.forward_route`): decoding batches (at most 16
    queries per sequence: vLLM's decode step) take ``split-kv``, as the dense problem of ``max_seqlen_q`` queries
    (:func:`paged_forward`); prefill and mixed batches one launch over the pages."""
    hq, dv = q.shape[1], v_pages.shape[-1]
    hkv, ps, b = k_pages.shape[2], k_pages.shape[1], page_table.shape[0]
    if max_seqlen_q is not None and q.shape[0] and b:
        rows = _split_rows(family, q.shape[-1], dv, k_pages, v_pages)
        problem = routes.FwdProblem(family, b, hkv, hq // hkv, max_seqlen_q, page_table.shape[1] * ps, causal=causal,
                                    local=left is not None or right is not None, varlen=True,
                                    num_sms=num_sms(q.device), num_splits=num_splits,
                                    split_refused=_split_refusal(family, q.dtype, q.shape[-1], dv, hq // hkv, rows))
        request = routes.requested_forward()
        route = _ROUTES.get((problem, request))
        if route is None:
            route = _ROUTES.put((problem, request), routes.forward_route(problem, request))
        if route.name == "split-kv":
            return _split(family, q, cu_seqlens_q, max_seqlen_q, k_pages, v_pages, page_table.to(torch.int32),
                          lengths, rows, route.plan.splits, causal, scale)
    kp, vp = _pools(family, k_pages, v_pages)
    meta = torch.cat([lengths.to(torch.int32)[:, None], page_table.to(torch.int32)], dim=1)
    spec = ops.paged_spec(family, str(q.dtype).removeprefix("torch."), q.shape[-1], dv, hq // kp.shape[-2], causal,
                          left, right, k_pages.shape[1], varlen=True)
    out = torch.zeros((q.shape[0], hq, dv), dtype=q.dtype, device=q.device)  # the varlen kernels' pre-fill
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    ops.LAUNCH["paged"](spec, q, kp, vp, meta, out, lse, softmax_scale=scale, cu_seqlens_q=cu_seqlens_q)
    return out, lse


_ROUTES = Memo(256)  # (FwdProblem, request) -> Route: a decode loop asks once per shape
_combine_spec = functools.lru_cache(maxsize=64)(CombineSpec)  # built once per (family, dtype, Dv, chunk), not per step
_meta_spec = functools.lru_cache(maxsize=8)(paged.PagedMetaSpec)


def _pools(family: str, k_pages: Tensor, v_pages: Tensor) -> tuple[Tensor, Tensor]:
    """The pools as the family's launcher reads them: FA4 its own ``[NP, PS, H, D]``, FFPA the flat
    ``[NP*PS, H, D]`` view (a view only where each page follows the previous one in memory)."""
    if family != "ffpa":
        return k_pages, v_pages
    out = []
    for name, t in (("k_cache", k_pages), ("v_cache", v_pages)):
        if t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(f"{name}: FFPA reads the pool as one flat [pages * page_size, Hkv, D] view, so a page "
                             f"must follow the previous one in memory (stride(0) == page_size * stride(1)); got "
                             f"strides {tuple(t.stride())}")
        out.append(t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3]))
    return out[0], out[1]


def _launch(family, q, kp, vp, meta, ps, causal, left, right, scale, out=None, lse=None, partial=False, split=False):
    """One paged launch over ``meta``'s entries; returns (out, lse) (allocated when not given). ``partial``: out and
    lse are split partials whose lse the caller pre-filled with -inf (the combine skips such a row: FFPA's skipped
    entries need no out fill). ``split``: the split launch, on the decode tile where the core has one
    (:func:`xattn.core.split_kv.split_launch_spec`)."""
    b, nq, hq, _ = q.shape
    dv = vp.shape[-1]
    spec = ops.paged_spec(family, str(q.dtype).removeprefix("torch."), q.shape[-1], dv, hq // kp.shape[-2], causal,
                          left, right, ps)
    if split:
        spec = split_launch_spec(spec)
    if out is None:
        out = torch.empty((b, nq, hq, dv), dtype=q.dtype, device=q.device)
        lse = torch.empty((b, hq, nq), dtype=torch.float32, device=q.device)
    if spec.output_fill() and not partial:  # FFPA skips an entry without keys: it must read (0, -inf)
        out.zero_()
        lse.fill_(float("-inf"))
    ops.LAUNCH["paged"](spec, q, kp, vp, meta, out, lse, softmax_scale=scale)
    return out, lse


def append_paged(k_pages: Tensor, v_pages: Tensor, page_table: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> None:
    """Write k/v ``[B, Nn, Hkv, D]`` into the pools at sequence positions ``lengths[b] + j`` through the page
    table (device indices, no sync)."""
    b, new = k.shape[0], k.shape[1]
    ps = k_pages.shape[1]
    if k.shape[2:] != k_pages.shape[2:] or v.shape[:2] != k.shape[:2] or v.shape[2:] != v_pages.shape[2:] or \
            b != page_table.shape[0]:
        raise ValueError(f"k/v: expected [B={page_table.shape[0]}, Nn, Hkv, D] matching the pools "
                         f"{tuple(k_pages.shape)} / {tuple(v_pages.shape)}, got {tuple(k.shape)} / {tuple(v.shape)}")
    pos = lengths.to(torch.int64)[:, None] + torch.arange(new, device=k.device)
    pages = page_table.to(torch.int64).gather(1, (pos // ps).clamp(max=page_table.shape[1] - 1))
    k_pages[pages, pos % ps] = k.to(k_pages.dtype)
    v_pages[pages, pos % ps] = v.to(v_pages.dtype)


def check_page_table(page_table: Tensor, lengths: Tensor, num_pages: int, page_size: int) -> None:
    """Checked mode: the rules of :func:`xattn.core.paged.page_table_problem` (one host copy each)."""
    why = paged.page_table_problem(page_table.tolist(), lengths.tolist(), num_pages, page_size)
    if why:
        raise paged.PageTableError(why)
