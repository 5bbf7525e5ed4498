"""Planner of the chunked-GEMM backward for FFPA head dims (320-512): route choice, block plan, memory bound.

FFPA's fused backward holds dK, dV and dQ accumulators of a 512-wide head in one kernel and
reaches ~230-250 TFLOP/s on the H200. This route runs the backward as large GEMMs instead,
per block of ``rows`` query rows, with all ``g = Hq / Hkv`` query heads of a KV head stacked
into the GEMM's M (``g * rows`` rows), batched over ``L = B * Hkv``:

=====  ============================================  ==========================================
step   GEMM (M x N x K)                               fused epilogue / output
=====  ============================================  ==========================================
1      ``S = Q Kᵀ``  (g·rows x kend x D)              ``P = exp2(S·scale·log2e − lse·log2e)``,
                                                      masked → 0; P written in q's dtype AND fp16
2      ``dP = dO Vᵀ`` (g·rows x kend x D)             ``dS = P16 ⊙ (dP − δ) · scale`` (16-bit)
3      ``dV += Pᵀ dO`` (kend x D x g·rows)            fp32 accumulator (C = D)
4      ``dK += dSᵀ Q`` (kend x D x g·rows)            fp32 accumulator
5      ``dQ = dS K``   (g·rows x D x kend)            16-bit, once per block
=====  ============================================  ==========================================

``δ = rowsum(dO ⊙ O)`` (from the caller's out: merged out/lse of a ring work as they do for
FFPA). ``kend`` is the block's causal key limit, so key blocks past the diagonal are never
computed. A causal block can also be cut along its diagonal (``pieces``, :data:`DIAGONAL_PIECES`):
each piece of its rows computes steps 1, 2 and 5 only up to its own key limit, and steps 3-4 run
per key range over the rows of the pieces that see it, so a block of ``rows`` rows computes
~rows²/(2·pieces) of masked work instead of rows²/2 (the torch driver; JAX computes each block
whole). It measured slower on the H200, so the default keeps blocks whole.

dS is formed from a second copy of P in fp16 (P16; :data:`xattn.core.gemm_sm90.P_DTYPES`): with the
bf16 P the gradient error vs fp64 reached 1.86x FFPA's on the H200 (mean 1.13x), with an fp32 copy
1.00x (mean 0.996x). dS itself is rounded to 16 bits, so fp16's 11 significant bits add little to
that, and the P and dS GEMMs, whose epilogues move ~as many bytes as their mainloops take time,
write and read 2 bytes per score instead of 4. P <= 1 with the forward's lse (fp16 holds up to 65504:
an lse more than ~11 below the true one would overflow, where it already gave wrong gradients).

This module is the framework-neutral planner: the blocks (:func:`plan`), the memory they take
(:func:`workspace_bytes`) and, for packed (varlen) problems, the document groups (:func:`varlen_groups`):
documents of similar length are padded to one length and run as one dense batch, so many short
documents share each GEMM launch and no block ever straddles two documents (per-row positions mask
the padding). The GEMMs are quack's sm90 CuTeDSL GEMMs (:mod:`xattn.core.gemm_sm90`) with the epilogues of
:mod:`xattn.core.gemm_bwd_epilogues`; the front ends' drivers run them (:mod:`xattn.torch.gemm_bwd`,
:mod:`xattn.jax.gemm_bwd`).

Which backward a problem gets (and ``XATTN_BWD_ROUTE``) is :mod:`xattn.core.routes`' decision; this module
holds only the pure plans. Environment: ``XATTN_GEMM_BWD_BUDGET_MIB`` (default 2048) caps the per-block
P/dS buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .workspace import round_up

__all__ = ["GemmBwdPlan", "DocGroup", "plan", "workspace_bytes", "budget_bytes", "budget_setting", "varlen_groups",
           "keys_per_row", "SegmentPlan", "segment_plan", "segment_offsets", "segment_block_tables", "segment_launches",
           "segment_workspace_bytes"]

DEFAULT_BUDGET_MIB = 2048
BYTES_PER_SCORE = 6  # P (q's dtype) + P (fp16) + dS (16-bit) per query-row x key element of a block
MIN_BLOCK_ROWS = 64
# Causal: a block computes its diagonal rows x rows square whole, so longer blocks waste ~rows/N of
# the work. H200, d512 Hq16/Hkv16 causal N 8k bf16 fwd+bwd (benchmarks/results/bwd_routes_h200.json):
# rows 2048 (the budget's) -> 1024: torch 356.1 -> 384.1 TFLOP/s, JAX 407.9 -> 411.9.
CAUSAL_MAX_ROWS = 1024
# Causal: the diagonal square of a block may be cut into pieces of rows, each computed only up to its
# own key limit (rounded up to ROW_ALIGN), so a block wastes ~rows²/(2·pieces) instead of rows²/2
# (see plan()). Measured slower on the H200 (benchmarks/tools/diag_pieces_probe.py,
# results/logs/diag_pieces_probe_h200.log; torch backward TFLOP/s, rows 1024, pieces 1 / 2 / 4):
#   Hq16/Hkv16 causal 8k 388.9 / 371.8 / 344.9, 16k 405.0 / 394.0 / 372.8
#   Hq32/Hkv4 causal 8k 390.5 / 398.2 / 370.8, 16k 439.9 / 429.3 / 424.8
# The smaller GEMMs lose more to their tails than the skipped work saves, so blocks stay whole.
DIAGONAL_PIECES = 1
ROW_ALIGN = 8  # P / dS / colpos row strides are padded to 8 elements (16-byte TMA strides)
DELTA_SLICE_BYTES = 64 << 20  # the torch driver computes δ = rowsum(dO ⊙ O) in slices of this much scratch


def budget_setting() -> str:
    """``XATTN_GEMM_BWD_BUDGET_MIB`` as set (default 2048), not validated (a forward records it unread)."""
    return os.environ.get("XATTN_GEMM_BWD_BUDGET_MIB", str(DEFAULT_BUDGET_MIB))


def budget_bytes(setting: str | None = None) -> int:
    """``setting`` (default :func:`budget_setting`) in bytes, validated: the cap on one block's P (q's dtype
    and fp16) and dS buffers."""
    raw = budget_setting() if setting is None else setting
    try:
        mib = int(raw)
    except ValueError:
        raise ValueError(f"XATTN_GEMM_BWD_BUDGET_MIB={raw!r} is not an integer") from None
    if mib < 1:
        raise ValueError(f"XATTN_GEMM_BWD_BUDGET_MIB={mib} must be >= 1")
    return mib << 20


@dataclass(frozen=True)
class GemmBwdPlan:
    """Blocks of one backward: ``rows`` query rows each, ``blocks[c] = (row_start, kend)``, and
    ``pieces[c]``: the block's rows cut along its causal diagonal, ``(lo, hi, keys)`` = rows
    ``[lo, hi)`` of the block (relative to its start; up to its last real row) see only its first
    ``keys`` keys. ``keys`` grows with ``lo``, is a multiple of :data:`ROW_ALIGN` except the last
    piece's (``kend``), and is at least every row's causal limit; non-causal blocks are one piece."""

    rows: int
    num_blocks: int
    padded_q: int
    keys_stride: int
    blocks: tuple
    pieces: tuple


def plan(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, causal: bool,
         budget: int | None = None, rows: int | None = None, shift: int | None = None,
         pieces: int | None = None) -> GemmBwdPlan:
    """Block rows from the budget (P, fp16 P and dS of one block fit ``budget`` bytes; causal:
    at most :data:`CAUSAL_MAX_ROWS`; the fewest blocks that fit, of equal 64-row multiples) and each
    block's key limit ``kend`` (bottom-right causal: row i sees keys ``j <= i + shift``,
    ``shift = Nk - Nq`` unless given: a group of padded documents passes its largest ``nk - nq``).
    Causal blocks are cut into ``pieces`` (default :data:`DIAGONAL_PIECES`) of whole 64-row multiples
    along the diagonal."""
    budget = budget_bytes() if budget is None else budget
    keys_stride = round_up(max(seqlen_k, 1), ROW_ALIGN)
    if rows is None:
        rows = budget // (BYTES_PER_SCORE * batch * heads_q * keys_stride)
        if causal:
            rows = min(rows, CAUSAL_MAX_ROWS)
        rows = max(MIN_BLOCK_ROWS, rows // MIN_BLOCK_ROWS * MIN_BLOCK_ROWS)
        # the fewest blocks that fit, evened out (no short tail block)
        rows = round_up(-(-max(seqlen_q, 1) // -(-max(seqlen_q, 1) // rows)), MIN_BLOCK_ROWS)
    num_blocks = -(-seqlen_q // rows)
    shift = seqlen_k - seqlen_q if shift is None else shift
    pieces = DIAGONAL_PIECES if pieces is None else pieces
    if pieces < 1:
        raise ValueError(f"pieces={pieces} must be >= 1")
    blocks, cuts = [], []
    for c in range(num_blocks):
        kend = max(min(seqlen_k, (c + 1) * rows + shift) if causal else seqlen_k, 0)
        blocks.append((c * rows, kend))
        cuts.append(_pieces(c * rows, min(rows, seqlen_q - c * rows), kend, seqlen_k, shift, pieces if causal else 1))
    return GemmBwdPlan(rows, num_blocks, num_blocks * rows, keys_stride, tuple(blocks), tuple(cuts))


def _pieces(start: int, rows: int, kend: int, seqlen_k: int, shift: int, pieces: int) -> tuple:
    """``(lo, hi, keys)`` of a block's ``rows`` real rows (see :class:`GemmBwdPlan`: the last piece
    ends at the last real row, padded rows are not computed); pieces without keys are dropped (their
    rows see no key: the drivers zero their dq)."""
    step = max(MIN_BLOCK_ROWS, round_up(-(-rows // pieces), MIN_BLOCK_ROWS))
    out = []
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        keys = kend if hi == rows else min(kend, round_up(max(min(seqlen_k, start + hi + shift), 0), ROW_ALIGN))
        if keys > 0:
            out.append((lo, hi, keys))
    return tuple(out)


def workspace_bytes(batch: int, seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int,
                    head_dim: int, causal: bool, budget: int | None = None, elem_bytes: int = 2) -> int:
    """Upper bound of the scratch one backward allocates beyond its dq/dk/dv outputs.

    ``6·B·Hq·rows·Nk8`` (P 16-bit + P fp16 + dS, one block) ``+ 8·B·Hkv·Nk·D`` (dK/dV fp32
    accumulators) ``+ 3·elem·B·Hq·Nq_pad·D`` (row-permuted q, dout, dq) ``+ 2·elem·B·Hkv·Nk8·D``
    (K/V in block order) ``+ 20·B·Hq·Nq_pad`` (δ, lse, row positions) ``+ 4·B·Hkv·Nk8`` (key
    positions) ``+`` :data:`DELTA_SLICE_BYTES` (δ's temporaries). ``rows`` comes from the budget, so
    the first term is at most ``max(budget, 6·B·Hq·64·Nk8)``. The torch driver reads q/dout/K/V in
    place where their layout allows (B == 1), so it may stay well under this.
    """
    p = plan(batch, seqlen_q, seqlen_k, heads_q, causal, budget)
    scores = BYTES_PER_SCORE * batch * heads_q * p.rows * p.keys_stride
    acc = 8 * batch * heads_kv * seqlen_k * head_dim
    rows_perm = 3 * elem_bytes * batch * heads_q * p.padded_q * head_dim
    keys = 2 * elem_bytes * batch * heads_kv * p.keys_stride * head_dim
    vectors = 20 * batch * heads_q * p.padded_q + 4 * batch * heads_kv * p.keys_stride
    return scores + acc + rows_perm + keys + vectors + DELTA_SLICE_BYTES


# --- packed (varlen) problems: documents grouped by padded length ------------------------------

GROUP_ALIGN = 64  # a group's padded lengths: its longest document's, rounded up to a multiple of this
GROUP_FILL = 0.875  # a document joins a group when both its lengths are >= this share of the group's first


def keys_per_row(seqlens_q, seqlens_k) -> int:
    """The keys an average query row's document holds: ``sum(nq·nk) / sum(nq)`` (0 without rows)."""
    rows = sum(seqlens_q)
    return sum(a * b for a, b in zip(seqlens_q, seqlens_k)) // rows if rows else 0


@dataclass(frozen=True)
class DocGroup:
    """Documents run as one dense batch: ``docs`` (indices into the packed batch), their query and
    key lengths padded to ``pad_q`` / ``pad_k``, ``shift`` (the largest ``nk - nq``: the causal
    limit of its blocks) and whether some document has fewer keys than ``pad_k`` (``masked_keys``:
    a non-causal group then masks the padding by position)."""

    docs: tuple
    pad_q: int
    pad_k: int
    shift: int
    masked_keys: bool


def varlen_groups(seqlens_q, seqlens_k, heads_q: int, budget: int | None = None) -> list[DocGroup]:
    """Documents run as dense batches, longest first: a group takes documents (by decreasing length)
    while both of their lengths are at least :data:`GROUP_FILL` of its first document's or round
    up to the same multiple of :data:`GROUP_ALIGN` (so the padding costs at most ~1/4 of a
    document's work beyond that alignment, typically far less), padded to the first
    document's lengths rounded up to :data:`GROUP_ALIGN`. Documents without query rows or without
    keys are left out (their gradients are 0). A group also ends where one block of
    :data:`MIN_BLOCK_ROWS` rows of all its documents would pass the ``budget``."""
    budget = budget_bytes() if budget is None else budget
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(f"{len(seqlens_q)} query lengths but {len(seqlens_k)} key lengths")
    for i, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k)):
        if nq < 0 or nk < 0:
            raise ValueError(f"document {i}: negative length ({nq} queries, {nk} keys)")
    order = sorted((i for i, (nq, nk) in enumerate(zip(seqlens_q, seqlens_k)) if nq and nk),
                   key=lambda i: (-max(seqlens_q[i], seqlens_k[i]), -seqlens_q[i], i))
    groups, part = [], []

    def close():
        first = part[0]
        pq, pk = round_up(seqlens_q[first], GROUP_ALIGN), round_up(seqlens_k[first], GROUP_ALIGN)
        shift = max(seqlens_k[i] - seqlens_q[i] for i in part)
        masked = any(seqlens_k[i] < pk for i in part)
        groups.append(DocGroup(tuple(part), pq, pk, max(shift, pk - pq), masked))

    for i in order:
        if part:
            first = part[0]
            fits = all(n <= top and (n >= GROUP_FILL * top or round_up(n, GROUP_ALIGN) == round_up(top, GROUP_ALIGN))
                       for n, top in ((seqlens_q[i], seqlens_q[first]), (seqlens_k[i], seqlens_k[first])))
            per_doc = BYTES_PER_SCORE * heads_q * MIN_BLOCK_ROWS * round_up(seqlens_k[first], GROUP_ALIGN)
            if not fits or (len(part) + 1) * per_doc > budget:
                close()
                part = []
        part.append(i)
    if part:
        close()
    return groups


