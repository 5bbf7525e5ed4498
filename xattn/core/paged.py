"""Paged KV caches (issue #44): the split of a decoding call over a page table, and the page-table rules.

Glossary as in :mod:`xattn.core.split_kv`, plus: a pool ``k_pages/v_pages [num_pages, page_size, Hkv, D]``,
``page_table [B, max_pages]`` int32 (FlashAttention-3's and flash_attn.cute's name; FlashAttention-2 and vLLM
say ``block_table``): sequence b's key j lives in pool page ``page_table[b, j // page_size]`` at row
``j % page_size``; ``lengths [B]`` (``cache_seqlens`` / ``seqused_k``) its valid keys.

How a paged decoding call splits (the design of ``docs/design.md``, "Paged KV caches"): the split launch is a
*virtual batch* of ``B * S`` entries, entry ``(b, s)`` holding sequence b's Nq queries, the page-table row
``page_table[b, s * pps : (s + 1) * pps]`` (``pps`` pages per split; a strided view of the table, no copy
when S * pps == max_pages) and ``entry_keys(b, s)`` keys: a paged forward that takes ``page_table`` and
per-entry lengths (flash_attn.cute's sm90 forward: TMA when page_size equals its key tile, cp.async
otherwise) runs it as one dense launch, and FlashAttention's combine merges the S partials (plus a causal
tail) by lse, as the contiguous split route does. Splits are whole pages, so a causal tail (Nq > 1) starts at
the page holding key ``L - Nq``: every key of that page before it is seen by every query anyway.

Pure Python: no torch, jax or numpy (``tests/core/test_layering.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .split_kv import SPLIT_TILES, IndexSpec

__all__ = ["PagedPlan", "PagedMetaSpec", "plan_paged", "tail_pages", "tma_page_rows", "FA4_KEY_TILE", "entry_bounds",
           "PageTableError", "page_table_problem", "length_message", "page_message", "MIN_PAGE_SIZE", "MAX_PAGE_SIZE"]

MIN_PAGE_SIZE = 16  # the range: 16 (vLLM's default) to 256
MAX_PAGE_SIZE = 256


@dataclass(frozen=True)
class PagedPlan:
    """``splits`` entries per sequence (S) of ``pages_per_split`` table entries each, then a causal tail entry
    when ``tail``. ``padded``: S * pps exceeds ``max_pages``, so the table is padded to ``S * pps`` columns
    (one small copy) before it is viewed as ``[B * S, pps]``."""

    splits: int
    pages_per_split: int
    tail: bool
    padded: bool

    @property
    def partials(self) -> int:
        """Partial slots per sequence (``P``)."""
        return self.splits + int(self.tail)


class PagedMetaSpec(IndexSpec):
    """The paged split route's index launcher (:mod:`xattn.core.paged_meta_sm90`): the split entries' ``kv_meta``
    (and the causal tail's)."""

    NAME = "paged_meta"


def plan_paged(splits: int, causal: bool, seqlen_q: int, max_pages: int) -> PagedPlan:
    """The plan of at most ``splits`` splits over a ``max_pages``-wide page table: pages per split
    ``ceil(max_pages / splits)``, and as many splits as those pages need (no split past the table)."""
    if splits < 1:
        raise ValueError(f"num_splits: expected >= 1, got {splits}")
    if max_pages < 1:
        raise ValueError(f"page_table: expected at least one column, got {max_pages}")
    pps = -(-max_pages // splits)
    used = -(-max_pages // pps)
    return PagedPlan(used, pps, causal and seqlen_q > 1, used * pps != max_pages)


# FA4 sm90's key tile (rows) where its causal and unmasked forwards share one, D == Dv (flash_attn.cute's
# _tile_size_fwd_sm90; tests/core/test_paged_plan.py checks the table against it)
FA4_KEY_TILE = {64: 128, 128: 128, 192: 112, 256: 80}


def tma_page_rows(family: str, head_dim: int, head_dim_v: int, page_size: int) -> int:
    """The page size the split route's launches read the pool with: FA4 loads a page of exactly its key tile by
    TMA and any other by cp.async (slower: session 18's d128 rows), so a page of r whole tiles is read as r
    pages of one tile (the pool's ``[NP r, tile, Hkv, D]`` view, the table mapped by the index kernel); else
    ``page_size`` itself. The tile: the split launch's decode tile where :data:`xattn.core.split_kv.SPLIT_TILES`
    names one (the causal tail's own tile then reads those pages by cp.async), else FA4's. Same keys: the same
    results."""
    split = SPLIT_TILES.get((head_dim, head_dim_v)) if family == "fa4" else None
    tile = split[1] if split else FA4_KEY_TILE.get(head_dim) if family == "fa4" and head_dim == head_dim_v else None
    return tile if tile and page_size > tile and page_size % tile == 0 else page_size


def tail_pages(page_size: int, seqlen_q: int) -> int:
    """Page-table columns the causal tail reads: its keys (at most ``page_size - 1`` before key ``L - Nq``, then the Nq
    last) span at most this many pages."""
    return -(-(page_size + seqlen_q - 1) // page_size)


def entry_bounds(plan: PagedPlan, length: int, seqlen_q: int, page_size: int) -> list[tuple[int, int]]:
    """``[(first_page_column, keys), ...]``: per entry of one sequence of ``length`` valid keys, the first
    page-table column it reads and how many keys (host ints; the front ends compute the same on the device).
    The S splits share the keys before the tail's first page; the tail entry (causal plans) the rest."""
    tail_page = (length - min(length, seqlen_q)) // page_size if plan.tail else 0
    before = tail_page * page_size if plan.tail else length
    span = plan.pages_per_split * page_size
    out = [(s * plan.pages_per_split, min(max(before - s * span, 0), span)) for s in range(plan.splits)]
    if plan.tail:
        out.append((tail_page, length - before))
    return out


class PageTableError(ValueError):
    """A page table or a length that would make the kernels read outside the pool (checked mode)."""


def page_table_problem(table: Sequence[Sequence[int]], lengths: Sequence[int], num_pages: int,
                       page_size: int, names: tuple[str, str] = ("page_table", "cache_seqlens")) -> str | None:
    """The first rule a page table breaks, as a message naming the argument, index and values, or None.

    The kernels trust the table (reading it on the host would synchronise); checked mode tests, per
    sequence b in order: ``0 <= lengths[b] <= max_pages * page_size``, then every page it uses
    (columns ``0 .. ceil(lengths[b] / page_size) - 1``) in ``0 .. num_pages - 1``. Columns past a
    sequence's last page are never read, so any value there is fine (vLLM pads with -1 or 0). ``names``: the
    front end's names of the table and the lengths (JAX, as Pallas: ``block_tables``, ``lengths``)."""
    for b, (row, n) in enumerate(zip(table, lengths)):
        if not 0 <= n <= len(row) * page_size:
            return length_message(names, b, n, len(row), page_size)
        for j in range(-(-n // page_size)):
            if not 0 <= row[j] < num_pages:
                return page_message(names, b, j, row[j], num_pages, -(-n // page_size) - 1)
    return None


def length_message(names: tuple[str, str], b, n, columns: int, page_size: int) -> str:
    """The message of a sequence length outside the table (:func:`page_table_problem`); ``b`` and ``n`` may be
    ``{}`` placeholders (a traced check's template)."""
    return (f"{names[1]}[{b}] = {n}: must lie in 0-{columns * page_size} ({names[0]} has {columns} columns of "
            f"{page_size}-key pages)")


def page_message(names: tuple[str, str], b, j, page, num_pages: int, last_column) -> str:
    """The message of a used page outside the pool (:func:`page_table_problem`); the values but ``num_pages`` may
    be ``{}`` placeholders (a traced check's template: b, j, page, b, last_column)."""
    return (f"{names[0]}[{b}, {j}] = {page}: must lie in 0-{num_pages - 1} (the pool holds {num_pages} pages; "
            f"sequence {b} uses columns 0-{last_column})")
