"""The sequence layout of context parallelism and its halo plan: integer arithmetic shared by
:mod:`xattn.torch.ring` and :mod:`xattn.jax.ring` (no framework import).

P ranks, a global sequence of N = 2 * P * L tokens cut into 2P chunks of L. Rank r holds chunks
``r`` and ``2P-1-r`` (the load-balanced "dual chunk" / zigzag layout of TransformerEngine and
ring-flash-attention), concatenated: slot 0 and slot 1 of its local ``[B, 2L, ...]`` shard.

A sliding window ``(left, right)`` (both finite) needs, for chunk c, the ``left`` keys before it
and the ``right`` after it. Ranks exchange only chunk edges: the last ``min(left, L)`` tokens
("tails") and the first ``min(right, L)`` tokens ("heads") of every chunk; :func:`halo_plan` says
which edge slices form chunk c's halos, so a halo may span several chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["chunk_length", "chunks_of", "chunk_owner", "edge_widths", "HaloPlan", "halo_plan", "causal_ring_source"]


def chunk_length(seqlen: int, world_size: int, what: str = "seqlen") -> int:
    """L = seqlen / 2P; ValueError naming ``what`` unless seqlen is a multiple of 2P."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if seqlen % (2 * world_size):
        raise ValueError(f"{what}: sequence length {seqlen} must be a multiple of 2 * world_size = {2 * world_size} "
                         "(the load-balanced layout cuts it into 2 chunks per rank); pad it")
    return seqlen // (2 * world_size)


def chunks_of(world_size: int, rank: int) -> tuple[int, int]:
    """The global chunks rank ``rank`` holds, in slot order: ``(rank, 2P-1-rank)``."""
    return rank, 2 * world_size - 1 - rank


def chunk_owner(chunk: int, world_size: int) -> tuple[int, int]:
    """``(rank, slot)`` holding global chunk ``chunk``."""
    return (chunk, 0) if chunk < world_size else (2 * world_size - 1 - chunk, 1)


def edge_widths(chunk: int, left: int, right: int) -> tuple[int, int]:
    """``(tail, head)``: how many last / first tokens of every chunk the halo exchange gathers."""
    return min(left, chunk), min(right, chunk)


@dataclass(frozen=True)
class HaloPlan:
    """Chunk c's halos: ``before``/``after`` are ``(rank, slot, lo, hi)`` slices of the gathered
    tails / heads, in sequence order; ``left_len``/``right_len`` their total lengths. The chunk
    then runs the window ``(left + right_len, right - right_len)`` on ``[before, chunk, after]``
    (queries are the chunk's rows, bottom-right aligned to the extended keys)."""

    before: tuple[tuple[int, int, int, int], ...]
    after: tuple[tuple[int, int, int, int], ...]
    left_len: int
    right_len: int

    def window(self, left: int, right: int) -> tuple[int, int]:
        return left + self.right_len, right - self.right_len


def halo_plan(c: int, world_size: int, chunk: int, left: int, right: int) -> HaloPlan:
    """Which edge slices form the halos of global chunk ``c`` under window ``(left, right)``."""
    tail, head = edge_widths(chunk, left, right)
    before, need = [], left
    for prev in range(c - 1, -1, -1):  # tails of the chunks before c, nearest first
        if need <= 0:
            break
        take = min(need, tail)
        before.insert(0, (*chunk_owner(prev, world_size), tail - take, tail))
        need -= take
    after, need = [], right
    for nxt in range(c + 1, 2 * world_size):
        if need <= 0:
            break
        take = min(need, head)
        after.append((*chunk_owner(nxt, world_size), 0, take))
        need -= take
    return HaloPlan(tuple(before), tuple(after), sum(b - a for *_, a, b in before), sum(b - a for *_, a, b in after))


def causal_ring_source(rank: int, world_size: int, step: int) -> tuple[int, bool]:
    """Ring step ``step`` >= 1 under causality: ``(src, earlier)``, the rank whose K/V block is held
    and whether it precedes this rank. An earlier block's first chunk precedes both local chunks
    (all local queries x its first chunk); a later block matters only to the second local chunk
    (the second local chunk x the whole block)."""
    src = (rank - step) % world_size
    return src, src < rank