# --- packed problems under jit: one GEMM per row block over every document (traced lengths) -------

SEGMENT_ROWS = 512  # row block of the segmented route: a document of L rows computes ~L·rows/2 masked
# work past its diagonal (blocks are whole); counted on benchmarks/packed.py's mixes, work / causal work:
# mix16k 1.10x / 1.21x / 1.45x and mix64k 1.06x / 1.13x / 1.27x at 256 / 512 / 1024 rows, while each
# halving doubles the launches (5 per block)
# each document's dK/dV accumulator rows start at a multiple of this: seg_acc's cluster of two 128-row tiles
# stores whole tiles, up to 256 rows past a piece's first key row (no two documents share one)
SEGMENT_ACC_ALIGN = 256


@dataclass(frozen=True)
class SegmentPlan:
    """Static plan of the segmented GEMM backward (:mod:`xattn.core.gemm_segments_sm90`) for ``total``
    packed tokens in at most ``slots`` documents of at most ``max_seqlen`` tokens each.

    ``blocks[c] = (kend, max_rows)``: block c's key count (every piece's scores span keys
    ``[0, kend)`` of its document) and a bound on its rows per KV head, in tokens (a document of L
    tokens has ``min(rows, L − c·rows)`` rows in it, at most ``L / (c + 1)``; so at most
    ``total // (c + 1)`` and ``slots · rows``). ``head_groups``: ``(first, count)`` KV heads per launch
    (the block's scores fit the budget). ``spare_keys``: rows after each head's keys that the
    overlapping key view may read; ``acc_rows``: accumulator rows per KV head."""

    rows: int
    blocks: tuple
    head_groups: tuple
    spare_keys: int
    acc_rows: int


