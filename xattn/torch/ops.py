"""torch.library custom ops over the core (namespace ``xattn``): fwd and bwd, each next to its fake
(meta) kernel, with autograd registered, so ``torch.compile(fullgraph=True)`` traces models that
use them without a graph break and CUDA graphs capture them.

Glossary: B batch, N lengths, T packed tokens, Hq/Hkv heads, D/Dv head dims. Dense layout
``[B, N, H, D]`` (lse ``[B, Hq, Nq]``), varlen ``[T, H, D]`` with int32 cu_seqlens (lse ``[Hq, Tq]``).
``family`` is ``"ffpa"`` or ``"fa4"``; a window side of -1 means unbounded (< -1: ValueError), and
every window reaches the core, which refuses what the family cannot run (FFPA has no window). Outputs are allocated
here with ``torch.empty`` / the fills the core documents (``KernelSpec.output_fill`` and the
workspace ``fill``), then the core writes them on the current stream.

cu_seqlens values are trusted by the custom ops (the core is called with ``check_inputs=False``):
:func:`attention_op` checks them first in checked mode (``check_inputs=True``, or
``XATTN_CHECK_INPUTS=1`` when None; :mod:`xattn.torch.varlen_check`, one host sync).
"""

from __future__ import annotations

import functools
import itertools
import logging
from typing import Optional

import torch
from torch import Tensor

import xattn.core as xc
from xattn.core.api import (launch_bwd, launch_combine, launch_fwd, launch_paged_fwd, launch_paged_meta,
                            launch_slot_call, launch_split_meta)
from xattn.core.checks import Memo, Meta, Problem, as_tensor, check_buffers, check_layout_sizes, check_scale, validate
from xattn.core import gemm_bwd_plan, routes, split_kv
from xattn.core.determinism import nondeterministic_op
from xattn.core.spec import KernelSpec, supports
from xattn.core.workspace import bwd_workspace_shapes

from . import split_kv as torch_split_kv
from .varlen_check import check_cu_seqlens, checking

__all__ = ["fwd", "bwd", "fwd_lengths", "attention_op"]

_log = logging.getLogger("xattn")
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=256)  # a decode loop asks every step: the sizes alone decide
def paged_spec(family: str, dtype: str, d: int, dv: int, g: int, causal: bool, left, right, page_size: int,
               varlen: bool = False) -> KernelSpec:
    """The compile key of one paged forward launch (:mod:`xattn.core.paged_sm90`); NotImplementedError with the
    support matrix's reason where no launcher reads it."""
    spec = KernelSpec(family, "fwd", dtype, d, dv, g, causal, varlen, left, right, page_size=page_size)
    reason = supports(spec)
    if reason:
        raise NotImplementedError(f"paged KV cache: {reason}")
    return spec


# the core's launch entries, by direction (tests swap them for stand-ins that run without a GPU)
LAUNCH = {"fwd": launch_fwd, "bwd": launch_bwd, "combine": launch_combine, "paged": launch_paged_fwd,
          "paged_meta": launch_paged_meta, "split_meta": launch_split_meta, "slot_call": launch_slot_call}


def _meta(name: str, t) -> Meta:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    return Meta(tuple(t.shape), _DTYPES.get(t.dtype) or str(t.dtype).removeprefix("torch."))


_CHECKED = Memo()  # the call's metadata -> (spec, problem) from the core's validator


