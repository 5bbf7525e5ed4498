"""The ``split-kv`` forward route on torch tensors: the family's varlen forward over key splits, then
FlashAttention's combine kernel. How and why: :mod:`xattn.core.split_kv` (glossary there); when:
:func:`xattn.core.routes.forward_route`.

Buffers of one call: ``q_split [B*P*Nq, Hq, D]`` (q once per slot; FA4's decode tile reads q's own ``[B*Nq]`` rows
instead, :func:`xattn.core.split_kv.shared_queries`), ``out_partial [B*P*Nq, Hq, Dv]`` (0) and
``lse_partial [Hq, B*P*Nq]`` (-inf); with a causal tail also ``[B*Nq, Hq, Dv]`` / ``[Hq, B*Nq]`` for the tail
launch. The keys are read in place through a flat strided view of k and v (no copy of the cache).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from xattn.core import split_kv
from xattn.core.checks import Memo
from xattn.core.split_kv import CombineSpec, SlotCallSpec, SplitMetaSpec, SplitPlan

from . import ops

__all__ = ["rows_per_seq", "flat_keys", "split_forward", "packed_split_forward", "slot_call", "SlotCall", "num_sms",
           "device_cu_seqlens_q", "device_cu_seqlens_k", "outside_graph_pools", "ramp"]

_SETUPS = Memo(256)  # (plan, family, shapes, dtype, rows, device) -> _Setup (host lists become device tensors once)
_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    """The SM count of ``device`` (132, an H200's, off CUDA: the CPU stand-ins decide as the H200 would)."""
    if device.type != "cuda":
        return 132
    n = _SMS.get(device.index)
    if n is None:
        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def rows_per_seq(k: Tensor, v: Tensor) -> int | None:
    """``R``: rows of the flat key view between two sequences' first keys (k and v ``[B, Nk, Hkv, D]``, any
    strides with a unit last one), or ``None`` when their strides put the sequences on no common row stride."""
    b, nk = k.shape[0], k.shape[1]
    if b <= 1:
        return nk
    rows = []
    for t in (k, v):
        s_b, s_n = t.stride(0), t.stride(1)
        if s_n <= 0 or s_b % s_n or s_b // s_n < nk:
            return None
        rows.append(s_b // s_n)
    return rows[0] if rows[0] == rows[1] else None


def flat_keys(t: Tensor, key_rows: int) -> Tensor:
    """``[R (B-1) + Nk, H, D]``: every sequence's keys on one row stride, a view of ``t`` (module docstring)."""
    if t.shape[0] == 1:  # one sequence: its own rows (the cheaper view; a decode step's usual case)
        return t[0]
    return t.as_strided((key_rows, t.shape[2], t.shape[3]), (t.stride(1), t.stride(2), t.stride(3)),
                        t.storage_offset())


_SIDES = threading.local()  # per thread: device index -> (side stream, fork event, join event)


class Side:
    """A second CUDA stream of ``device`` for work beside the current one (no-op off CUDA): ``fork()`` runs
    its block there after the work enqueued so far, ``after_main()`` also after what the current stream
    enqueued since, ``join()`` makes the current stream wait for it. Captures into CUDA graphs as a branch.

    A decode step pays a few C++ calls here (torch.accelerator's stream calls, two events recorded and waited
    on), not torch.cuda's Python stream wrappers, which made the eager causal tail cost more host time than the
    launches. The stream and the events are made once per thread and device and reused: a wait orders against
    the record enqueued before it, so recording an event again later is safe; per thread, so another thread's
    record cannot land between one of this thread's records and its wait."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            index = torch.cuda.current_device() if device.index is None else device.index
            sides = getattr(_SIDES, "by_device", None)
            if sides is None:
                sides = _SIDES.by_device = {}
            state = sides.get(index)
            if state is None:
                where = torch.device("cuda", index)
                state = sides[index] = (torch.cuda.Stream(where), torch.Event(where), torch.Event(where))
            self.stream, self._forked, self._joined = state
            self.main = torch.accelerator.current_stream(index)

    def __bool__(self) -> bool:
        return True

    def fork(self):
        return self.after_main()

    @contextlib.contextmanager
    def after_main(self):
        if not self.cuda:
            yield
            return
        self._forked.record(self.main)
        self._forked.wait(self.stream)
        device = torch.accelerator.current_device_index()  # set_stream also makes the stream's device current
        torch.accelerator.set_stream(self.stream)
        try:
            yield
        finally:
            torch.accelerator.set_stream(self.main)
            if device != self.stream.device_index:
                torch.accelerator.set_device_index(device)

    def join(self) -> None:
        if self.cuda:
            self._joined.record(self.stream)
            self._joined.wait(self.main)


class _Setup(NamedTuple):
    """What one call signature derives once: the launches' cu_seqlens on the device, their validated
    ``(spec, problem)`` and the combine's compile key."""

    cu_q: Tensor
    cu_k: Tensor
    max_k: int
    checked: tuple
    tail_q: Tensor | None
    tail_k: Tensor | None
    tail_max_k: int
    tail_checked: tuple | None
    combine: CombineSpec
    bounds: Tensor | None = None  # the slot call's ``[chunk, S - 1]`` int32 with a causal tail in the last slot


def _setup(plan: SplitPlan, family: str, q_split: Tensor, q: Tensor, kf: Tensor, vf: Tensor, rows: int, nk: int,
           tail_launch: bool = True):
    """The launches' set-up of one call signature (:class:`_Setup`); ``tail_launch`` False: a causal tail runs without
    the varlen tail launch (the batched slot call's dense tail), so none of its index arrays or validation."""
    key = (plan, family, q.shape, kf.shape, vf.shape, q.dtype, rows, nk, q.device, tail_launch)
    hit = _SETUPS.get(key)
    if hit is not None:
        return hit
    b, nq = q.shape[0], q.shape[1]
    key_rows, dev = kf.shape[0], q.device
    # the split launch's own plan and lengths: with the tail in place, its splits alone, on the keys before it
    lp, ln = (split_kv.splits_only(plan), nk - nq) if plan.tail_in_place(b) else (plan, nk)
    cu_q, cu_k, _, _ = split_kv.split_cu_seqlens(lp, nq, rows, [ln] * b, key_rows)  # host lists (and the maxima)
    tail_q = tail_k = []
    tail = plan.tail and tail_launch
    tp = plan if tail else split_kv.splits_only(plan)  # (no tail: no tail index arrays under capture either)
    if tail:
        _, _, tail_q, tail_k = split_kv.split_cu_seqlens(plan, nq, rows, [nk] * b, key_rows)
    longest = lambda cu: max((y - x for x, y in zip(cu, cu[1:])), default=0)  # noqa: E731
    full = lambda n: torch.full((b,), n, dtype=torch.int32, device=dev)  # noqa: E731
    if _capturing(dev):  # (a new cache length under torch.compile's CUDA graphs): by device arithmetic
        cu_q_d, tail_q_d, cu_k_d, tail_k_d = outside_graph_pools(lambda: (
            device_cu_seqlens_q(lp, b, nq, dev)[0], device_cu_seqlens_q(tp, b, nq, dev)[1],
            device_cu_seqlens_k(lp, nq, rows, key_rows, full(ln))[0],
            device_cu_seqlens_k(tp, nq, rows, key_rows, full(nk))[1]), dev)
    else:  # a cache that grows by a key per step (HF's DynamicCache) sets up every step: one copy, not ~30 kernels
        cu_q_d, tail_q_d, cu_k_d, tail_k_d = int32_lists(dev, cu_q, tail_q, cu_k, tail_k)
    shared = split_kv.shared_queries(family, q.shape[-1], vf.shape[-1], q.shape[-2] // kf.shape[-2])
    if shared:  # q_split is q's own B*Nq rows: validated as the slot-copied call (a zero-stride stand-in, no copy)
        q_split = q_split.as_strided((cu_q[-1], *q_split.shape[1:]), (0, *q_split.stride()[1:]))
    checked = split_kv.split_launch(  # the decode tile where the core has one (split_kv.SPLIT_TILES)
        ops._checked("fwd", family, q_split, kf, vf, False, -1, -1, cu_q_d, cu_k_d, nq, longest(cu_k)), shared)
    tail_checked = None
    if tail:
        tail_checked = ops._checked("fwd", family, q.reshape(b * nq, *q.shape[2:]), kf, vf, True, -1, -1, tail_q_d,
                                    tail_k_d, nq, longest(tail_k))
    combine = CombineSpec(family, str(q.dtype).removeprefix("torch."), vf.shape[-1],
                          split_kv.combine_chunk(plan.partials))
    return _SETUPS.put(key, _Setup(cu_q_d, cu_k_d, longest(cu_k), checked, tail_q_d, tail_k_d, longest(tail_k),
                                   tail_checked, combine))


def _capturing(device: torch.device) -> bool:
    """Inside CUDA-graph capture on ``device``'s stream: no host-to-device copy there (a captured copy would replay
    from a host buffer nothing keeps)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def int32_lists(device: torch.device, *lists: list) -> list[Tensor]:
    """Host int lists as int32 tensors on ``device``: one tensor, one asynchronous host-to-device copy from pinned
    memory (no wait for the GPU; not inside CUDA-graph capture), built outside any graph's pool
    (:func:`outside_graph_pools`); returns views of it, one per list (``None`` for an empty list), each starting
    16 bytes into the last (as a fresh tensor would be aligned)."""
    flat, starts = [], []
    for xs in lists:
        starts.append(len(flat))
        flat += list(xs) + [0] * (-len(xs) % 4)
    host = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":  # pinned: from pageable memory the driver's staging copy holds the host ~0.2 ms
        host = host.pin_memory()
    whole = outside_graph_pools(lambda: host.to(device, non_blocking=True), device)
    return [whole[at:at + len(xs)] if xs else None for at, xs in zip(starts, lists)]


def outside_graph_pools(build, device: torch.device):
    """``build()`` for tensors the memo keeps past this call. torch.compile's CUDA-graph trees send every
    allocation of the thread that warms up or records a graph to the graph's pool and refuse a pool tensor
    that outlives the graph's outputs ("tensors in the cudagraph pool not tracked as outputs"); so while a graph
    tree of this thread may be warming up (:func:`_graph_tree_pool`), a CUDA ``build`` runs in a worker thread
    (the normal pool) on the caller's current stream (ordered with its work). Inside a raw stream capture
    (``torch.cuda.graph``) it runs here: the capture's pool holds them; and here where no graph tree is at work (an
    eager decode step that sets up a new cache length, HF's DynamicCache: no thread hop, ~0.1 ms of host)."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing() or getattr(_WORKER_STATE, "inside", False) \
            or not _graph_tree_pool(device):
        return build()
    stream = torch.cuda.current_stream(device)

    def run():
        _WORKER_STATE.inside = True  # a build that asks again runs here (one worker: a nested submit would wait)
        try:
            with torch.cuda.stream(stream):
                return build()
        finally:
            _WORKER_STATE.inside = False

    return _worker().submit(run).result()


def _graph_tree_pool(device: torch.device) -> bool:
    """Whether torch.compile's CUDA-graph trees may be sending this thread's allocations on ``device`` to a graph's
    pool: their tree manager of this thread warming up or recording (its state stays so until its next step, so
    this errs towards yes). No: the trees were never imported, or this thread has no manager on ``device``. Yes
    where their internals do not answer (a torch that changed them): the worker thread is the safe way."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        if not torch._C._is_key_in_tls("tree_manager_containers") and not hasattr(trees.local,
                                                                                  "tree_manager_containers"):
            return False  # no tree manager was ever made on this thread
        containers = trees.get_obj(trees.local, "tree_manager_containers")
        index = torch.cuda.current_device() if device.index is None else device.index
        container = containers.get(index)
        manager = None if container is None else container.tree_manager
        return manager is not None and (manager.in_warmup or manager.in_recording)
    except Exception:  # noqa: BLE001 - torch's private internals moved: assume a pool may be at work
        return True


_WORKER_STATE = threading.local()
_WORKER_LOCK = threading.Lock()
_WORKERS: list = []  # the one worker thread of outside_graph_pools, started once (not one thread per build)


def _worker() -> concurrent.futures.ThreadPoolExecutor:
    with _WORKER_LOCK:
        if not _WORKERS:
            _WORKERS.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="xattn-outside-graph-pools"))
        return _WORKERS[0]


def _forked() -> None:
    """In a forked child: no worker thread (and no lock another thread held): it starts its own."""
    global _WORKER_LOCK
    _WORKER_LOCK = threading.Lock()
    _WORKERS.clear()


os.register_at_fork(after_in_child=_forked)


def device_cu_seqlens_q(plan: SplitPlan, batch: int, seqlen_q: int, device):
    """``(cu_q, tail_cu_q)`` int32 on ``device``, as :func:`xattn.core.split_kv.split_cu_seqlens` (``P`` slots of
    Nq queries then a gap per sequence; the tail launch: a gap then Nq queries)."""
    p = plan.partials
    j = torch.arange(batch * (p + 1) + 1, device=device)
    cu_q = ((j - j // (p + 1)) * seqlen_q).to(torch.int32)
    if not plan.tail:
        return cu_q, None
    return cu_q, (torch.arange(2 * batch + 1, device=device) // 2 * seqlen_q).to(torch.int32)


def device_cu_seqlens_k(plan: SplitPlan, seqlen_q: int, rows: int, key_rows: int, lengths: Tensor,
                        starts: Tensor | None = None):
    """``(cu_k, tail_cu_k)`` int32 on ``lengths``' device for per-sequence valid keys ``lengths [B]`` (device
    values, never read on the host) starting every ``rows`` rows or at ``starts [B]`` (packed keys): the same
    documents as :func:`xattn.core.split_kv.split_cu_seqlens`, each sequence's chunk ``plan.chunk`` or, for a
    plan without one, its own (``tail_cu_k`` None without a tail)."""
    n = lengths.to(torch.int32)  # int32 arithmetic throughout (cu_seqlens are int32): no widening copies
    dev = n.device
    base = ramp(0, n.shape[0], dev, rows) if starts is None else starts.to(torch.int32)
    full = n - n.clamp(max=seqlen_q) if plan.tail else n
    per = plan.splits * split_kv.KEY_TILE
    if plan.chunk:
        bounds = torch.minimum(ramp(0, plan.splits, dev, plan.chunk)[None], full[:, None])
    else:
        chunk = (full + per - 1).floor_divide_(per).clamp_(min=1).mul_(split_kv.KEY_TILE)
        bounds = torch.minimum(ramp(0, plan.splits, dev)[None] * chunk[:, None], full[:, None])
    edge = (base + full)[:, None]
    starts = torch.cat([bounds.add_(base[:, None])] + [edge] * (2 if plan.tail else 1), dim=1)  # [B, P + 1]
    cu_k = torch.cat([starts.flatten(), ramp(key_rows, 1, dev)])
    if not plan.tail:
        return cu_k, None
    return cu_k, torch.cat([ramp(0, 1, dev), torch.stack([base + full, base + n], dim=1).flatten()])


def _split_queries(q: Tensor, family: str, kf: Tensor, dv: int, p: int) -> Tensor:
    """The split launch's q: ``[B*Nq, Hq, D]`` as it is where the launch reads each sequence's rows for all its slots
    (:func:`xattn.core.split_kv.shared_queries`), else q once per slot (:func:`_slots`)."""
    if split_kv.shared_queries(family, q.shape[-1], dv, q.shape[-2] // kf.shape[-2]):
        return q.reshape(q.shape[0] * q.shape[1], *q.shape[2:])
    return _slots(q, p)


def _slots(q: Tensor, p: int) -> Tensor:
    """``q_split [B*P*Nq, Hq, D]``: q once per slot; a view where strides allow (B = Nq = 1: row stride 0),
    else one broadcast copy, moved as 8-byte words where q's rows allow (the generic broadcast copy moves
    2-byte elements at a fraction of the bandwidth)."""
    b, nq, hq, d = q.shape
    if p == 1:
        return q.reshape(b * nq, hq, d)
    if b * nq == 1:  # the one case of a view: row stride 0 (decided here: a failed view raises, ~25 us per call)
        return q.as_strided((p, hq, d), (0, q.stride(2), q.stride(3)), q.storage_offset())
    flat = q.reshape(b, 1, nq * hq * d)
    if flat.is_contiguous() and (flat.shape[-1] * q.element_size()) % 8 == 0 and flat.data_ptr() % 8 == 0:
        words = flat.view(torch.int64)
        out = torch.empty((b, p, words.shape[-1]), dtype=torch.int64, device=q.device)
        out.copy_(words.expand(b, p, words.shape[-1]))
        return out.view(q.dtype).view(b * p * nq, hq, d)
    return q.unsqueeze(1).expand(b, p, nq, hq, d).reshape(b * p * nq, hq, d)


def split_forward(plan: SplitPlan, family: str, q: Tensor, k: Tensor, v: Tensor, scale: float, rows: int,
                  out: Tensor, lse: Tensor, lengths: Tensor | None = None) -> None:
    """Write ``out [B, Nq, Hq, Dv]`` and ``lse [B, Hq, Nq]`` (any content before) by the split route: q
    ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]`` whose sequences start every ``rows`` flat rows
    (:func:`rows_per_seq`). Sequence b holds its first ``lengths[b]`` keys (int32 ``[B]`` on the device, read
    only there), or all Nk (``lengths`` None)."""
    if lengths is None:
        call = slot_call(plan, family, q, k, v)
        if call is not None:  # checked before the flat key views: the slot launch reads k and v as they are
            call.run(q, k, v, scale, out, lse)
            return
    key_rows = rows * (q.shape[0] - 1) + k.shape[1]
    kf, vf = flat_keys(k, key_rows), flat_keys(v, key_rows)
    if lengths is None:
        _split(plan, family, q, kf, vf, k.shape[1], rows, scale, out, lse)
    else:
        _split_device(plan, family, q, kf, vf, k.shape[1], rows, scale, out, lse, lengths.to(torch.int32))


def packed_split_forward(plan: SplitPlan, family: str, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, max_seqlen_q: int, scale: float, out: Tensor, lse: Tensor) -> None:
    """Write ``out [Tq, Hq, Dv]`` and ``lse [Hq, Tq]`` (any content before) by the split route for packed queries
    q ``[Tq, Hq, D]`` (document b: rows ``cu_seqlens_q[b]..[b + 1]``, at most ``max_seqlen_q`` of them) on packed
    keys k/v ``[Tk, Hkv, D/Dv]`` (``cu_seqlens_k``): as the dense problem of Nq = ``max_seqlen_q`` queries per
    document (:mod:`xattn.core.split_kv`, "Packed queries"); every index is computed on the device (no sync)."""
    _split_device(plan, family, q, k, v, 0, -1, scale, out, lse, cu_seqlens_k.to(torch.int32),
                  (cu_seqlens_q.to(torch.int32), max_seqlen_q))


_RAMPS = Memo(256)  # (first, capacity, step, device) -> the ramp (built once, not per call)


def ramp(first: int, count: int, device: torch.device, step: int = 1) -> Tensor:
    """int32 ``[count]`` on ``device``: first, first + step, ...; a read-only view of a shared ramp whose length is
    ``count`` rounded up to a power of two (a serving loop's varying token counts reuse a few), built outside any
    CUDA graph's pool (:func:`outside_graph_pools`), so decode steps launch no ``arange``."""
    capacity = 1 << max(count - 1, 0).bit_length()
    key = (first, capacity, step, device)
    hit = _RAMPS.get(key)
    if hit is None:
        hit = _RAMPS.put(key, outside_graph_pools(
            lambda: torch.arange(capacity, device=device, dtype=torch.int32) * step + first, device))
    return hit[:count]


def _split(plan: SplitPlan, family: str, q: Tensor, kf: Tensor, vf: Tensor, nk: int, rows: int, scale: float,
           out: Tensor, lse: Tensor) -> None:
    """:func:`split_forward` without lengths on the flat key views ``kf/vf [key_rows, Hkv, D]`` (where the slot launch
    does not run): sequence b's Nk keys start at row ``b * rows``; every index is the shape's, set up once
    (:func:`_setup`)."""
    b, nq, hq, d = q.shape
    dv = vf.shape[-1]
    p = plan.partials
    in_place = plan.tail_in_place(b)
    q_split = _split_queries(q, family, kf, dv, plan.splits if in_place else p)
    setup = _setup(plan, family, q_split, q, kf, vf, rows, nk)
    # a partial row no launch writes (FFPA skips it) reads lse -inf, so the combine skips it: its out is never read
    out_p = torch.empty((b * p * nq, hq, dv), dtype=q.dtype, device=q.device)
    lse_t = None if in_place or not plan.tail else torch.empty((hq, b * nq), dtype=torch.float32, device=q.device)
    lse_p = torch.empty((hq, b * p * nq), dtype=torch.float32, device=q.device)
    if plan.prefill(b):
        lse_p.fill_(float("-inf"))
    _launches(plan, setup, q, q_split, kf, vf, scale, out_p, lse_p, lse_t, out, lse, in_place, fill_tail=True)


class SlotCall(NamedTuple):
    """A call signature on the slot launch (:func:`slot_call`): the plan, the slots and their set-up, derived once;
    :meth:`run` is the whole split route of one call (the front end keeps it per signature, a decode step's only
    decision then being the memo's lookup). ``call``: the slot call's compile key (the slot launch, with FFPA's causal
    tail in its last slot, and the combine in one host function, :mod:`xattn.core.slot_call_sm90`; ``None`` for
    dtypes the kernels do not take, where the launches run one by one). ``slots`` None: the batched slot call (B > 1,
    :func:`xattn.core.split_kv.batched_slot_call`), always one call."""

    plan: SplitPlan
    slots: split_kv.SlotLaunch | None
    setup: _Setup
    call: SlotCallSpec | None = None

    def run(self, q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor, lse: Tensor) -> None:
        """Write ``out [B, Nq, Hq, Dv]`` and ``lse [B, Hq, Nq]`` (any content before) for q ``[B, Nq, Hq, D]`` on
        k/v ``[B, Nk, Hkv, D]`` of this signature (any strides with a unit last one). B > 1: the batched slot call
        (:mod:`xattn.core.slot_call_sm90`). B = 1: the S splits are the dense forward of ``q_slots [S, Nq, Hq, D]``
        (batch stride 0) on ``k_slots [S, n, Hkv, D]`` (batch stride ``chunk`` rows), writing slot s of ``out_p [S,
        Nq, Hq, Dv]`` / ``lse_p [S, Hq, Nq]``, then the combine writes out and lse: one slot call (with a causal tail,
        its last slot, masked), or for other dtypes the two launches. Only the buffers the launches need (a decode
        step's host time)."""
        plan, slots, setup, call = self
        nq, hq = q.shape[1], q.shape[2]
        if slots is None:  # the batched slot call (B > 1): one buffer, one call, in any stream state
            if call.shared_q:  # FA4's decode tile reads q's rows as they are
                q = _sequences_nq_rows_apart(q)
            work = torch.empty(split_kv.slot_work_floats(plan.partials, nq, hq, v.shape[-1], q.shape[0], q.shape[-1]),
                               dtype=torch.float32, device=q.device)
            ops.LAUNCH["slot_call"](call, q, k, v, out, lse, work, splits=plan.splits, softmax_scale=scale,
                                    cu_seqlens=(setup.cu_q, setup.cu_k))
            return
        s = plan.splits
        if call is not None:
            work = torch.empty(split_kv.slot_work_floats(s, nq, hq, v.shape[-1]), dtype=torch.float32,
                               device=q.device)  # the partials, laid out inside the call
            ops.LAUNCH["slot_call"](call, q, k, v, out, lse, work, splits=s, softmax_scale=scale,
                                    slot_bounds=setup.bounds)
            return
        q_slots, k_slots, v_slots = _slot_views(s, slots.chunk, slots.keys, q, k, v)
        out_p = torch.empty((s, nq, hq, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse_p = torch.empty((s, hq, nq), dtype=torch.float32, device=q.device)
        ops.LAUNCH["fwd"](setup.checked, q_slots, k_slots, v_slots, out_p, lse_p, softmax_scale=scale)
        # the combine's [P, B, Nq, Hq] view of lse_p [P, Hq, Nq]: one as_strided, not an unsqueeze and a transpose
        lse_c = lse_p.as_strided((s, 1, nq, hq), (hq * nq, hq * nq, 1, nq))
        ops.LAUNCH["combine"](setup.combine, out_p.unsqueeze(1), lse_c, out, lse.permute(0, 2, 1))


def slot_call(plan: SplitPlan, family: str, q: Tensor, k: Tensor, v: Tensor) -> SlotCall | None:
    """The slot launch's :class:`SlotCall` for q ``[B, Nq, Hq, D]`` on k/v ``[B, Nk, Hkv, D]`` under ``plan``, or
    ``None`` where the launches run one by one (:func:`xattn.core.split_kv.slot_launch`,
    :func:`~xattn.core.split_kv.batched_slot_call`; a causal tail in other dtypes than the kernels' 16-bit ones: the
    slot call alone masks it)."""
    if q.shape[0] > 1:
        return _batched_call(plan, family, q, k, v)
    slots = split_kv.slot_launch(plan, family, q.shape[0], k.shape[1], q.shape[1])
    if slots is None or (slots.tail and q.element_size() != 2):
        return None
    views = _slot_views(plan.splits, slots.chunk, slots.keys, q, k, v)
    setup = _slot_setup(plan, slots, family, *views, q, k, v)
    call = None
    if q.element_size() == 2:  # the slot call (the kernels' dtypes; its key from the validated split launch's)
        spec = setup.checked[0]
        call = SlotCallSpec(spec.family, spec.dtype, spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead,
                            setup.combine.chunk, tail=slots.tail)
    return SlotCall(plan, slots, setup, call)


def _batched_call(plan: SplitPlan, family: str, q: Tensor, k: Tensor, v: Tensor) -> SlotCall | None:
    """:func:`slot_call` for B > 1: the batched slot call where the core runs one (16-bit, a filled plan, the
    sequences a whole number of rows apart); its index arrays are the varlen split launch's (:func:`_setup`)."""
    rows = rows_per_seq(k, v)
    if q.element_size() != 2 or rows is None or not split_kv.batched_slot_call(plan, family, q.shape[0]):
        return None
    b, nq, hq, d = q.shape
    nk = k.shape[1]
    key_rows = rows * (b - 1) + nk
    q_split = q.as_strided((b * plan.partials * nq, hq, d), (0, q.stride(2), q.stride(3)), q.storage_offset())
    setup = _setup(plan, family, q_split, q, flat_keys(k, key_rows), flat_keys(v, key_rows), rows, nk,
                   tail_launch=False)
    spec = setup.checked[0]
    call = SlotCallSpec(spec.family, spec.dtype, spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead,
                        setup.combine.chunk, tail=plan.tail, batched=True)
    return SlotCall(plan, None, setup, call)


def _sequences_nq_rows_apart(q: Tensor) -> Tensor:
    """q ``[B, Nq, Hq, D]`` whose sequences are Nq rows apart (``stride(0) == Nq stride(1)``, the shared-q batched
    call's reading of ``[B Nq, Hq, D]`` rows): q itself, a view for Nq = 1 (its row stride set to the sequences'),
    else a contiguous copy (HF's transposed q of several queries)."""
    s = q.stride()
    if s[0] == q.shape[1] * s[1]:
        return q
    if q.shape[1] == 1:
        return q.as_strided(q.shape, (s[0], s[0], *s[2:]), q.storage_offset())
    return q.contiguous()


def _slot_views(s: int, chunk: int, keys: int, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q_slots [S, Nq, Hq, D]`` (batch stride 0) and ``k_slots/v_slots [S, keys, Hkv, D]`` (batch stride
    ``chunk`` rows): views of q ``[1, Nq, Hq, D]`` and k/v ``[1, Nk, Hkv, D]``."""
    qs, ks, vs = q.stride(), k.stride(), v.stride()
    return (q.as_strided((s, *q.shape[1:]), (0, *qs[1:]), q.storage_offset()),
            k.as_strided((s, keys, *k.shape[2:]), (chunk * ks[1], *ks[1:]), k.storage_offset()),
            v.as_strided((s, keys, *v.shape[2:]), (chunk * vs[1], *vs[1:]), v.storage_offset()))


def _slot_setup(plan: SplitPlan, slots: split_kv.SlotLaunch, family: str, q_slots: Tensor, k_slots: Tensor,
                v_slots: Tensor, q: Tensor, k: Tensor, v: Tensor) -> _Setup:
    """:func:`_setup` of the slot launch (q ``[1, Nq, Hq, D]``, k/v ``[1, Nk, Hkv, D]``): its dense ``(spec,
    problem)`` (FA4's decode tile), with a causal tail the slot call's ``bounds [chunk, S - 1]`` (int32 on the
    device), and the combine; keyed by the call's shapes (the slots' follow from them and the plan)."""
    key = ("slots", plan, family, q.shape, k.shape, v.shape, q.dtype, q.device)
    hit = _SETUPS.get(key)
    if hit is not None:
        return hit
    dev = q.device
    checked = split_kv.split_launch(ops._checked("fwd", family, q_slots, k_slots, v_slots, False, -1, -1))
    bounds = None
    if slots.tail:
        c, last = slots.chunk, plan.splits - 1
        if _capturing(dev):  # (a new cache length under torch.compile's CUDA graphs): device arithmetic
            bounds = outside_graph_pools(lambda: ramp(0, 2, dev) * (last - c) + c, dev)
        else:  # a cache that grows by a key per step (HF's DynamicCache) sets up every step: one copy
            bounds, = int32_lists(dev, [c, last])
    combine = CombineSpec(family, str(q.dtype).removeprefix("torch."), v.shape[-1],
                          split_kv.combine_chunk(slots.partials))
    return _SETUPS.put(key, _Setup(None, None, slots.chunk, checked, None, None, 0, None, combine, bounds))


def _split_device(plan: SplitPlan, family: str, q: Tensor, kf: Tensor, vf: Tensor, nk: int, rows: int, scale: float,
                  out: Tensor, lse: Tensor, keys: Tensor, packed: tuple[Tensor, int] | None = None) -> None:
    """The split route with the keys' lengths on the device: ``keys`` int32, sequence b's valid keys ``[B]`` from
    flat row ``b * rows`` (``rows >= 0``), or ``cu_seqlens_k [B + 1]`` (``rows`` -1: packed keys). ``packed =
    (cu_seqlens_q, Nq)``: q ``[Tq, Hq, D]``, out ``[Tq, Hq, Dv]``, lse ``[Hq, Tq]`` packed, run as the dense problem
    of Nq queries (:mod:`xattn.core.split_kv`, "Packed queries"); else q ``[B, Nq, Hq, D]``, out ``[B, Nq, Hq, Dv]``,
    lse ``[B, Hq, Nq]``. One index kernel (:mod:`xattn.core.split_meta_sm90`) writes the launches' ``cu_seqlens_k``,
    the lse pre-fills and the packed gathers: no sync, nothing else between the launches but the packed gathers."""
    hq, d, dv, dev = q.shape[-2], q.shape[-1], vf.shape[-1], q.device
    b, nq = (packed[0].shape[0] - 1, packed[1]) if packed else q.shape[:2]
    p = plan.partials
    rows_d = b * nq
    # lse: the partials [Hq, B P Nq], the tail's [Hq, B Nq], (packed) the combined [Hq, B Nq + 1] with a sentinel
    # column; all -inf first. out (packed): the combined [B Nq + 1, Hq, Dv] with a zero sentinel row. Packed rows
    # outside every sequence read the sentinels: out 0, lse -inf
    sizes = (hq * rows_d * p, hq * rows_d if plan.tail else 0, hq * (rows_d + 1) if packed else 0)
    lse_all = torch.empty(sum(sizes), dtype=torch.float32, device=dev)
    lse_p = lse_all[:sizes[0]].view(hq, rows_d * p)
    lse_t = lse_all[sizes[0]:sizes[0] + sizes[1]].view(hq, rows_d) if plan.tail else None
    cu_k = torch.empty(b * (p + 1) + 1, dtype=torch.int32, device=dev)
    tail_k = torch.empty(2 * b + 1, dtype=torch.int32, device=dev) if plan.tail else cu_k
    gathers = None
    if packed:
        out_all = torch.empty((rows_d + 1, hq, dv), dtype=q.dtype, device=dev)
        lse_rows = lse_all[sizes[0] + sizes[1]:].view(hq, rows_d + 1)
        gathers = (packed[0], torch.empty(rows_d, dtype=torch.int32, device=dev),
                   torch.empty(q.shape[0], dtype=torch.int32, device=dev), out_all[rows_d].view(-1).view(torch.int32))
    ops.LAUNCH["split_meta"](_split_meta_spec(family, plan.tail, packed is not None), keys, cu_k, tail_k, lse_all,
                             gathers, batch=b, rows=rows, key_rows=kf.shape[0], seqlen_q=nq, splits=plan.splits,
                             chunk=plan.chunk)
    q_d, out_d, lse_d = q, out, lse
    if packed:
        q_d = q.index_select(0, gathers[1]).view(b, nq, hq, d)
        out_d = out_all[:rows_d].view(b, nq, hq, dv)
        lse_d = lse_rows[:, :rows_d].view(hq, b, nq).permute(1, 0, 2)
    q_split = _split_queries(q_d, family, kf, dv, p)
    setup = _setup(plan, family, q_split, q_d, kf, vf, max(rows, 0), nk)
    setup = setup._replace(cu_k=cu_k, tail_k=tail_k, max_k=kf.shape[0], tail_max_k=kf.shape[0])
    out_p = torch.empty((rows_d * p, hq, dv), dtype=q.dtype, device=dev)
    _launches(plan, setup, q_d, q_split, kf, vf, scale, out_p, lse_p, lse_t, out_d, lse_d, False, fill_tail=False)
    if packed:
        torch.index_select(out_all, 0, gathers[2], out=out)
        torch.index_select(lse_rows, 1, gathers[2], out=lse)


def _launches(plan: SplitPlan, setup: _Setup, q: Tensor, q_split: Tensor, kf: Tensor, vf: Tensor, scale: float,
              out_p: Tensor, lse_p: Tensor, lse_t: Tensor | None, out: Tensor, lse: Tensor, in_place: bool,
              fill_tail: bool) -> None:
    """The split launch, the causal tail beside it (into its slot, or into ``lse_t``'s rows and copied there;
    ``fill_tail``: pre-fill those with -inf here), and the combine into ``out [B, Nq, Hq, Dv]`` / ``lse [B, Hq, Nq]``
    (strided views welcome)."""
    b, nq, hq, d = q.shape
    dv = vf.shape[-1]
    p = plan.partials
    side = Side(q.device) if plan.tail else None
    if side:  # the causal tail runs beside the splits: its few CTAs take SMs the splits leave idle
        if in_place:  # the last Nq partial rows, past the split launch's documents
            out_t, lse_t = out_p[(p - 1) * nq:], lse_p[:, (p - 1) * nq:]
        else:
            out_t = torch.empty((b * nq, hq, dv), dtype=q.dtype, device=q.device)
        with side.fork():
            if not in_place and fill_tail:
                lse_t.fill_(float("-inf"))
            ops.LAUNCH["fwd"](setup.tail_checked, q.reshape(b * nq, hq, d), kf, vf, out_t, lse_t,
                              softmax_scale=scale, cu_seqlens_q=setup.tail_q, cu_seqlens_k=setup.tail_k,
                              max_seqlen_q=nq, max_seqlen_k=setup.tail_max_k)
    rows_s = b * (p - int(in_place)) * nq  # the split launch's query rows (the tail's in place after them)
    if rows_s != out_p.shape[0]:  # the tail's rows in place after the splits' (no slices otherwise: host time)
        out_s, lse_s = out_p[:rows_s], lse_p[:, :rows_s]
    else:
        out_s, lse_s = out_p, lse_p
    ops.LAUNCH["fwd"](setup.checked, q_split, kf, vf, out_s, lse_s, softmax_scale=scale,
                      cu_seqlens_q=setup.cu_q, cu_seqlens_k=setup.cu_k, max_seqlen_q=nq, max_seqlen_k=setup.max_k)
    if side:  # a copied tail's slot once the splits are written (their launch gives it no key), then join
        if not in_place:
            with side.after_main():
                out_p.view(b, p, nq, hq, dv)[:, p - 1].copy_(out_t.view(b, nq, hq, dv))
                lse_p.view(hq, b, p, nq)[:, :, p - 1].copy_(lse_t.view(hq, b, nq))
        side.join()
    ops.LAUNCH["combine"](setup.combine, *_partial_views(out_p, lse_p, b, p, nq, hq, dv), out, lse.permute(0, 2, 1))


def _partial_views(out_p: Tensor, lse_p: Tensor, b: int, p: int, nq: int, hq: int, dv: int) -> tuple[Tensor, Tensor]:
    """The combine's views of the partials: ``out_p [B*P*Nq, Hq, Dv]`` as ``[P, B, Nq, Hq, Dv]`` and ``lse_p
    [Hq, B*P*Nq]`` as ``[P, B, Nq, Hq]`` (both contiguous: one ``as_strided`` each, not a view and a permute)."""
    n = p * nq
    return (out_p.as_strided((p, b, nq, hq, dv), (nq * hq * dv, n * hq * dv, hq * dv, dv, 1)),
            lse_p.as_strided((p, b, nq, hq), (nq, n, 1, b * n)))


_split_meta_spec = functools.lru_cache(maxsize=8)(SplitMetaSpec)  # built once per variant, not per step
