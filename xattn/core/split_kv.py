"""Split-KV decode (flash-decoding): the keys of each sequence are split over several CTAs and the
partial outputs merged by their lse. Pure plans and compile keys; :mod:`xattn.core.routes` decides when.

Glossary: B batch, Nq queries per sequence (decoding: 1; speculative decoding: a few), Nk keys per
sequence (the cache), L <= Nk the valid keys of one sequence, Hq/Hkv heads, g = Hq / Hkv, D/Dv head
dims, S key splits, P = S partial slots per sequence (S + 1 with a causal tail), R the rows between two
sequences' first keys in the flat key view (k ``[B, Nk, Hkv, D]`` with strides ``(sB, sN, sH, 1)``:
``R = sB / sN``; contiguous FlashAttention layout: R = Nk; HF's ``[B, Hkv, Nk, D]`` transposed: R = Hkv Nk).

How one call runs (the front ends, :mod:`xattn.torch.split_kv`):

1. **splits**: the family's varlen forward, non-causal, over ``B * (P + 1)`` documents. Document
   ``(b, s)``, ``s < P``, holds the Nq queries of sequence b (``q_split [B*P*Nq, Hq, D]``, q copied once
   per slot; FA4's decode tile reads q's own ``[B*Nq]`` rows instead, :func:`shared_queries`) and keys
   ``[b R + lo_s, b R + hi_s)`` of the flat view ``[R (B-1) + Nk, Hkv, D]`` (:func:`split_bounds`); the tail
   slot of a causal plan has no key here. Document ``(b, P)`` has no query and covers the rows up to sequence
   b + 1, so ``cu_seqlens_k`` never decreases. Writes ``out_partial [B*P*Nq, Hq, Dv]`` (pre-filled 0) and
   ``lse_partial [Hq, B*P*Nq]`` (pre-filled -inf).
2. **causal tail** (``causal`` and Nq > 1 only): query i of Nq sees key p iff p <= L - Nq + i, so every
   key before ``L - min(L, Nq)`` is seen by all queries (the splits, non-causal) and the last
   ``min(L, Nq)`` keys are the tail: a causal varlen forward of the Nq queries on them, written into slot
   ``P - 1``. With one sequence and Nk > Nq (:meth:`SplitPlan.tail_in_place`) that slot is the last Nq
   partial rows: the split launch's documents end before it (:func:`splits_only`), so the tail launch
   writes it in place beside the splits, and no partial needs a pre-fill.
3. **combine**: xattn's combine kernel (:class:`CombineSpec`, :mod:`xattn.core.combine_sm90`) reads the partials as
   ``[P, B, Nq, Hq, Dv]`` / ``[P, B, Nq, Hq]`` views and writes out ``[B, Nq, Hq, Dv]`` and lse
   ``[B, Hq, Nq]`` (natural log): ``lse = log sum_s exp(lse_s)``, ``out = sum_s exp(lse_s - lse) out_s``.
   A row no key reaches gets out 0, lse -inf, as the fused kernels.

**Slot launch** (one sequence, a filled plan, S dividing the keys or FFPA's causal tail: :func:`slot_launch`): the
splits run as the dense forward of batch S instead, q read once per slot through a batch stride of 0 (no copy of q),
keys through a strided view of equal chunks: no index read before the first key (a varlen launch reads its
``cu_seqlens`` first, a dependent round trip to memory on a decode step's critical path); FFPA's causal tail is
its last slot, masked (:func:`slot_launch`), so nothing runs beside it.

**Packed queries** (varlen: ``q [Tq, Hq, D]``, ``k/v [Tk, Hkv, D]``, ``cu_seqlens_q/k``, at most Nq =
``max_seqlen_q`` <= :data:`MAX_DECODE_QUERIES` queries per document: vLLM's and HF continuous batching's decode
steps) run as the dense problem with Nq = ``max_seqlen_q``: document b's ``n_b`` queries are gathered into the
last ``n_b`` of its Nq rows (the rows before them repeat other queries and are dropped), so the causal tail's
bottom-right alignment holds for them (query i sees key p iff p <= L - n_b + i); its keys start at
``cu_seqlens_k[b]`` (``starts``) with L = ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` valid ones, each
document's chunk its own. The rows come back by a gather; rows past ``cu_seqlens_q[-1]`` read out 0, lse -inf.

The partials are rounded to the input dtype (the kernels write out in q's dtype), so the result equals
the fused kernel's within one more rounding of that dtype.

**Decode tiles**: FA4's split launch is compiled with its own tile where :data:`SPLIT_TILES` names one
(:class:`SplitFwdSpec`, built by :mod:`xattn.core.fa4_sm90`): a decode step packs g x Nq query rows per KV head,
a few, so FlashAttention's 128-row tile (two MMA warpgroups) computes mostly padding.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

from .spec import FFPA_FWD_TILE_M, FieldsHashed, KernelSpec, library_versions

__all__ = ["SplitPlan", "CombineSpec", "SlotCallSpec", "slot_work_floats",
           "IndexSpec", "SplitMetaSpec", "SplitFwdSpec", "plan_splits", "splits_only",
           "decode_splits", "split_bounds", "split_cu_seqlens", "split_launch", "slot_launch", "SlotLaunch",
           "SLOT_FAMILIES", "TAIL_SLOT_FAMILIES", "BATCHED_SLOT_FAMILIES", "batched_slot_call", "shared_queries",
           "combine_chunk", "COMBINE_CHUNKS", "MAX_DECODE_QUERIES", "MIN_KEYS_PER_SPLIT", "MAX_PARTIALS", "KEY_TILE",
           "SPLIT_TILES", "source_digest"]

MAX_DECODE_QUERIES = 16  # queries per sequence the route serves (decoding and speculative decoding)
MIN_KEYS_PER_SPLIT = 256  # shorter splits spend more on their prologue and epilogue than they stream
MAX_PARTIALS = 128  # partial slots per sequence the combine launcher is compiled for (2 ** LOG_MAX_PARTIALS)
LOG_MAX_PARTIALS = 7
KEY_TILE = 128  # split bounds are multiples of the kernels' key tile (FFPA 128; FA4 sm90 <= 128)
_FA4_FWD_TILE_M = 128  # FA4 sm90 forward query tile (pack_gqa packs the group's heads into it)


@dataclass(frozen=True)
class SplitPlan:
    """How one call is split: ``splits`` key splits (``S``), ``tail`` (a causal tail slot), ``chunk`` keys
    per split when every sequence holds ``seqlen_k`` keys (``0`` when lengths come per sequence: each
    sequence's chunk is then its own, :func:`split_bounds`). ``filled``: every split has keys and every
    tail query sees one (Nk > Nq), so the launches write every partial row (:meth:`prefill`)."""

    splits: int
    tail: bool
    chunk: int
    filled: bool = False

    @property
    def partials(self) -> int:
        """Partial slots per sequence (``P``)."""
        return self.splits + int(self.tail)

    def tail_in_place(self, batch: int) -> bool:
        """One sequence with a filled tail plan: the tail slot is the last Nq partial rows, past every document
        of the split launch (:func:`splits_only`), and the tail launch writes it in place."""
        return self.tail and self.filled and batch == 1

    def prefill(self, batch: int) -> bool:
        """Whether the partials need the pre-fill (0, -inf): a row no launch writes (an empty split, a tail
        query without a key), or, for a tail copied into its slot (B > 1), the rows its split-launch
        document leaves to FFPA (it skips a document without keys)."""
        return not self.filled or (self.tail and not self.tail_in_place(batch))


def decode_splits(family: str, batch: int, heads_kv: int, g: int, seqlen_q: int, seqlen_k: int,
                  num_sms: int) -> int:
    """The documented rule: how many splits fill the GPU. The fused forward runs
    ``B * Hkv * ceil(Nq g / tile_m)`` CTAs (the GQA heads share a query tile); the split launch multiplies
    that by S, so S = the most splits that still fit one wave of ``num_sms`` CTAs, at most
    ``Nk / MIN_KEYS_PER_SPLIT`` and :data:`MAX_PARTIALS` - 1. Returns 1 (do not split) when fewer than 2."""
    tile_m = FFPA_FWD_TILE_M if family == "ffpa" else _FA4_FWD_TILE_M
    ctas = batch * heads_kv * math.ceil(seqlen_q * g / tile_m)
    if ctas == 0:
        return 1
    s = min(num_sms // ctas, seqlen_k // MIN_KEYS_PER_SPLIT, MAX_PARTIALS - 1)
    return s if s >= 2 else 1


def plan_splits(splits: int, causal: bool, seqlen_q: int, seqlen_k: int | None) -> SplitPlan:
    """The plan of ``splits`` key splits; ``seqlen_k`` None: per-sequence lengths (``cache_seqlens``)."""
    if not 1 <= splits < MAX_PARTIALS:
        raise ValueError(f"num_splits: expected 1-{MAX_PARTIALS - 1}, got {splits}")
    tail = causal and seqlen_q > 1
    if seqlen_k is None:
        return SplitPlan(splits, tail, 0)
    full = _full_keys(seqlen_k, seqlen_q, tail)
    chunk = _chunk(full, splits)
    if full:  # no empty split: chunks are rounded up to the key tile, so fewer may cover every key
        splits = -(-full // chunk)
    return SplitPlan(splits, tail, chunk, filled=bool(full))


def splits_only(plan: SplitPlan) -> SplitPlan:
    """The split launch of a plan whose tail is written in place (:meth:`SplitPlan.tail_in_place`): its S
    splits as a plan without a tail, over each sequence's keys before the tail (``length - Nq``): S documents
    of Nq queries, then the one without a query (its cu_seqlens by :func:`split_cu_seqlens`)."""
    return SplitPlan(plan.splits, False, plan.chunk, True)


SLOT_FAMILIES = ("ffpa", "fa4")  # whose dense forward runs the slot launch (FA4's on its decode tile)
TAIL_SLOT_FAMILIES = ("ffpa",)  # whose slot launch masks a causal tail into its last slot (FA4's: not built)
BATCHED_SLOT_FAMILIES = ("ffpa", "fa4")  # whose B > 1 dense decode steps run as the batched slot call


@dataclass(frozen=True)
class SlotLaunch:
    """The **slot launch** of one sequence (:func:`slot_launch`): S slots ``chunk`` keys apart (``c``), each viewing
    ``keys`` keys (``c``; with ``tail`` the last slot's ``Nk - (S - 1) c``, its causal part inside: a slot b < S - 1
    keeps its own c keys, the last one its keys causally), ``partials`` slots (P = S)."""

    chunk: int
    keys: int
    partials: int
    tail: bool = False


def slot_launch(plan: SplitPlan, family: str, batch: int, length: int, seqlen_q: int) -> SlotLaunch | None:
    """How the splits of one sequence of ``length`` keys run as the **slot launch**, or ``None`` where the varlen
    launch runs them. The split launch is then the family's dense forward over S slots (batch S, no index to read
    before the first key): every slot reads q's own Nq rows through a batch stride of 0 (no copy of q per slot) and
    slot s the keys from ``s c``, ``c = length // S``, through a batch stride of c rows (no copy of the cache). It
    applies to one sequence with a filled plan and either

    * no causal tail and S dividing the keys (:data:`SLOT_FAMILIES`): the keys split evenly, or
    * a causal tail (:data:`TAIL_SLOT_FAMILIES`): every slot views the last slot's ``length - (S - 1) c`` keys
      (c plus the remainder), a mask keeps slot b < S - 1 to its own c and the last slot causal (bottom-right: query
      i sees key p iff p <= length - Nq + i), so no launch runs beside it (:mod:`xattn.core.slot_call_sm90`). The
      last slot holds at least Nq keys (every query sees one).

    Keys left over without a tail (S not dividing the keys) stay on the varlen launch: a launch beside for them
    measured slower (H100, d128 B1, 8200 keys, 10 left over: 0.0296 ms under a CUDA graph, SDPA 0.0268; 8192 keys
    0.0249)."""
    if family not in SLOT_FAMILIES or batch != 1 or not plan.filled:
        return None
    chunk = length // plan.splits  # >= 1: a filled plan has at most one split per key
    keys = length - (plan.splits - 1) * chunk
    if plan.tail:
        if family not in TAIL_SLOT_FAMILIES or keys < seqlen_q:
            return None
        return SlotLaunch(chunk, keys, plan.splits, True)
    return SlotLaunch(chunk, chunk, plan.splits) if keys == chunk else None


def batched_slot_call(plan: SplitPlan, family: str, batch: int) -> bool:
    """Whether the splits of ``batch`` > 1 sequences, each holding all its keys, run as the **batched slot call**
    (:class:`SlotCallSpec` ``batched``: the copy of q per slot, the varlen split launch, the causal tail as the dense
    causal forward of q on the last Nq keys, and the combine in one host function; :data:`BATCHED_SLOT_FAMILIES`):
    a filled plan, so every partial row is written (no pre-fill)."""
    return batch > 1 and family in BATCHED_SLOT_FAMILIES and plan.filled


def _full_keys(length: int, seqlen_q: int, tail: bool) -> int:
    """Keys every query sees (the splits' share): all of them, or all before the causal tail."""
    return length - min(length, seqlen_q) if tail else length


def _chunk(keys: int, splits: int) -> int:
    return -(-max(keys, 1) // (splits * KEY_TILE)) * KEY_TILE


def split_bounds(plan: SplitPlan, length: int, seqlen_q: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` per slot of one sequence of ``length`` valid keys (host ints): S splits over the
    keys every query sees, then the tail ``(length - min(length, Nq), length)`` if ``plan.tail``."""
    full = _full_keys(length, seqlen_q, plan.tail)
    chunk = plan.chunk or _chunk(full, plan.splits)
    out = [(min(s * chunk, full), min((s + 1) * chunk, full)) for s in range(plan.splits)]
    if plan.tail:
        out.append((full, length))
    return out


def split_cu_seqlens(plan: SplitPlan, seqlen_q: int, rows_per_seq: int, lengths: list[int],
                     key_rows: int, starts: list[int] | None = None
                     ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host int lists ``(cu_q, cu_k)`` of the split launch and ``(tail_cu_q, tail_cu_k)`` of the tail launch
    (empty without a tail), for sequences of ``lengths`` valid keys whose keys start every ``rows_per_seq``
    rows of a flat key view of ``key_rows`` rows, or at ``starts[b]`` (packed keys: ``cu_seqlens_k[:-1]``).

    Split launch: ``B * (P + 1)`` documents (module docstring), queries ``q_split [B*P*Nq]``. Tail launch:
    ``2 B`` documents, per sequence one without a query (the rows before its tail) and one with its Nq
    queries (q's own rows ``[B*Nq]``) on its tail keys."""
    cu_q, cu_k, tail_q, tail_k = [0], [0], [0], [0]
    for b, length in enumerate(lengths):
        base = b * rows_per_seq if starts is None else starts[b]
        bounds = split_bounds(plan, length, seqlen_q)
        for s, (lo, hi) in enumerate(bounds):
            cu_q.append(cu_q[-1] + seqlen_q)
            cu_k.append(base + (lo if plan.tail and s == plan.splits else hi))  # the tail slot: no key here
        cu_q.append(cu_q[-1])  # no query: the rows up to the next sequence
        last = b == len(lengths) - 1
        cu_k.append(key_rows if last else base + rows_per_seq if starts is None else starts[b + 1])
        if plan.tail:
            lo, hi = bounds[-1]
            tail_q += [tail_q[-1], tail_q[-1] + seqlen_q]
            tail_k += [base + lo, base + hi]
    return cu_q, cu_k, (tail_q if plan.tail else []), (tail_k if plan.tail else [])


@dataclass(frozen=True)
class IndexSpec(FieldsHashed):
    """Compile key of a split route's index launcher (a subclass per route: :class:`SplitMetaSpec`,
    :class:`xattn.core.paged.PagedMetaSpec`): one small kernel writes what the route's launches read, with ``tail``
    the causal tail's, with ``packed`` the gathers of packed queries, and the partials' lse pre-fill. Goes through
    the launcher and disk caches as the combine does; ``family`` only names the entry (the kernel moves int32
    indices)."""

    family: str
    tail: bool
    packed: bool = False
    arch: str = "sm_90a"
    versions: tuple[tuple[str, str], ...] = field(default_factory=library_versions)

    __hash__ = FieldsHashed.cached_hash
    NAME = "index"  # the entry's name (a class attribute, not a field)

    def short_name(self) -> str:
        # "<family>_fwd_" prefix: the disk cache's own-file pattern (``cache clear`` removes these too)
        return f"{self.family}_fwd_{self.NAME}{'_tail' * self.tail}{'_packed' * self.packed}_{self.arch}"

    def target_name(self) -> str:
        digest = hashlib.sha256(repr(self.versions).encode()).hexdigest()[:10]
        return f"xattn_{self.short_name()}_{digest}"


class SplitMetaSpec(IndexSpec):
    """The contiguous split route's index launcher (:mod:`xattn.core.split_meta_sm90`): the split launch's
    ``cu_seqlens_k`` from device lengths (and the tail launch's)."""

    NAME = "split_meta"


@functools.cache
def _module_digest(name: str) -> str:
    return hashlib.sha256((Path(__file__).resolve().parent / name).read_bytes()).hexdigest()[:16]


def shared_q_digest() -> str:
    """Digest of the shared-q split launcher's source (:mod:`xattn.core.split_q_sm90`; part of SplitFwdSpec's key)."""
    return _module_digest("split_q_sm90.py")


def source_digest() -> str:
    """Digest of the combine launcher's source (part of its compile key)."""
    return _module_digest("combine_sm90.py")


# Partials one combine thread loads at once (:mod:`xattn.core.combine_sm90`), a launcher compiled per value; the
# route takes :func:`combine_chunk`.
COMBINE_CHUNKS = (4, 8, 16)


def combine_chunk(partials: int) -> int:
    """The combine's chunk for ``partials`` slots per sequence: the smallest of :data:`COMBINE_CHUNKS` that holds
    them all (one round trip to memory), else the largest (chunks in turn). The kernel's code grows with its chunk,
    and a chunk past P costs time though its extra loads are skipped (H100, d128, CUDA graph, L2 flushed: at 2
    partials chunk 4 runs 2.1 us, chunk 16 3.1; at 16 partials chunk 16 3.3 us, chunk 4 3.7; docs/benchmarks.md,
    "The one-pass combine: its chunk and PDL")."""
    return next((c for c in COMBINE_CHUNKS if c >= partials), COMBINE_CHUNKS[-1])


@dataclass(frozen=True)
class CombineSpec(FieldsHashed):
    """Compile key of the combine launcher (:mod:`xattn.core.combine_sm90`): ``dtype`` of out and of the partials,
    ``head_dim_v`` (Dv), up to :data:`MAX_PARTIALS` slots, ``chunk`` partials loaded at once per thread (any P is
    merged right; :func:`combine_chunk` picks the fastest). Goes through the same launcher and disk caches as
    :class:`~xattn.core.spec.KernelSpec`; ``family`` only names the entry."""

    family: str
    dtype: str
    head_dim_v: int
    chunk: int = COMBINE_CHUNKS[-1]
    arch: str = "sm_90a"
    source: str = field(default_factory=source_digest)
    versions: tuple[tuple[str, str], ...] = field(default_factory=library_versions)

    __hash__ = FieldsHashed.cached_hash

    def short_name(self) -> str:
        # "<family>_fwd_" prefix: the disk cache's own-file pattern, so `cache clear` removes these too
        return f"{self.family}_fwd_combine_{self.dtype}_d{self.head_dim_v}_p{MAX_PARTIALS}_c{self.chunk}_{self.arch}"

    def target_name(self) -> str:
        digest = hashlib.sha256(repr((self.versions, self.source)).encode()).hexdigest()[:10]
        return f"xattn_{self.short_name()}_{digest}"


# FA4 (head_dim, head_dim_v) -> (tile_m, tile_n) of the split launch. d128, H100 (benchmarks/tools/decode_tile_probe.py,
# docs/benchmarks.md "Decode tiles and a PDL combine for d128"): 64x64 takes 1-2.5 us off a decode call against
# FlashAttention's 128x128 (one MMA warpgroup instead of two; two CTAs fit an SM). Other head dims: not measured.
SPLIT_TILES = {(128, 128): (64, 64)}


@dataclass(frozen=True)
class SplitFwdSpec(KernelSpec):
    """Compile key of FA4's split launch built with the decode tile ``tile_m x tile_n`` (:data:`SPLIT_TILES`;
    ``tile_m`` 64 or 128: one MMA warpgroup per 64 query rows): the varlen (or, for the slot launch, dense)
    non-causal, windowless forward it replaces in every other respect (the same launcher signature, buffers and
    pre-fills; :mod:`xattn.core.fa4_sm90` builds both), or with ``page_size == tile_n`` the paged split launch's
    (:mod:`xattn.core.paged_sm90`). With
    ``shared_q`` (contiguous only) the launch reads q ``[B*Nq, Hq, D]`` as it is: document ``(b, s)`` loads sequence
    b's rows, so no copy of q per slot (:func:`shared_queries`)."""

    tile_m: int = 64
    tile_n: int = 64
    shared_q: bool = False
    source: str = field(default_factory=shared_q_digest)  # split_q_sm90.py's: it builds the shared-q launch

    __hash__ = FieldsHashed.cached_hash

    def __post_init__(self):
        if self.tile_m not in (64, 128) or self.tile_n % 16 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"SplitFwdSpec: tile_m 64 or 128 and tile_n a multiple of 16 in 16-256, got "
                             f"{self.tile_m}x{self.tile_n}")
        if self.shared_q and (not self.varlen or self.qhead_per_kvhead < 2):
            raise ValueError("SplitFwdSpec: shared_q is the contiguous (varlen) split launch's, with g > 1")
        super().__post_init__()

    @property
    def num_threads(self) -> int:
        """Threads per CTA: a producer warpgroup and one MMA warpgroup per 64 query rows."""
        return 128 * (self.tile_m // 64 + 1)

    def short_name(self) -> str:
        return (f"{super().short_name().removesuffix('_' + self.arch)}_t{self.tile_m}x{self.tile_n}"
                f"{'_sq' * self.shared_q}_{self.arch}")


def shared_queries(family: str, head_dim: int, head_dim_v: int, g: int) -> bool:
    """Whether the contiguous split launch of these head dims and GQA ratio ``g`` reads q without a copy per slot
    (``shared_q``, :mod:`xattn.core.split_q_sm90`): FA4 on its decode tile with the group's heads packed into its
    rows (FlashAttention loads an unpacked q by TMA only, whose reads past a document nothing would bound there).
    The launch's documents are the route's (:func:`split_cu_seqlens`), its q the call's own ``[B*Nq, Hq, D]``; the
    other launches take q once per slot."""
    return family == "fa4" and (head_dim, head_dim_v) in SPLIT_TILES and g > 1


def slot_call_digest() -> str:
    """Digest of the slot call's sources (:mod:`xattn.core.slot_call_sm90` and the combine it inlines)."""
    return _module_digest("slot_call_sm90.py") + _module_digest("combine_sm90.py")


@dataclass(frozen=True)
class SlotCallSpec(FieldsHashed):
    """Compile key of the **slot call** (:mod:`xattn.core.slot_call_sm90`): the slot launch of one sequence
    (:func:`slot_launch`), with ``tail`` its causal tail in the last slot (:data:`TAIL_SLOT_FAMILIES`: FFPA's forward
    with a mask), and the combine as one host function: a decode step's one TVM-FFI call. The split launch inside is
    :meth:`launch_spec` (the family's dense non-causal forward, FA4's on its decode tile; with ``batched`` the varlen
    one, its tail the launch :meth:`tail_spec`); ``chunk`` the combine's (:func:`combine_chunk` of P). Goes through
    the launcher and disk caches as the combine does."""

    family: str
    dtype: str
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int
    chunk: int = COMBINE_CHUNKS[-1]
    tail: bool = False
    batched: bool = False
    arch: str = "sm_90a"
    source: str = field(default_factory=slot_call_digest)
    versions: tuple[tuple[str, str], ...] = field(default_factory=library_versions)

    __hash__ = FieldsHashed.cached_hash

    def __post_init__(self):
        if self.chunk not in COMBINE_CHUNKS:
            raise ValueError(f"SlotCallSpec: chunk one of {COMBINE_CHUNKS}, got {self.chunk}")
        if self.tail and not self.batched and self.family not in TAIL_SLOT_FAMILIES:  # (batched: its own launch)
            raise ValueError(f"SlotCallSpec: a causal tail in the last slot is {TAIL_SLOT_FAMILIES}'s, not "
                             f"{self.family!r}'s")
        if self.batched and self.family not in BATCHED_SLOT_FAMILIES:
            raise ValueError(f"SlotCallSpec: the batched slot call is {BATCHED_SLOT_FAMILIES}'s, not {self.family!r}'s")
        super().__post_init__()

    def _forward(self, causal: bool, varlen: bool) -> KernelSpec:
        return KernelSpec(self.family, "fwd", self.dtype, self.head_dim, self.head_dim_v, self.qhead_per_kvhead,
                          causal, varlen, arch=self.arch)

    def launch_spec(self) -> KernelSpec:
        """The split launch inside: the non-causal forward of these dims (:func:`split_launch_spec`), dense (varlen
        when ``batched``, reading q's own rows where :func:`shared_queries` holds)."""
        return split_launch_spec(self._forward(False, self.batched), shared_q=self.batched)

    @property
    def shared_q(self) -> bool:
        """The batched call's split launch reads q ``[B, Nq, Hq, D]`` as ``[B Nq, Hq, D]`` rows (no copy per slot:
        :func:`shared_queries`), so q's sequences must be Nq rows apart (``stride(0) == Nq stride(1)``)."""
        return self.batched and shared_queries(self.family, self.head_dim, self.head_dim_v, self.qhead_per_kvhead)

    def tail_spec(self) -> KernelSpec | None:
        """The batched call's causal tail launch (the family's dense causal forward), ``None`` without one (one
        sequence: the tail is the split launch's last slot)."""
        return self._forward(True, False) if self.tail and self.batched else None

    def short_name(self) -> str:
        # "<family>_fwd_" prefix: the disk cache's own-file pattern, so `cache clear` removes these too
        return (f"{self.family}_fwd_slotcall_{self.dtype}_d{self.head_dim}x{self.head_dim_v}_g{self.qhead_per_kvhead}"
                f"_c{self.chunk}{'_tail' * self.tail}{'_batched' * self.batched}_{self.arch}")

    def target_name(self) -> str:
        digest = hashlib.sha256(repr((self.versions, self.source)).encode()).hexdigest()[:10]
        return f"xattn_{self.short_name()}_{digest}"


def slot_work_floats(partials: int, seqlen_q: int, heads_q: int, head_dim_v: int, batch: int = 1,
                     head_dim: int | None = None) -> int:
    """Floats of the slot call's ``work`` buffer: ``out_partial [P, Nq, Hq, Dv]`` (16-bit) then ``lse_partial
    [P, Hq, Nq]`` (f32), P the splits and the tail's slot; the batched call's (``head_dim`` D given):
    ``q_split [B P Nq, Hq, D]`` and ``out_partial [B P Nq, Hq, Dv]`` (16-bit), then ``lse_partial [Hq, B P Nq]``."""
    if head_dim is None:
        return partials * seqlen_q * heads_q * (head_dim_v // 2 + 1)
    return batch * partials * seqlen_q * heads_q * (head_dim // 2 + head_dim_v // 2 + 1)


def split_launch(checked: tuple, shared_q: bool = False) -> tuple:
    """``(spec, problem)`` of a split launch (the family's varlen non-causal forward) -> the same with the
    decode tile's :class:`SplitFwdSpec` where :data:`SPLIT_TILES` names one (``shared_q``: the one reading q
    ``[B*Nq, Hq, D]`` as it is, where :func:`shared_queries` holds; ``problem`` is still the slot-copied call's)."""
    spec, problem = checked
    return split_launch_spec(spec, shared_q), problem


def split_launch_spec(spec: KernelSpec, shared_q: bool = False) -> KernelSpec:
    """:func:`split_launch` on the spec alone; also the slot launch's (the dense forward: :func:`slot_launch`) and
    the paged split launch's (dense queries, pages of exactly ``tile_n`` rows, read by TMA:
    :func:`xattn.core.paged.tma_page_rows` views larger pages as such)."""
    tile = SPLIT_TILES.get((spec.head_dim, spec.head_dim_v))
    contiguous = spec.varlen and spec.page_size is None
    paged = not spec.varlen and tile is not None and spec.page_size == tile[1]
    if (tile is None or spec.family != "fa4" or type(spec) is not KernelSpec or spec.direction != "fwd"
            or spec.causal or spec.is_local or not (paged or spec.page_size is None)):  # paged, varlen or dense
        return spec
    return _tiled(spec, tile, shared_q and contiguous and spec.qhead_per_kvhead > 1)


@functools.lru_cache(maxsize=512)  # a paged decode step asks on every call: each key is built once
def _tiled(spec: KernelSpec, tile: tuple[int, int], shared_q: bool = False) -> SplitFwdSpec:
    fields = {f: getattr(spec, f) for f in KernelSpec.__dataclass_fields__}
    return SplitFwdSpec(**fields, tile_m=tile[0], tile_n=tile[1], shared_q=shared_q)
