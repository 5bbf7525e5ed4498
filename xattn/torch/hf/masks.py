"""Hugging Face masks in kernel terms: what a layer's mask means, and the launch plan that runs it exactly.

Every HF mask is built from a ``mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool`` that
``transformers.masking_utils`` composes (causal, sliding window, packed documents, padding, ...).
:func:`describe` reads the compositions whose meaning the kernels reproduce exactly and returns a
:class:`Pattern`; for anything else (chunked layers, image-token blocks, custom ``or_``/``and_``
overlays) it returns ``None`` and the caller gives SDPA HF's own mask. :func:`plan_hf_mask` turns a
pattern, the call's sizes and its padding into the :class:`~xattn.torch.hf.kernel_mask.KernelMask` the
attention function launches.

Positions: query ``i`` of a call sits at ``q_offset + i``, key ``j`` at ``kv_offset + j``. A
:class:`Pattern` ``(left, right)`` lets a query at position ``p`` see keys at ``p - left .. p + right``
(``None`` = unbounded; causal is ``(None, 0)``), within its document when ``doc_ids`` is set.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from ..varlen_check import cu_seqlens_from_lengths
from .kernel_mask import KernelMask

__all__ = ["Pattern", "describe", "hf_window", "keeps_every_key", "plan_hf_mask"]


@dataclass(frozen=True)
class Pattern:
    """Key window around each query position (``None`` = unbounded) and, for packed rows, ``doc_ids [B, N]``."""

    left: int | None
    right: int | None
    doc_ids: torch.Tensor | None = None


class _Unknown(Exception):
    pass


@functools.cache
def _hf_kinds() -> dict:
    """Code object -> kind, for the mask-function builders of the installed transformers."""
    from transformers import masking_utils as mu

    makers = {
        "and": lambda: mu.and_masks(mu.causal_mask_function),
        "sliding": lambda: mu.sliding_window_overlay(1),
        "sliding_bidirectional": lambda: mu.sliding_window_bidirectional_overlay(1),
        "packed": lambda: mu.packed_sequence_mask_function(None),
        "remap": lambda: mu.remap_positions_for_packed_sequence(mu.causal_mask_function, None),
    }
    kinds = {mu.causal_mask_function.__code__: "causal", mu.bidirectional_mask_function.__code__: "bidirectional"}
    for kind, make in makers.items():
        try:
            kinds[make().__code__] = kind
        except AttributeError:  # a builder this transformers version does not have
            pass
    return kinds


def _free(fn, name: str):
    try:
        return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents
    except (AttributeError, ValueError, TypeError, IndexError) as exc:
        raise _Unknown from exc


def _window_arg(fn, minimum: int) -> int:
    w = _free(fn, "sliding_window")
    if isinstance(w, bool) or not isinstance(w, int) or w < minimum:
        raise _Unknown
    return w


def _tighter(a, b):
    return b if a is None else a if b is None else min(a, b)


def _describe(fn) -> tuple:
    """``(left, right, doc_ids, remapped)`` of one mask function; raises _Unknown."""
    kind = _hf_kinds().get(getattr(fn, "__code__", None))
    if kind == "causal":
        return None, 0, None, False
    if kind == "bidirectional":
        return None, None, None, False
    if kind == "sliding":  # kv > q - w
        return _window_arg(fn, 1) - 1, None, None, False
    if kind == "sliding_bidirectional":  # |q - kv| <= w
        w = _window_arg(fn, 0)
        return w, w, None, False
    if kind == "packed":
        return None, None, _free(fn, "packed_sequence_mask"), False
    if kind == "remap":  # positions instead of indices: the same for a pattern of q - kv within a document
        left, right, docs, _ = _describe(_free(fn, "mask_function"))
        if docs is not None:
            raise _Unknown
        return left, right, None, True
    if kind == "and":
        left = right = docs = None
        remapped = False
        for part in _free(fn, "mask_functions"):
            pl, pr, pd, prm = _describe(part)
            left, right, remapped = _tighter(left, pl), _tighter(right, pr), remapped or prm
            if pd is not None:
                if docs is not None:
                    raise _Unknown
                docs = pd
        return left, right, docs, remapped
    raise _Unknown


def describe(mask_function) -> Pattern | None:
    """The :class:`Pattern` of an HF mask function, or ``None`` when the kernels cannot reproduce it exactly.

    Recognised: ``causal_mask_function``, ``bidirectional_mask_function``, the sliding-window
    overlays (causal and bidirectional), packed documents (``packed_sequence_mask_function``, with
    ``remap_positions_for_packed_sequence``), and ``and_masks`` of these. Everything else -> None.
    """
    if mask_function is None:
        from transformers.masking_utils import causal_mask_function as mask_function
    try:
        left, right, docs, remapped = _describe(mask_function)
    except _Unknown:
        return None
    if remapped and docs is None:
        return None  # positions remapped without document boundaries: not a pure function of q - kv
    if left is not None and right is not None and left + right < 0:
        return None  # sees nothing: leave it to SDPA
    if docs is not None and (not isinstance(docs, torch.Tensor) or docs.dim() != 2):
        return None
    return Pattern(left, right, docs)


def _shifted(left, right, shift: int):
    """The pattern's window seen from the bottom-right diagonal that sits ``shift`` keys left of it."""
    wl = None if left is None else left - shift
    wr = None if right is None else right + shift
    if (wl is not None and wl < 0) or (wr is not None and wr < 0):
        return None
    return wl, wr