def _checked(direction, family, q, k, v, causal, window_left, window_right, cu_seqlens_q=None, cu_seqlens_k=None,
          max_seqlen_q=0, max_seqlen_k=0) -> tuple[xc.KernelSpec, Problem]:
    """``(spec, problem)`` of a call from :func:`xattn.core.checks.validate` (the one validator), memoised
    by the metadata it reads: once per signature (decode calls repeat one). Sides ``-1`` = unbounded."""
    key = (direction, family, q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, causal, window_left,
           window_right, None if cu_seqlens_q is None else (cu_seqlens_q.shape, cu_seqlens_q.dtype),
           None if cu_seqlens_k is None else (cu_seqlens_k.shape, cu_seqlens_k.dtype), max_seqlen_q, max_seqlen_k,
           q.device.index)
    checked = _CHECKED.get(key)
    if checked is None:
        cu = {}
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            cu = {n: None if t is None else _meta(n, t)
                  for n, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))}
            cu.update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
        checked = _CHECKED.put(key, validate(family, direction, _meta("q", q), _meta("k", k), _meta("v", v),
                                             causal=causal, window=(window_left, window_right),
                                             device_index=q.device.index or 0, allow_no_keys=True, **cu))
    return checked


def _new(shape, dtype, device, fill):
    return torch.empty(shape, dtype=dtype, device=device) if fill is None else \
        torch.full(shape, fill, dtype=dtype, device=device)


def _varlen_kw(cu_q, cu_k, max_q, max_k) -> dict:
    """The launch keywords of a packed call (none for a dense one)."""
    if cu_q is None:
        return {}
    return dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)


def _no_keys(problem: Problem) -> bool:
    """Query rows but no key at all: the kernels have no launch for it; every row sees no key."""
    return problem.total_k == 0 and problem.total_q > 0


def _check_buffers(checked, buffers: dict, cu_q=None, cu_q_k=None) -> None:
    """The per-buffer checks (devices, strides, alignment) of a call no kernel launch will see: the core's
    launchers make them in C, but a call without keys is answered here (out 0 / lse -inf, grads 0)."""
    views = {n: as_tensor(t, n) for n, t in buffers.items()}
    if cu_q is not None:
        views.update(cu_seqlens_q=as_tensor(cu_q, "cu_seqlens_q"), cu_seqlens_k=as_tensor(cu_q_k, "cu_seqlens_k"))
    check_buffers(*checked, views)


def _fwd_shapes(q, v, varlen):
    lse = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    return (*q.shape[:-1], v.shape[-1]), lse


_FWD_SETUPS = Memo()  # (spec, problem) -> what forward_impl derives from them alone


def _fwd_setup(q, k, v, family, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k):
    """``(checked, no_keys, fills, out_shape, lse_shape)`` of a forward, from its validated ``(spec, problem)``."""
    checked = _checked("fwd", family, q, k, v, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
                       max_seqlen_q, max_seqlen_k)
    derived = _FWD_SETUPS.get(checked)
    if derived is None:
        spec, problem = checked
        no_keys = _no_keys(problem)  # every row sees no key: out 0, lse -inf
        fills = {"out": 0.0, "lse": float("-inf")} if no_keys else spec.output_fill()
        derived = _FWD_SETUPS.put(checked, (checked, no_keys, fills, *_fwd_shapes(q, v, spec.varlen)))
    return derived


_FWD_ROUTES = Memo()  # (checked, rows, num_splits, request, device) -> (Route, rows)
_FUSED = routes.Route("fused", "the family's forward kernel (more queries per sequence than decoding)")


def _fwd_route(checked, q, k, v, num_splits: int):
    """``(route, rows)`` of a forward (:func:`xattn.core.routes.forward_route`); ``rows``: the flat key view's
    row stride between sequences (:func:`xattn.torch.split_kv.rows_per_seq`)."""
    spec, problem = checked
    request = routes.requested_forward()
    if request == "auto" and num_splits <= 1 and problem.seqlen_q > split_kv.MAX_DECODE_QUERIES:
        return _FUSED, None  # prefill and training: no decision to make
    rows = 0 if spec.varlen else torch_split_kv.rows_per_seq(k, v)  # packed keys: each document's own start
    key = (checked, rows, num_splits, request, q.device)
    hit = _FWD_ROUTES.get(key)
    if hit is None:
        problem_fwd = routes.FwdProblem(
            spec.family, problem.batch, problem.heads_kv, spec.qhead_per_kvhead, problem.seqlen_q, problem.seqlen_k,
            causal=spec.causal, local=spec.is_local, varlen=spec.varlen, flat_kv=rows is not None,
            num_sms=torch_split_kv.num_sms(q.device), num_splits=num_splits)
        hit = _FWD_ROUTES.put(key, (routes.forward_route(problem_fwd, request), rows))
        _log.debug("xattn forward route %s: %s", hit[0].name, hit[0].reason)
    return hit


