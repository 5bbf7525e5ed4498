"""Every launch route in one place: which kernels and which driver serve one call, by name.

Both front ends describe a call (:class:`BwdProblem`), ask :func:`backward_route` (or
:func:`forward_route`) and dispatch on the returned name; nothing else decides a route. A
:class:`Route` carries its name, the reason it was chosen and, like TransformerEngine's
``get_attention_backend``, why every other route was not (:meth:`Route.rejected`).

Forward (:func:`forward_route`, :class:`FwdProblem`): ``fused`` (the family's kernel, dense or varlen, every
problem) or ``split-kv`` (decoding: the keys split over CTAs and merged by lse, :mod:`xattn.core.split_kv`;
dense or packed queries, at most :data:`~xattn.core.split_kv.MAX_DECODE_QUERIES` per sequence, no window).
``XATTN_FWD_ROUTE`` (``auto``, ``fused``, ``split-kv``; test hook :func:`forced_forward`) and the call's
``num_splits`` (FlashAttention's: 0 auto, 1 off, n > 1 that many splits) choose it. Backward:

=======================  ==============================================================  ==========================
name                     what runs                                                        serves
=======================  ==============================================================  ==========================
``fused``                the family's fused backward (FFPA's or FA4's)                    every problem
``gemm``                 the chunked-GEMM backward (:mod:`xattn.core.gemm_bwd_plan`)      dense
``gemm-dense``           packed documents of one length, as views of one dense batch      packed, equal documents
``gemm-segments``        one GEMM per row block over every document                       packed, self-attention
``gemm-groups``          documents of about one length gathered into dense batches        packed (host lengths)
``gemm-groups+fused``    the same, groups under the table's key count on ``fused``        packed (host lengths)
``gemm-padded``          every document padded to max_seqlen: one dense batch             packed (traced lengths)
``gemm-segments|fused``  ``gemm-segments`` where the table picks the GEMMs at the keys an   packed (traced), one
                         average row's document holds, else ``fused`` (``lax.cond``)        cu_seqlens
=======================  ==============================================================  ==========================

Every GEMM route needs an FFPA problem (head dims 320-512) with equal q/k and v head dims and no
window. "Packed" problems come in two kinds: ``packed`` (document lengths on the host: torch) and
``traced`` (``jax.jit``: only static shapes are known; the lengths are device values).
"Self-attention" means every document has as many queries as keys (``packed``: equal lengths;
``traced``: ``cu_seqlens_q is cu_seqlens_k``).

Choosing: ``XATTN_BWD_ROUTE`` (or the test hook :func:`forced`) is ``auto`` (the measured table:
:data:`MIN_KEYS_BY_GROUP`), ``ffpa`` (= ``fused``, kept from before the route names), ``gemm`` (the
GEMM route ``auto`` would take, every document on the GEMMs: for a dense problem, route ``gemm``), or a
route name. A forced route that
cannot serve the problem raises ValueError naming why; nothing falls back silently. Every route is
drawn, forced, by the contract fuzz (``tests/fuzz``) before it is anyone's default.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

from . import gemm_bwd_plan, split_kv
from .split_kv import SplitPlan
from .spec import KernelSpec
from .workspace import bwd_workspace_shapes

__all__ = ["FORWARD_ROUTES", "BACKWARD_ROUTES", "REQUESTS", "Route", "BwdProblem", "FwdProblem", "requested",
           "forced", "forced_forward", "requested_forward", "forward_route", "why_not_forward", "forward_table",
           "backward_route",
           "serving_routes", "why_not", "may_take_gemm", "min_keys_for",
           "MIN_KEYS_BY_GROUP", "route_table", "packed_layout", "equal_documents", "split_short_groups",
           "varlen_workspace_bytes", "segments_take_gemms", "PADDED_MAX_FILL"]

FORWARD_ROUTES = ("fused", "split-kv")
FWD_REQUESTS = ("auto",) + FORWARD_ROUTES
BACKWARD_ROUTES = ("fused", "gemm", "gemm-dense", "gemm-segments", "gemm-groups", "gemm-groups+fused",
                   "gemm-padded", "gemm-segments|fused")
REQUESTS = ("auto", "ffpa", "gemm") + BACKWARD_ROUTES
KINDS = ("dense", "packed", "traced")

# Measured on the H200 (benchmarks/results/gemm_bwd_proto_h200.json: the prototype of the GEMM route,
# benchmarks/tools/gemm_bwd_proto.py, last in commit b27f391; bf16, d512, fwd from FFPA):
# backward TFLOP/s, FFPA vs the GEMM route. The GEMMs win from these key counts on.
#   Hq32/Hkv4 causal: N 1k 85 vs 73, 2k 140 vs 161, 4k 188 vs 251, 8k 228 vs 364
#   Hq16/Hkv16 causal: N 2k 183 vs 147, 4k 216 vs 196, 8k 235 vs 317; non-causal 8k 248 vs 436
MIN_KEYS_BY_GROUP = ((8, 2048), (1, 8192))  # (min GQA group g, min Nk): first row with g >= its g
# traced lengths: "gemm-padded" when B * max_seqlen <= this x T on both sides (documents about max_seqlen long)
PADDED_MAX_FILL = 1.125
# "auto" takes these traced routes where they apply (GPU-verified: tests/jax/test_gemm_bwd_gpu.py,
# tests/jax/test_gemm_bwd_segments_gpu.py); False leaves them to a forced route
PADDED_BY_DEFAULT = True
SEGMENTS_BY_DEFAULT = True

_FORCED: list = []  # the test hook's stack (forced())
_FORCED_FWD: list = []  # forced_forward()'s


@dataclass(frozen=True)
class Route:
    """``name`` (one of :data:`BACKWARD_ROUTES` / :data:`FORWARD_ROUTES`) and ``reason`` (one line a user can
    read in a debug log); :meth:`rejected` says why each other route was not taken (computed when asked: a
    backward's hot path pays only for the choice)."""

    name: str
    reason: str
    problem: "BwdProblem | FwdProblem | None" = field(default=None, compare=False, repr=False)
    plan: "SplitPlan | None" = field(default=None, compare=False)  # split-kv: how it splits

    def rejected(self) -> tuple:
        """``((name, why), ...)`` for every route of the same pass not taken."""
        if self.problem is None:
            return ()
        if isinstance(self.problem, FwdProblem):
            return tuple((n, why_not_forward(n, self.problem) or "not the rule's choice")
                         for n in FORWARD_ROUTES if n != self.name)
        return tuple((n, why_not(n, self.problem) or "not the measured choice")
                     for n in BACKWARD_ROUTES if n != self.name)


@dataclass(frozen=True)
class BwdProblem:
    """What a route decision reads of one backward. ``kind``: ``dense`` (``seqlen_k`` keys per row),
    ``packed`` (``lengths = (query lengths, key lengths)``, host ints, in ``total_q`` / ``total_k`` rows)
    or ``traced`` (``slots`` documents of at most ``max_seqlen_q`` / ``max_seqlen_k`` in ``total_q`` /
    ``total_k`` rows; ``same_segments``: one cu_seqlens object for both sides). ``g`` = Hq / Hkv;
    ``capturing``: a CUDA graph is being captured (host lengths cannot be read)."""

    family: str
    head_dim: int
    head_dim_v: int
    g: int
    causal: bool
    window: tuple = (None, None)
    kind: str = "dense"
    seqlen_k: int = 0
    lengths: tuple | None = None
    total_q: int = 0
    total_k: int = 0
    slots: int = 0
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    same_segments: bool = False
    heads_q: int = 1
    capturing: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind={self.kind!r}: expected one of {KINDS}")
        if self.kind == "packed" and self.lengths is not None:
            object.__setattr__(self, "lengths", tuple(tuple(int(n) for n in side) for side in self.lengths))


def requested() -> str:
    """The route asked for: the innermost :func:`forced`, else ``XATTN_BWD_ROUTE`` (default ``auto``),
    not validated here (:func:`backward_route` names a bad value; a forward never reads it)."""
    if _FORCED:
        return _FORCED[-1]
    return os.environ.get("XATTN_BWD_ROUTE", "auto").strip().lower() or "auto"


@contextlib.contextmanager
def forced(name: str):
    """Test hook: every backward decided inside the block is asked for ``name`` (as ``XATTN_BWD_ROUTE``)."""
    _check_request(name)
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def _check_request(name: str) -> str:
    if name not in REQUESTS:
        raise ValueError(f"XATTN_BWD_ROUTE={name!r}: expected one of {REQUESTS}")
    return name


@dataclass(frozen=True)
class FwdProblem:
    """What a forward route decision reads. Dense queries ``[B, Nq, Hq, ..]`` on ``seqlen_k`` keys per
    sequence (``traced``: per-sequence valid keys as device values), or ``varlen`` (packed: B documents of at
    most ``seqlen_q`` = max_seqlen_q queries and ``seqlen_k`` = max_seqlen_k keys; their lengths on the device).
    ``flat_kv``: the front end can view every sequence's keys on one row stride (k and v strides ``(sB, sN, ..)``
    with ``sB % sN == 0``, the same ``sB / sN`` for both). ``num_sms``: the GPU's.
    ``num_splits``: the call's override (0 auto, 1 off, n > 1 that many). ``split_refused``: why the front end's
    kernels cannot run the split launches (e.g. the support matrix refuses their paged kernel), "" when they can."""

    family: str
    batch: int
    heads_kv: int
    g: int
    seqlen_q: int
    seqlen_k: int
    causal: bool = False
    local: bool = False
    varlen: bool = False
    flat_kv: bool = True
    num_sms: int = 132
    num_splits: int = 0
    traced: bool = False
    split_refused: str = ""


def requested_forward() -> str:
    """The forward route asked for: the innermost :func:`forced_forward`, else ``XATTN_FWD_ROUTE`` (``auto``)."""
    if _FORCED_FWD:
        return _FORCED_FWD[-1]
    return os.environ.get("XATTN_FWD_ROUTE", "auto").strip().lower() or "auto"


@contextlib.contextmanager
def forced_forward(name: str):
    """Test hook: every forward decided inside the block is asked for ``name`` (as ``XATTN_FWD_ROUTE``)."""
    if name not in FWD_REQUESTS:
        raise ValueError(f"XATTN_FWD_ROUTE={name!r}: expected one of {FWD_REQUESTS}")
    _FORCED_FWD.append(name)
    try:
        yield
    finally:
        _FORCED_FWD.pop()


def why_not_forward(name: str, p: FwdProblem) -> str | None:
    """Why forward route ``name`` cannot serve ``p`` (``None``: it can)."""
    if name == "fused":
        return None
    if name != "split-kv":
        raise ValueError(f"unknown forward route {name!r}; expected one of {FORWARD_ROUTES}")
    if p.local:
        return "a sliding window: the fused kernel reads only the window's keys"
    if p.seqlen_q > split_kv.MAX_DECODE_QUERIES:
        return f"{p.seqlen_q} queries per sequence: split-kv serves at most {split_kv.MAX_DECODE_QUERIES}"
    if not p.flat_kv:
        return "k/v strides put the sequences' keys on no common row stride (k.stride(0) % k.stride(1) != 0)"
    if p.num_splits == 1:
        return "num_splits=1 turns it off"
    if p.seqlen_k == 0 or p.batch == 0 or p.seqlen_q == 0:
        return "no key or no query: nothing to split"
    if p.split_refused:
        return f"its launches: {p.split_refused}"
    return None


def forward_route(p: FwdProblem, request: str | None = None) -> Route:
    """The forward route of ``p``: ``request`` (default :func:`requested_forward`) forced, else ``split-kv``
    where it can serve and :func:`~xattn.core.split_kv.decode_splits` (or ``num_splits`` > 1) gives 2 or more
    splits, else ``fused``. A forced route that cannot serve ``p`` raises ValueError."""
    request = requested_forward() if request is None else request
    if request not in FWD_REQUESTS:
        raise ValueError(f"XATTN_FWD_ROUTE={request!r}: expected one of {FWD_REQUESTS}")
    why = why_not_forward("split-kv", p)
    if request == "fused" or (request == "auto" and why):
        return Route("fused", f"{p.family}'s forward kernel" + (f" (split-kv: {why})" if why else ""), p)
    if why:
        raise ValueError(f"XATTN_FWD_ROUTE={request}: {why}")
    auto = split_kv.decode_splits(p.family, p.batch, p.heads_kv, p.g, p.seqlen_q, p.seqlen_k, p.num_sms)
    splits = p.num_splits or auto
    if splits > 1 or request == "split-kv":
        splits = max(splits, 2)
        plan = split_kv.plan_splits(splits, p.causal, p.seqlen_q, None if p.traced or p.varlen else p.seqlen_k)
        how = f"num_splits={p.num_splits}" if p.num_splits else f"{auto} splits fill {p.num_sms} SMs"
        forced = "forced by XATTN_FWD_ROUTE=split-kv; " if request == "split-kv" else ""
        return Route("split-kv", f"{forced}{how}", p, plan)
    return Route("fused", f"{p.family}'s forward kernel (its CTAs already fill the GPU)", p)


def min_keys_for(g: int) -> int:
    """The key count from which the measured table picks the GEMM backward at GQA group ``g``."""
    return next(n for gmin, n in MIN_KEYS_BY_GROUP if g >= gmin)


def _uncovered(p: BwdProblem) -> str | None:
    """Why no GEMM route can run ``p`` (None: the GEMM routes cover it)."""
    if p.family != "ffpa":
        return f"the GEMM backward covers FFPA head dims (320-512); {p.family} keeps its own backward"
    if p.head_dim != p.head_dim_v:
        return "the GEMM backward needs equal q/k and v head dims"
    if p.window is not None and any(w is not None and w >= 0 for w in p.window):
        return "sliding windows keep FFPA's backward"
    return None


def may_take_gemm(family: str, head_dim: int, head_dim_v: int, window=(None, None), request: str | None = None
                  ) -> bool:
    """Whether some GEMM route may serve a backward of this family and head dims under ``request`` (default
    :func:`requested`): torch then reads a packed batch's document lengths, warmup compiles the GEMMs."""
    request = requested() if request is None else request
    probe = BwdProblem(family, head_dim, head_dim_v, 1, False, window)
    return request not in ("ffpa", "fused") and _uncovered(probe) is None


def why_not(name: str, p: BwdProblem) -> str | None:
    """Why route ``name`` cannot serve ``p``; None when it can (the rule a forced route is held to)."""
    if name not in BACKWARD_ROUTES:
        raise ValueError(f"route {name!r}: expected one of {BACKWARD_ROUTES}")
    if name == "fused":
        return None
    uncovered = _uncovered(p)
    if uncovered:
        return uncovered
    kind_of = {"gemm": ("dense",), "gemm-dense": ("packed",), "gemm-segments": ("packed", "traced"),
               "gemm-groups": ("packed",), "gemm-groups+fused": ("packed",), "gemm-padded": ("traced",),
               "gemm-segments|fused": ("traced",)}[name]
    if p.kind not in kind_of:
        what = {"dense": "dense batches", "packed": "packed batches with host lengths",
                "traced": "packed batches under jit (traced lengths)"}
        return f"{name} serves {' and '.join(what[k] for k in kind_of)}, not {what[p.kind]}"
    if p.kind == "packed" and p.capturing:
        return "CUDA graph capture: the packed GEMM backwards read document lengths on the host"
    if name == "gemm-dense" and equal_documents(*p.lengths) is None:
        return "its documents are not all of one length"
    if name in ("gemm-segments", "gemm-segments|fused"):
        if p.kind == "packed" and p.lengths[0] != p.lengths[1]:
            return "a document has more queries than keys or fewer (segments need self-attention documents)"
        if p.kind == "traced" and not p.same_segments:
            return "segments need self-attention documents: pass one object as cu_seqlens_q and cu_seqlens_k"
    return None


def serving_routes(p: BwdProblem) -> list[str]:
    """Every backward route that can serve ``p`` (what the contract fuzz forces, one by one)."""
    return [name for name in BACKWARD_ROUTES if why_not(name, p) is None]


def _padding_fits(p: BwdProblem) -> bool:
    """Traced: whether the documents padded to ``max_seqlen`` cost at most :data:`PADDED_MAX_FILL` x the tokens."""
    return (p.slots * p.max_seqlen_q <= PADDED_MAX_FILL * p.total_q
            and p.slots * p.max_seqlen_k <= PADDED_MAX_FILL * p.total_k)


def _gemm_choice(p: BwdProblem, every_group: bool) -> tuple[str, str]:
    """The GEMM route of a covered problem (as ``auto`` picks it once the table says GEMM): ``(name, reason)``."""
    if p.kind == "dense":
        return "gemm", "chunked-GEMM backward"
    if p.kind == "packed":
        layout = packed_layout(*p.lengths, p.heads_q)
        if layout == "dense":
            return "gemm-dense", "documents of one length: the dense GEMM backward on views"
        if layout == "segments":
            return "gemm-segments", "self-attention documents of mixed lengths: one GEMM per row block"
        if every_group:
            return "gemm-groups", "documents grouped by length into dense batches, every group on the GEMMs"
        return "gemm-groups+fused", ("documents grouped by length into dense batches; groups under the table's "
                                     "key count on the fused backward")
    if _padding_fits(p) or not p.same_segments:
        return "gemm-padded", "documents about max_seqlen long: padded into one dense batch"
    if every_group:
        return "gemm-segments", "one GEMM per row block over every document"
    return "gemm-segments|fused", ("one GEMM per row block over every document where the keys an average row's "
                                   "document holds reach the table's (decided on the device), else fused")


def backward_route(p: BwdProblem, request: str | None = None) -> Route:
    """The backward route of ``p``: ``request`` (default :func:`requested`) forced, or under ``auto`` the
    measured table (:data:`MIN_KEYS_BY_GROUP`) on the keys of a row (dense), of an average row's document
    (packed) or ``max_seqlen_k`` (traced). A forced route that cannot serve ``p`` raises ValueError."""
    request = _check_request(requested() if request is None else request)
    if request != "gemm" and (request in BACKWARD_ROUTES or request == "ffpa"):
        name = "fused" if request == "ffpa" else request
        why = why_not(name, p)
        if why:
            raise ValueError(f"XATTN_BWD_ROUTE={request}: {why}")
        return Route(name, f"forced by XATTN_BWD_ROUTE={request}", p)
    uncovered = _uncovered(p)
    if request == "gemm":
        if uncovered or (p.kind == "packed" and p.capturing):
            raise ValueError(f"XATTN_BWD_ROUTE=gemm: {uncovered or why_not('gemm-groups', p)}")
        name, reason = _gemm_choice(p, every_group=True)
        return Route(name, f"forced by XATTN_BWD_ROUTE=gemm: {reason}", p)
    why = _auto_refusal(p, uncovered)
    if why:
        return Route("fused", why, p)
    name, reason = _gemm_choice(p, every_group=False)
    if p.kind == "traced" and name == "gemm-padded" and not PADDED_BY_DEFAULT:
        return Route("fused", "the padded GEMM route is off by default (PADDED_BY_DEFAULT)", p)
    if p.kind == "traced" and name == "gemm-segments|fused" and not SEGMENTS_BY_DEFAULT:
        return Route("fused", "the segmented GEMM route is off by default (SEGMENTS_BY_DEFAULT)", p)
    return Route(name, reason, p)


def _auto_refusal(p: BwdProblem, uncovered: str | None) -> str | None:
    """Why ``auto`` keeps the fused backward (None: the table picks a GEMM route)."""
    if uncovered:
        return uncovered
    if p.kind == "packed" and p.capturing:
        return why_not("gemm-groups", p)
    if p.kind == "traced" and p.causal and not p.same_segments:
        return ("a causal packed backward under jit skips keys past each block's diagonal only with one "
                "cu_seqlens object for queries and keys")
    if p.kind == "traced" and p.slots == 0:
        return "no document"
    keys, what = {"dense": (p.seqlen_k, "Nk"), "packed": (None, "keys per row's document"),
                  "traced": (p.max_seqlen_k, "max_seqlen_k")}[p.kind]
    if p.kind == "packed":
        keys = gemm_bwd_plan.keys_per_row(*p.lengths)
    least = min_keys_for(p.g)
    if keys < least:
        return (f"{what} {keys} < {least}: FFPA's fused backward is faster there (GQA group {p.g}, measured on "
                "the H200)")
    if p.kind == "traced":
        if not (_padding_fits(p) or p.same_segments):
            return (f"{p.slots} documents padded to max_seqlen ({p.max_seqlen_q}, {p.max_seqlen_k}) would cost more "
                    f"than {PADDED_MAX_FILL}x the {p.total_q} / {p.total_k} tokens (lengths are traced), and the "
                    "segmented route needs cu_seqlens_q is cu_seqlens_k")
    return None


def forward_table() -> list[str]:
    """Human-readable lines of the forward routes, for ``python -m xattn info``."""
    request = requested_forward()
    if request not in FWD_REQUESTS:
        raise ValueError(f"XATTN_FWD_ROUTE={request!r}: expected one of {FWD_REQUESTS}")
    return [f"decoding (dense q, or packed with max_seqlen_q, <= {split_kv.MAX_DECODE_QUERIES} queries per sequence; "
            f"no window; paged caches too): split-kv with "
            f"the most splits that keep one wave of CTAs (at most keys/{split_kv.MIN_KEYS_PER_SPLIT} and "
            f"{split_kv.MAX_PARTIALS - 1}) where that is 2 or more, else fused; num_splits overrides (0 auto, 1 off)",
            f"XATTN_FWD_ROUTE={request} (one of {', '.join(FWD_REQUESTS)})"]


def route_table() -> list[str]:
    """Human-readable lines of the backward routes, for ``python -m xattn info``."""
    lines = [f"GQA group >= {g}: GEMM backward from Nk {n}" for g, n in MIN_KEYS_BY_GROUP]
    lines.append("packed (varlen, host lengths): the same table on the keys an average row's document holds; "
                 "documents of one length: gemm-dense; self-attention documents of mixed lengths: gemm-segments "
                 f"(one GEMM per {gemm_bwd_plan.SEGMENT_ROWS}-row block across every document); else gemm-groups+fused "
                 f"(documents grouped within {gemm_bwd_plan.GROUP_FILL:g} of a group's first length, padded to "
                 f"{gemm_bwd_plan.GROUP_ALIGN}, groups under the table's key count on the fused varlen backward)")
    lines.append(f"packed under jax.jit (traced lengths): gemm-padded where documents are about max_seqlen long "
                 f"(B x max_seqlen <= {PADDED_MAX_FILL} T); else, one cu_seqlens object for q and k, "
                 "gemm-segments|fused (the table on the keys an average row's document holds, decided on the device)")
    lines.append(f"XATTN_BWD_ROUTE={_check_request(requested())} (one of {', '.join(REQUESTS)}), block budget "
                 f"{gemm_bwd_plan.budget_bytes() >> 20} MiB")
    return lines


# --- packed batches with host lengths: how their documents are laid out on the GEMMs ---------------

PACKED_LAYOUTS = ("dense", "segments", "groups")


def equal_documents(seqlens_q, seqlens_k) -> tuple[int, int, int] | None:
    """``(documents, nq, nk)`` when every document with rows or keys has the same lengths on its side (a
    packed batch that *is* a dense ``[documents, n, H, D]`` batch, empty documents taking no rows), else None."""
    pairs = {(int(a), int(b)) for a, b in zip(seqlens_q, seqlens_k) if a or b}
    if len(pairs) != 1:
        return None
    (nq, nk), = pairs
    if not (nq and nk):
        return None
    return sum(1 for a, b in zip(seqlens_q, seqlens_k) if a or b), nq, nk


def packed_layout(seqlens_q, seqlens_k, heads_q: int, budget: int | None = None) -> str:
    """How a packed batch on the GEMM backward runs (host lengths: torch), one of :data:`PACKED_LAYOUTS`:
    ``"dense"`` when its documents all have one length (:func:`equal_documents`: views of one dense batch);
    ``"segments"`` (one GEMM per row block over every document) for self-attention documents that
    :func:`xattn.core.gemm_bwd_plan.varlen_groups` cuts into more than one group; else ``"groups"``
    (documents of about one length gathered into dense batches). H200, Hq32/Hkv4 d512 causal bf16, backward
    TFLOP/s on the same out/lse, dense views / groups / segments (``benchmarks/tools/packed_layouts.py``,
    ``results/packed_layouts_h200.json``): 8 × 2k 344.9 / 315.1 / 312.6 ... 1 × 16k 482.6 / 476.3 / 450.8;
    mix16k groups 273.2 vs segments 313.6, mix64k 353.2 vs 362.1 (and the groups' host time per call is
    2.3x / 1.4x the segments': 8.9 vs 3.9 ms on mix16k)."""
    if equal_documents(seqlens_q, seqlens_k) is not None:
        return "dense"
    if [int(n) for n in seqlens_q] != [int(n) for n in seqlens_k]:
        return "groups"
    return "segments" if len(gemm_bwd_plan.varlen_groups(seqlens_q, seqlens_k, heads_q, budget)) > 1 else "groups"


def split_short_groups(groups, g: int) -> tuple[list, tuple]:
    """``(gemm_groups, fused_docs)`` of route ``gemm-groups+fused``: the groups whose padded key length is
    under the measured table's (:data:`MIN_KEYS_BY_GROUP`: FFPA's fused backward is faster there) leave the
    GEMMs, and their documents (sorted indices) run through the fused varlen backward as one sub-batch."""
    least = min_keys_for(g)
    long = [grp for grp in groups if grp.pad_k >= least]
    short = tuple(sorted(i for grp in groups if grp.pad_k < least for i in grp.docs))
    return long, short


def varlen_workspace_bytes(seqlens_q, seqlens_k, heads_q: int, heads_kv: int, head_dim: int, causal: bool,
                           budget: int | None = None, elem_bytes: int = 2, route: str = "auto") -> int:
    """Upper bound of the scratch one packed backward on the GEMMs allocates beyond its dq/dk/dv outputs
    (which carry one spare row each), by :func:`packed_layout`: segments take
    :func:`xattn.core.gemm_bwd_plan.segment_workspace_bytes`; equal documents
    :func:`xattn.core.gemm_bwd_plan.workspace_bytes` of that dense batch plus a copy of its gradients;
    groups ``8·Hq·Tq`` (row bias and δ of every row) plus ``DELTA_SLICE_BYTES`` plus the largest
    group's blocks (``workspace_bytes`` of its padded batch; its 16-bit dK/dV before the scatter,
    ``4·elem·G·Hkv·Nk8·D``; the gather/scatter indices ``26·G·Hq·Nq_pad + 17·G·Hkv·Nk8``).

    ``route`` ``auto`` (route ``gemm-groups+fused``; ``gemm``: every group on the GEMMs): the documents of
    :func:`split_short_groups` then run on FFPA's varlen backward (the GEMM part is freed by then, so
    the larger of the two counts): gathered dout/q/out/dq ``4·elem·Tq'·Hq·D``, k/v/dk/dv
    ``4·elem·Tk'·Hkv·D``, lse ``4·Hq·Tq'``, FFPA's workspace and the index table
    ``8·(Tq' + Tk' + 2·(B' + 1))``."""
    layout = packed_layout(seqlens_q, seqlens_k, heads_q, budget)
    if layout == "segments":
        return gemm_bwd_plan.segment_workspace_bytes(sum(seqlens_q), seqlens_q, heads_q, heads_kv, head_dim, causal,
                                                     budget, elem_bytes)
    if layout == "dense":  # the dense route on views; its outputs are copied out where rows follow the last document
        docs, nq, nk = equal_documents(seqlens_q, seqlens_k)
        outputs = elem_bytes * docs * (nq * heads_q + 2 * nk * heads_kv) * head_dim
        return outputs + gemm_bwd_plan.workspace_bytes(docs, nq, nk, heads_q, heads_kv, head_dim, causal, budget,
                                                       elem_bytes)
    groups = gemm_bwd_plan.varlen_groups(seqlens_q, seqlens_k, heads_q, budget)
    groups, short = split_short_groups(groups, heads_q // heads_kv) if route == "auto" else (groups, ())
    per_row = 8 * heads_q * sum(seqlens_q) + gemm_bwd_plan.DELTA_SLICE_BYTES
    worst = 0
    for grp in groups:
        n = len(grp.docs)
        p = gemm_bwd_plan.plan(n, grp.pad_q, grp.pad_k, heads_q, causal, budget, shift=grp.shift)
        scratch = gemm_bwd_plan.workspace_bytes(n, grp.pad_q, grp.pad_k, heads_q, heads_kv, head_dim, causal, budget,
                                                elem_bytes)
        keys = 4 * elem_bytes * n * heads_kv * p.keys_stride * head_dim
        index = 26 * n * heads_q * p.padded_q + 17 * n * heads_kv * p.keys_stride
        worst = max(worst, scratch - gemm_bwd_plan.DELTA_SLICE_BYTES + keys + index)
    if not short:
        return per_row + worst

    tq, tk = sum(seqlens_q[i] for i in short), sum(seqlens_k[i] for i in short)
    spec = KernelSpec("ffpa", "bwd", "bfloat16", head_dim, head_dim, heads_q // heads_kv, causal, True)
    shapes = bwd_workspace_shapes(spec, len(short), max(seqlens_q[i] for i in short),
                                  max(seqlens_k[i] for i in short), tq, tk, heads_q, heads_kv)
    fused = sum(4 * math.prod(shape) for _, shape, _, _ in shapes)
    sub = 4 * elem_bytes * (tq * heads_q + tk * heads_kv) * head_dim + 4 * heads_q * tq
    sub += 8 * (tq + tk + 2 * len(short) + 2)
    return max(per_row + worst, sub + fused)


def segments_take_gemms(xp, cu, g: int):
    """Route ``gemm-segments|fused``'s choice on the device: whether the keys an average query row's document
    holds (``sum(n²) / sum(n)`` over the documents of ``cu``, int ``[S + 1]``) reach the measured table at GQA
    group ``g`` (``xp``: ``jax.numpy`` under ``jit``, or numpy). A boolean scalar of ``xp``."""
    lens = (cu[1:] - cu[:-1]).astype(xp.float32)
    per_row = xp.sum(lens * lens) / xp.maximum(xp.sum(lens), 1.0)
    return per_row >= min_keys_for(g)