def _packed_plan(pattern: Pattern, b: int, n: int, device):
    """Segments = runs of equal document ids in each row (one host sync)."""
    ids = pattern.doc_ids.to(device)
    starts = torch.ones(b, n, dtype=torch.bool, device=device)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    flat = torch.nonzero(starts.flatten()).flatten().tolist() + [b * n]
    lens = [e - s for s, e in zip(flat[:-1], flat[1:])]
    cu = cu_seqlens_from_lengths(lens, device)
    return dict(window=(pattern.left, pattern.right), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                max_seqlen_k=max(lens), description=f"packed: {len(lens)} documents")


def _padded_plan(pattern: Pattern, keep: torch.Tensor, nq: int, base: int):
    """Each row's kept keys must be one contiguous run; all queries stay (dead rows come out 0)."""
    b, nk = keep.shape
    idx = torch.arange(nk, device=keep.device)
    count = keep.sum(1)
    first = torch.where(keep, idx, nk).amin(1)
    last = torch.where(keep, idx, -1).amax(1) + 1
    rows = torch.stack([count, first, last]).tolist()
    window = (pattern.left, pattern.right)
    shifts = set()
    for cnt, a, e in zip(*rows):
        if not cnt:  # its queries would need a segment with no keys, which FA4 does not promise to handle
            return "a row without any real token"
        if cnt != e - a:
            return "padding that is not one contiguous run of keys per row"
        shifts.add(base + nq - e)
    if window != (None, None):
        if len(shifts) > 1:
            return ("rows padded on the right by different amounts (SDPA lets padded query rows see real keys; "
                    "pad on the left to stay on the kernels)")
        window = _shifted(pattern.left, pattern.right, shifts.pop() if shifts else 0)
        if window is None:
            return "query/key offsets the kernel window cannot express"
    q_lens, k_lens = [], []
    for cnt, a, e in zip(*rows):
        q_lens += [0, nq, 0]
        k_lens += [a, e - a, nk - e]
    return dict(window=window, cu_seqlens_q=cu_seqlens_from_lengths(q_lens, keep.device),
                cu_seqlens_k=cu_seqlens_from_lengths(k_lens, keep.device),
                max_seqlen_q=nq, max_seqlen_k=max(k_lens), description=f"padded: {b} rows")


@functools.lru_cache(maxsize=64)
def _static_cache_tables(b: int, nq: int, nk: int, device) -> tuple[torch.Tensor, ...]:
    """The constant parts of :func:`_static_cache_plan` (built once per shape): ``cu_seqlens_q``, the key
    segment bounds with the filled length 0 and the selector of the bounds it moves, ``arange(nk)``."""
    rows = torch.arange(b, device=device, dtype=torch.int64)
    zero = rows.new_zeros(1)
    cu_q = torch.cat([zero, torch.stack([(rows + 1) * nq, (rows + 1) * nq], 1).flatten()]).to(torch.int32)
    bounds = torch.cat([zero, torch.stack([rows * nk, (rows + 1) * nk], 1).flatten()])
    moves = torch.cat([zero, torch.tensor([1, 0], device=device).repeat(b)])
    return cu_q, bounds, moves, torch.arange(nk, device=device)


def _static_cache_plan(pattern: Pattern, b: int, nq: int, nk: int, base: torch.Tensor) -> dict:
    """A causal-side window over a static cache whose fill is only known on the device: each row's
    keys ``[0, base + nq)`` are one varlen segment holding the row's queries (bottom-right aligned
    there, so the window is the pattern's own), the empty slots ``[base + nq, nk)`` a segment with no
    queries. Built on the device (no host sync, a few tiny kernels); its sizes are the same every step,
    so a compiled decode step sees the same plan each token (CUDA-graph replay). ``filled`` (0-d) is
    the filled length, ``keys`` ``arange(nk)``."""
    cu_q, bounds, moves, keys = _static_cache_tables(b, nq, nk, base.device)
    filled = (base.reshape(()) + nq).clamp(0, nk)
    return dict(window=(pattern.left, 0), cu_seqlens_q=cu_q, cu_seqlens_k=(bounds + moves * filled).to(torch.int32),
                max_seqlen_q=nq, max_seqlen_k=nk, description=f"static cache: {b} rows", filled=filled, keys=keys)