_SLOT_CALLS = Memo(256)  # a dense call's metadata -> its SlotCall, where the route put it on the slot launch


def forward_impl(q, k, v, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k, num_splits=0):
    """The body of :func:`fwd` (also called by :mod:`xattn.torch.ring` outside the dispatcher): allocates
    and returns ``(out, lse)`` in the layouts of the module docstring, on the route :func:`_fwd_route` names.
    A decode step whose signature the route put on the slot launch before runs it straight from one memo
    (:func:`xattn.torch.split_kv.slot_call`): the same launches, none of the decisions again (host time)."""
    scale = check_scale(softmax_scale)
    slot_key = None
    if cu_seqlens_q is None and q.dim() == 4 and q.shape[1] <= split_kv.MAX_DECODE_QUERIES:
        slot_key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, family, causal, window_left,
                    window_right, num_splits, routes.requested_forward())
        if q.shape[0] > 1:  # the batched slot call reads k and v on their rows per sequence
            slot_key += (k.stride(), v.stride())
        slot = _SLOT_CALLS.get(slot_key)
        if slot is not None:
            return _run_slots(slot, q, k, v, scale)
    checked, no_keys, fills, out_shape, lse_shape = _fwd_setup(q, k, v, family, causal, window_left, window_right,
                                                           cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if not no_keys and checked[1].total_q:
        route, rows = _fwd_route(checked, q, k, v, num_splits)
        if route.name == "split-kv":
            if slot_key is not None:
                slot = torch_split_kv.slot_call(route.plan, family, q, k, v)
                if slot is not None:
                    return _run_slots(_SLOT_CALLS.put(slot_key, slot), q, k, v, scale)
            out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
            lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
            if cu_seqlens_q is not None:
                torch_split_kv.packed_split_forward(route.plan, family, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, scale, out, lse)
            else:
                torch_split_kv.split_forward(route.plan, family, q, k, v, scale, rows, out, lse)
            return out, lse
    out = _new(out_shape, q.dtype, q.device, fills.get("out"))
    lse = _new(lse_shape, torch.float32, q.device, fills.get("lse"))
    kw = _varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if no_keys:
        _check_buffers(checked, dict(q=q, k=k, v=v, out=out, lse=lse), cu_seqlens_q, cu_seqlens_k)
    else:
        LAUNCH["fwd"](checked, q, k, v, out, lse, softmax_scale=scale, **kw)
    return out, lse


def _run_slots(slot, q, k, v, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq])`` of a call on the slot launch
    (:class:`~xattn.torch.split_kv.SlotCall`)."""
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device=q.device)
    slot.run(q, k, v, scale, out, lse)
    return out, lse


@torch.library.custom_op("xattn::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, family: str, softmax_scale: float, causal: bool,
        window_left: int, window_right: int, cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor],
        max_seqlen_q: int, max_seqlen_k: int, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """Attention forward: returns ``(out, lse)``; see the module docstring for layouts. ``num_splits``:
    FlashAttention's (0 auto, 1 off, n > 1 that many key splits; :mod:`xattn.core.split_kv`)."""
    return forward_impl(q, k, v, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_splits)


@fwd.register_fake
def _fwd_fake(q, k, v, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
              max_seqlen_q, max_seqlen_k, num_splits=0):
    out_shape, lse_shape = _fwd_shapes(q, v, cu_seqlens_q is not None)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("xattn::fwd_lengths", mutates_args=())