def segment_plan(total: int, slots: int, max_seqlen: int, heads_q: int, heads_kv: int, causal: bool,
                 budget: int | None = None, rows: int | None = None) -> SegmentPlan:
    """The blocks and launches of one segmented backward (see :class:`SegmentPlan`). ``rows``
    (default :data:`SEGMENT_ROWS`, halved down to :data:`MIN_BLOCK_ROWS` until one KV head's block
    fits ``budget``) is a multiple of :data:`ROW_ALIGN`."""
    budget = budget_bytes() if budget is None else budget
    g = heads_q // heads_kv
    longest = round_up(max(min(max_seqlen, total), 1), ROW_ALIGN)
    fixed = rows is not None
    rows = SEGMENT_ROWS if rows is None else rows
    if rows < ROW_ALIGN or rows % ROW_ALIGN:
        raise ValueError(f"rows={rows}: expected a positive multiple of {ROW_ALIGN}")

    def blocks_of(r):
        out = []
        for c in range(-(-longest // r)):
            kend = min((c + 1) * r, longest) if causal else longest
            out.append((kend, max(1, min(total // (c + 1), slots * r, total))))
        return tuple(out)

    def head_bytes(bl):  # the largest block's P, fp16 P and dS for one KV head
        return max(BYTES_PER_SCORE * g * m * kend for kend, m in bl)

    blocks = blocks_of(rows)
    while not fixed and rows > MIN_BLOCK_ROWS and head_bytes(blocks) > budget:
        rows //= 2
        blocks = blocks_of(rows)
    per_launch = max(1, min(heads_kv, budget // max(head_bytes(blocks), 1)))
    while heads_kv % per_launch:
        per_launch -= 1
    groups = tuple((h, per_launch) for h in range(0, heads_kv, per_launch))
    acc_rows = round_up(total + slots * (SEGMENT_ACC_ALIGN - 1), SEGMENT_ACC_ALIGN)
    return SegmentPlan(rows, blocks, groups, max(kend for kend, _ in blocks), acc_rows)


def segment_offsets(xp, cu):
    """``(lens, starts, acc_starts)`` of the documents of ``cu`` (int ``[S + 1]``) with the array module
    ``xp`` (numpy on the host, ``jax.numpy`` under ``jit``): each document's first row in the fp32
    dK/dV accumulators is a multiple of :data:`SEGMENT_ACC_ALIGN`."""
    lens, starts = cu[1:] - cu[:-1], cu[:-1]
    acc = -(-lens // SEGMENT_ACC_ALIGN) * SEGMENT_ACC_ALIGN
    return lens, starts, xp.concatenate([xp.zeros((1,), acc.dtype), xp.cumsum(acc)])[:-1]


def segment_block_tables(xp, lens, starts, acc_starts, heads, c: int, rows: int, kend: int, total: int,
                         spare: int, acc_rows: int, g: int):
    """The tables of block ``c`` for KV heads ``heads`` (int ``[hg]``) over the documents of
    :func:`segment_offsets`: ``(tables int32 [4, P + 1], cu_rows int32 [P + 1])`` with P = hg·S pieces,
    head-major (rows as :mod:`xattn.core.gemm_segments_sm90` documents; query side ``[Hkv, total, g, D]``,
    key side ``[Hkv, total + spare, D]``, accumulators ``[Hkv, acc_rows, D]``)."""
    h = xp.asarray(heads, lens.dtype)[:, None]
    rows_in = xp.broadcast_to(xp.clip(lens - c * rows, 0, rows)[None, :], (h.shape[0], lens.shape[0]))
    has = rows_in > 0
    q_off = xp.where(has, (h * total + starts[None] + c * rows) * g, 0)
    k_start = xp.where(has, h * (total + spare) + starts[None], 0)
    a_off = xp.where(has, h * acc_rows + acc_starts[None], 0)
    keys = xp.where(has, xp.minimum(kend, lens[None]), 0)

    def cumsum0(x):
        return xp.concatenate([xp.zeros((1,), x.dtype), xp.cumsum(x)])

    flat = lambda x: xp.concatenate([x.reshape(-1), xp.zeros((1,), x.dtype)])  # noqa: E731
    cu_rows = cumsum0((rows_in * g).reshape(-1)).astype(xp.int32)
    tables = xp.stack([flat(q_off), flat(k_start), flat(a_off), cumsum0(keys.reshape(-1))]).astype(xp.int32)
    return tables, cu_rows



def segment_launches(total: int, seqlens, heads_q: int, heads_kv: int, causal: bool, budget: int | None = None,
                     rows: int | None = None) -> list[tuple[int, int]]:
    """``(kend, rows)`` of each launch of the segmented backward over documents of ``seqlens`` (host ints,
    self-attention, packed in ``total`` rows) when the lengths are known on the host (torch's driver):
    a launch's scratch holds exactly its pieces' rows, ``g·Σ_heads Σ_docs min(rows, L − c·rows)``."""
    lens = [int(n) for n in seqlens]
    p = segment_plan(total, len(lens), max(lens, default=0), heads_q, heads_kv, causal, budget=budget, rows=rows)
    g = heads_q // heads_kv
    out = []
    for _, count in p.head_groups:
        for c, (kend, _) in enumerate(p.blocks):
            m = g * count * sum(min(max(n - c * p.rows, 0), p.rows) for n in lens)
            if m:
                out.append((kend, m))
    return out


def segment_workspace_bytes(total: int, seqlens, heads_q: int, heads_kv: int, head_dim: int, causal: bool,
                            budget: int | None = None, elem_bytes: int = 2, rows: int | None = None) -> int:
    """Upper bound of the scratch torch's segmented backward (:mod:`xattn.torch.gemm_bwd_segments`)
    allocates beyond its dq/dk/dv outputs, for ``total`` packed rows: the query-side copies of q, dout
    and dq ``3·elem·T·Hq·D``; the key side of k and v ``2·elem·Hkv·(T + spare)·D``; the fp32 dK/dV
    accumulators ``8·Hkv·acc_rows·D`` and one of them gathered per token ``4·T·Hkv·D``; the largest
    launch's P, fp16 P and dS ``(2·elem + 2)·rows·kend``; the row bias and δ ``16·Hq·T`` +
    :data:`DELTA_SLICE_BYTES`; per row of every launch (``Hq·Σ seqlens`` plus 7 of padding per launch)
    its expansion indices, positions, row bias and δ, 56 bytes; and the uploaded tables
    ``4·(launches·(10·(Hkv·S + 2) + 48) + T)`` (S documents)."""
    lens = [int(n) for n in seqlens]
    p = segment_plan(total, len(lens), max(lens, default=0), heads_q, heads_kv, causal, budget=budget, rows=rows)
    launches = segment_launches(total, lens, heads_q, heads_kv, causal, budget, rows)
    if not launches:
        return 0
    d, hq, hkv = head_dim, heads_q, heads_kv
    copies = 3 * elem_bytes * total * hq * d + 2 * elem_bytes * hkv * (total + p.spare_keys) * d
    accs = 8 * hkv * p.acc_rows * d + 4 * total * hkv * d
    scores = (2 * elem_bytes + 2) * max(m * kend for kend, m in launches)
    row_count = hq * sum(lens) + 7 * len(launches)
    vectors = 16 * hq * total + DELTA_SLICE_BYTES + 56 * row_count + 4 * p.spare_keys
    tables = 4 * (len(launches) * (10 * (hkv * len(lens) + 2) + 48) + total)
    return copies + accs + scores + vectors + tables