def _visible_keys(left, right, base: int, nq: int, nk: int) -> tuple[int, int]:
    """``[start, stop)``: the keys some query can see (key j is visible to query i only if
    ``i + base - left <= j <= i + base + right``); the rest need not reach the kernels."""
    stop = nk if right is None else max(0, min(nk, nq + base + right))
    start = 0 if left is None else max(0, min(stop, base - left))
    return start, stop


_PADDING_READS: dict[int, tuple] = {}  # id(2D padding mask) -> (weakref, _version, keeps every key)


def _host_bools(*flags: torch.Tensor) -> list[bool]:
    """Read 0-d bool tensors on the host: one synchronisation for all of them."""
    return [bool(x) for x in torch.stack(flags).tolist()]


def keeps_every_key(keep: torch.Tensor, padding_mask: torch.Tensor | None = None) -> bool:
    """``bool(keep.all())``: whether ``keep`` (a factory's padding over its keys) keeps every key.

    ``padding_mask``: HF's 2D mask that ``keep`` is a column slice of (None if it is not one, e.g. padded
    past the mask's end). Then the whole mask's answer is read in the same host sync and remembered
    while that tensor lives unmodified (same object, same ``_version``): HF hands one mask to the factory
    of each layer type in a forward, so a step with no padding reads it once, not once per factory.
    Inference tensors (no version counter) and traced calls are read every time. Writes that bypass the
    version counter (through ``.data`` or a NumPy view) are not seen, as autograd does not see them."""
    if padding_mask is None or torch.compiler.is_compiling() or padding_mask.is_inference():
        return bool(keep.all())
    seen = _PADDING_READS.get(id(padding_mask))
    if seen is not None and seen[0]() is padding_mask and seen[1] == padding_mask._version:
        return True if seen[2] else bool(keep.all())
    here, whole = _host_bools(keep.all(), padding_mask.all())
    key = id(padding_mask)
    _PADDING_READS[key] = (weakref.ref(padding_mask, lambda _, key=key: _PADDING_READS.pop(key, None)),
                           padding_mask._version, whole)
    return here


def plan_hf_mask(pattern: Pattern, batch_size: int, q_length: int, kv_length: int, q_offset: int,
                 kv_offset: int, keep: torch.Tensor | None, device, materialize,
                 padding_mask: torch.Tensor | None = None) -> KernelMask | str:
    """The :class:`KernelMask` that runs ``pattern`` exactly on these sizes, or why none can (a string).

    ``keep [B, kv_length]`` bool is the padding mask over this call's keys (True = real token) or
    None; ``padding_mask``, the 2D mask it is a column slice of, if it is one (see :func:`keeps_every_key`);
    ``materialize()`` returns HF's own SDPA mask for the same arguments. Keys no query can see
    (e.g. empty static-cache slots) are cut off (``kv_start/kv_stop``). At most one host sync.
    """
    base = q_offset - kv_offset  # key j is visible to query i iff i + base - left <= j <= i + base + right
    sizes = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, _materialize=materialize)
    if isinstance(base, torch.Tensor):  # a static cache's offset, a device tensor (HF's StaticLayer)
        if pattern.doc_ids is None and pattern.right == 0:
            plan = _static_cache_plan(pattern, batch_size, q_length, kv_length, base)
            filled, keys = plan.pop("filled"), plan.pop("keys")
            # keys past the last query's diagonal are invisible: only the padding of the filled slots counts
            if keep is None or bool((keep | (keys >= filled)).all()):
                return KernelMask(**sizes, **plan, lengths=filled.expand(batch_size).to(torch.int32))
        base = int(base)  # padding, documents or keys right of the diagonal: plan on the host (one sync)
    if keep is not None and keeps_every_key(keep, padding_mask):
        keep = None
    if pattern.doc_ids is not None:
        if keep is not None or q_length != kv_length or base != 0 or \
                tuple(pattern.doc_ids.shape) != (batch_size, q_length):
            return "packed documents together with padding or a cache"
        return KernelMask(**sizes, **_packed_plan(pattern, batch_size, q_length, device))
    start, stop = _visible_keys(pattern.left, pattern.right, base, q_length, kv_length)
    if stop <= start:
        return "no query sees any key"
    sizes.update(kv_start=start, kv_stop=stop)
    base, nk = base - start, stop - start
    if keep is not None:
        keep = keep[:, start:stop]
        keep = None if bool(keep.all()) else keep
    if keep is None:
        window = _shifted(pattern.left, pattern.right, base - (nk - q_length))
        if window is None:
            return "query/key offsets the kernel window cannot express"
        return KernelMask(**sizes, window=window, description="dense")
    plan = _padded_plan(pattern, keep.bool(), q_length, base)
    return plan if isinstance(plan, str) else KernelMask(**sizes, **plan)


def hf_window(causal: bool, sliding_window) -> tuple[int | None, int | None]:
    """HF's FlashAttention convention for ``sliding_window=w``: ``(w - 1, 0)`` causal, ``(w - 1, w - 1)`` not."""
    left = None if sliding_window is None else int(sliding_window) - 1
    return left, 0 if causal else left