def fwd_lengths(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, family: str, softmax_scale: float, causal: bool,
                window_left: int, window_right: int, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """Forward of q ``[B, Nq, Hq, D]`` on each sequence's first ``lengths[b]`` rows of k/v ``[B, Nk, Hkv, D]``
    (int32 ``[B]`` on the device; any k/v strides with one row stride between sequences): ``(out, lse)``, no
    gradient. What HF's static-cache decode runs (:mod:`xattn.torch.kvcache`); window sides -1 = unbounded."""
    from .kvcache import lengths_forward

    return lengths_forward(q, k, v, lengths, family, softmax_scale, causal, None if window_left < 0 else window_left,
                           None if window_right < 0 else window_right, num_splits)


@fwd_lengths.register_fake
def _fwd_lengths_fake(q, k, v, lengths, family, softmax_scale, causal, window_left, window_right, num_splits=0):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty((q.shape[0], q.shape[2], q.shape[1]),
                                                                   dtype=torch.float32)


def _alert_not_deterministic(op: str) -> None:
    """torch's own alert for nondeterministic ops: RuntimeError under
    ``torch.use_deterministic_algorithms(True)``, a UserWarning with ``warn_only=True``."""
    from torch._prims_common import alert_not_deterministic

    alert_not_deterministic(op)


def _document_lengths(cu_q: list, cu_k: list) -> tuple[list, list]:
    """(query, key) document lengths from host cu_seqlens lists."""
    return [b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])]


def _pinned(shape, dtype) -> Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class _LengthsCopy:
    """An asynchronous copy of cu_seqlens_q/k to pinned host memory, enqueued by the forward ahead of its
    kernel, so that the backward reads the document lengths (:func:`_bwd_route`) waiting at most for the
    GPU to reach that forward, not for all the GPU work queued before the backward. The copy and its event
    go on the current stream of cu_seqlens' device (which need not be the current device)."""

    def __init__(self, cu_q: Tensor, cu_k: Tensor):
        stream = torch.cuda.current_stream(cu_q.device)
        self._host = [_pinned(cu.shape, cu.dtype) for cu in (cu_q, cu_k)]
        with torch.cuda.stream(stream):
            for host, cu in zip(self._host, (cu_q, cu_k)):
                host.copy_(cu, non_blocking=True)
        self._versions = (cu_q._version, cu_k._version)
        self._done = torch.cuda.Event()
        self._done.record(stream)

    def lengths(self, cu_q: Tensor, cu_k: Tensor):
        """The (query, key) document lengths, or None when cu_seqlens were written since the copy."""
        if (cu_q._version, cu_k._version) != self._versions:
            return None
        self._done.synchronize()  # waits only while the GPU has not yet reached the forward that copied
        return _document_lengths(*(h.tolist() for h in self._host))


def _prefetch_lengths(spec_args, cu_q, cu_k) -> Optional[_LengthsCopy]:
    """Start :class:`_LengthsCopy` where the backward may take a GEMM route (FFPA head dims, CUDA)."""
    family, q, v, window = spec_args
    if not (isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor) and cu_q.is_cuda and cu_k.is_cuda) \
            or family != "ffpa" or torch.cuda.is_current_stream_capturing():
        return None  # (bad cu_seqlens reach the forward's checks, which run after this)
    if not routes.may_take_gemm(family, q.shape[-1], v.shape[-1], window):
        return None
    return _LengthsCopy(cu_q, cu_k)


def backward_impl(dout, q, k, v, out, lse, family, softmax_scale, causal, window_left, window_right,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prefetched=None):
    """The body of :func:`bwd`: returns ``(dq, dk, dv)`` from the given out/lse, on the route
    :func:`_bwd_route` names; ``prefetched``: the forward's :class:`_LengthsCopy` of cu_seqlens."""
    checked = _checked("bwd", family, q, k, v, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
                 max_seqlen_q, max_seqlen_k)
    spec, problem = checked
    scale = check_scale(softmax_scale)
    if torch.are_deterministic_algorithms_enabled() and nondeterministic_op(spec) is not None:
        _alert_not_deterministic(nondeterministic_op(spec))  # raises, or warns under warn_only
    fills = spec.output_fill()
    no_rows = problem.total_q == 0  # the core launches nothing: every gradient is 0 (FA4's would stay unwritten)
    no_keys = _no_keys(problem)  # no launch either: dq is 0 (dk, dv are empty)
    if not (no_rows or no_keys):
        route, lengths = _bwd_route(spec, q, k, cu_seqlens_q, cu_seqlens_k, prefetched)
        if route.name != "fused":
            return _gemm_bwd(checked, route.name, dout, q, k, v, out, lse, scale, lengths,
                             (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
    grads = [_new(t.shape, t.dtype, t.device, 0.0 if no_rows or no_keys else fills.get(n))
             for t, n in ((q, "dq"), (k, "dk"), (v, "dv"))]
    if no_keys:
        _check_buffers(checked, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=grads[0], dk=grads[1],
                                  dv=grads[2]), cu_seqlens_q, cu_seqlens_k)
        return tuple(grads)
    _launch_bwd(checked, grads, dout, q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return tuple(grads)


def _launch_bwd(checked, grads, dout, q, k, v, out, lse, scale, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k) -> None:
    """The family's fused backward kernel into ``grads`` (dq, dk, dv), with its fp32 workspace."""
    spec, p = checked
    layout = bwd_workspace_shapes(spec, p.batch, p.seqlen_q, p.seqlen_k, p.total_q, p.total_k, p.heads_q,
                                  p.heads_kv)
    check_layout_sizes(layout)  # before allocating it
    ws = [_new(shape, torch.float32, q.device, fill) for _, shape, _, fill in layout]
    LAUNCH["bwd"](checked, dout, q, k, v, out, lse, *grads, workspace=ws, softmax_scale=scale,
                  **_varlen_kw(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))


def _bwd_route(spec: xc.KernelSpec, q: Tensor, k: Tensor, cu_seqlens_q, cu_seqlens_k, prefetched=None):
    """``(route, lengths)``: the backward route of this problem (:func:`xattn.core.routes.backward_route`),
    logged at debug level, and for a packed batch the document lengths it was chosen on (host ints, read only
    where a GEMM route may serve it: from the forward's ``prefetched`` copy, else one device-to-host copy of
    cu_seqlens, which waits for the GPU), else None."""
    window = (spec.window_left, spec.window_right)
    base = dict(family=spec.family, head_dim=spec.head_dim, head_dim_v=spec.head_dim_v, g=spec.qhead_per_kvhead,
                causal=spec.causal, window=window)
    lengths = None
    if cu_seqlens_q is None:
        problem = routes.BwdProblem(**base, kind="dense", seqlen_k=k.shape[1])
    else:
        capturing = cu_seqlens_q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing and routes.may_take_gemm(spec.family, spec.head_dim, spec.head_dim_v, window):
            lengths = prefetched.lengths(cu_seqlens_q, cu_seqlens_k) if prefetched is not None else None
            if lengths is None:
                lengths = _document_lengths(cu_seqlens_q.tolist(), cu_seqlens_k.tolist())
        problem = routes.BwdProblem(**base, kind="packed", lengths=lengths or ((), ()), total_q=q.shape[0],
                                    total_k=k.shape[0], heads_q=q.shape[1], capturing=capturing)
    route = routes.backward_route(problem)
    _log.debug("xattn backward route %s: %s", route.name, route.reason)
    return route, lengths


def _gemm_bwd(checked, route: str, dout, q, k, v, out, lse, scale, lengths=None, varlen_args=(None,) * 4):
    """The GEMM backward ``route`` (a GEMM route name of :mod:`xattn.core.routes`) of a call's validated ``checked``
    after the per-buffer checks the core's launchers would make (q, k, v stand in for the dq, dk, dv it
    allocates itself); a packed batch passes its (query, key) document ``lengths`` and ``varlen_args`` =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    from .gemm_bwd import gemm_backward, gemm_backward_equal_documents, gemm_backward_varlen

    _check_buffers(checked, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=q, dk=k, dv=v), *varlen_args[:2])
    causal = checked[0].causal
    if route == "gemm":
        return gemm_backward(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal)
    if route == "gemm-dense":
        return gemm_backward_equal_documents(dout, q, k, v, out, lse, *routes.equal_documents(*lengths),
                                             softmax_scale=scale, causal=causal)
    if route == "gemm-segments":
        from .gemm_bwd_segments import gemm_backward_segments

        return gemm_backward_segments(dout, q, k, v, out, lse, lengths[0], softmax_scale=scale, causal=causal)
    if route not in ("gemm-groups", "gemm-groups+fused"):
        raise AssertionError(f"route {route!r} has no torch driver")  # backward_route never returns one
    groups = gemm_bwd_plan.varlen_groups(*lengths, q.shape[1])
    short = ()
    if route == "gemm-groups+fused":
        groups, short = routes.split_short_groups(groups, q.shape[1] // k.shape[1])
    grads = gemm_backward_varlen(dout, q, k, v, out, lse, *lengths, softmax_scale=scale, causal=causal,
                                 groups=groups)
    if short:
        _log.debug("xattn backward route %s: %d of %d documents (groups under the table's key count) on "
                   "the fused varlen backward", route, len(short), len(lengths[0]))
        _ffpa_documents_bwd(grads, short, lengths, dout, q, k, v, out, lse, checked[0].family, scale, causal)
    return grads


def _ffpa_documents_bwd(grads, docs, lengths, dout, q, k, v, out, lse, family, softmax_scale, causal) -> None:
    """The packed backward of documents ``docs`` (indices; each with rows and keys) on the family's fused
    varlen kernel, written into their rows of ``grads`` (dq ``[Tq, Hq, D]``, dk/dv ``[Tk, Hkv, D]``):
    their rows are gathered into one packed sub-batch (index tables and cu_seqlens in one pinned
    asynchronous copy: no host sync), run, and scattered back."""
    def rows_of(lens):  # the packed rows of `docs` (host, vectorised) and their sub-batch cu_seqlens
        sel = torch.tensor([lens[i] for i in docs], dtype=torch.int64)
        starts = torch.tensor(list(itertools.accumulate(lens[:-1], initial=0)), dtype=torch.int64)[list(docs)]
        cu = torch.nn.functional.pad(sel.cumsum(0), (1, 0))
        return torch.arange(int(cu[-1])) + torch.repeat_interleave(starts - cu[:-1], sel), cu

    (rows_q, cu_q), (rows_k, cu_k) = rows_of(lengths[0]), rows_of(lengths[1])
    table = torch.cat([rows_q, rows_k, cu_q, cu_k])
    table = table.pin_memory().to(q.device, non_blocking=True) if q.is_cuda else table.to(q.device)
    tq, tk, nc = rows_q.numel(), rows_k.numel(), cu_q.numel()
    idx_q, idx_k = table[:tq], table[tq:tq + tk]
    sub_cu_q, sub_cu_k = (x.to(torch.int32) for x in (table[tq + tk:tq + tk + nc], table[tq + tk + nc:]))
    pick_q, pick_k = (lambda x: x.index_select(0, idx_q)), (lambda x: x.index_select(0, idx_k))
    sub = (pick_q(dout), pick_q(q), pick_k(k), pick_k(v), pick_q(out), lse.index_select(1, idx_q))
    max_q, max_k = max(lengths[0][i] for i in docs), max(lengths[1][i] for i in docs)
    checked = _checked("bwd", family, sub[1], sub[2], sub[3], causal, -1, -1, sub_cu_q, sub_cu_k, max_q, max_k)
    fills = checked[0].output_fill()
    sub_grads = [_new(t.shape, t.dtype, t.device, fills.get(n)) for t, n in zip(sub[1:4], ("dq", "dk", "dv"))]
    _launch_bwd(checked, sub_grads, *sub, softmax_scale, sub_cu_q, sub_cu_k, max_q, max_k)
    for grad, idx, part in zip(grads, (idx_q, idx_k, idx_k), sub_grads):
        grad.index_copy_(0, idx, part)


@torch.library.custom_op("xattn::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, family: str,
        softmax_scale: float, causal: bool, window_left: int, window_right: int,
        cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], max_seqlen_q: int,
        max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Attention backward from the given ``out``/``lse``: returns ``(dq, dk, dv)`` (dk/dv per kv head)."""
    return backward_impl(dout, q, k, v, out, lse, family, softmax_scale, causal, window_left, window_right,
                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q,
              cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real kernel


def _setup_context(ctx, inputs, output):
    q, k, v, family, scale, causal, wl, wr, cu_q, cu_k, max_q, max_k = inputs[:12]
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.params = (family, scale, causal, wl, wr, max_q, max_k)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    family, scale, causal, wl, wr, max_q, max_k = ctx.params
    dq, dk, dv = bwd(dout.contiguous(), q, k, v, out, lse, family, scale, causal, wl, wr, cu_q, cu_k, max_q, max_k)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None


fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The same fwd/bwd as the custom ops, without the custom-op dispatch (~25 us per call in
    eager mode). Used only on plain tensors outside torch.compile; same kernels, same bits."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, params):
        family, scale, causal, wl, wr, max_q, max_k, num_splits = params
        # the lengths copy goes on the stream before the kernel: the backward then waits at most for the
        # GPU to reach this forward, not to finish it (the stream idles less while it enqueues the backward)
        ctx.lengths = _prefetch_lengths((family, q, v, (None if wl < 0 else wl, None if wr < 0 else wr)), cu_q, cu_k) \
            if any(ctx.needs_input_grad[:3]) else None
        out, lse = forward_impl(q, k, v, family, scale, causal, wl, wr, cu_q, cu_k, max_q, max_k, num_splits)
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.params = params
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        family, scale, causal, wl, wr, max_q, max_k, _ = ctx.params
        grads = backward_impl(dout.contiguous(), q, k, v, out, lse, family, scale, causal, wl, wr, cu_q, cu_k,
                          max_q, max_k, ctx.lengths)
        return (*grads, None, None, None)


def attention_op(q: Tensor, k: Tensor, v: Tensor, family: str, softmax_scale: float, causal: bool,
                 window_left: int, window_right: int, cu_seqlens_q: Optional[Tensor],
                 cu_seqlens_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, *,
                 check_inputs: Optional[bool] = None, num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """Differentiable ``(out, lse)`` (same arguments as :func:`fwd`): the ``xattn::fwd`` custom op
    under torch.compile / fake or functional tensors, a direct autograd.Function in plain eager mode,
    and the forward alone where no gradient can be asked for (grad mode off, or no input requiring one).

    Varlen: ``check_inputs=True`` validates cu_seqlens on their device first (one host sync; a
    ``ValueError`` naming the first bad index), ``False`` trusts them, ``None`` follows
    ``XATTN_CHECK_INPUTS``. Unchecked, bad cu_seqlens are undefined behaviour (see :mod:`xattn.core.api`)."""
    if cu_seqlens_q is not None and checking(check_inputs):
        check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if type(q) is Tensor and not torch.compiler.is_compiling():
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return forward_impl(q, k, v, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, num_splits)  # no graph to record (decode)
        return _EagerAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, (
            family, softmax_scale, causal, window_left, window_right, max_seqlen_q, max_seqlen_k, num_splits))
    return fwd(q, k, v, family, softmax_scale, causal, window_left, window_right, cu_seqlens_q, cu_seqlens_k,
               max_seqlen_q, max_seqlen_k, num_splits)
