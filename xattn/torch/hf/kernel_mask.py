"""The launch plan of the ``"ffpa"`` layers that share one Hugging Face mask (:class:`KernelMask`), the mask
tensor that carries it (:class:`PlannedMask`), and the SDPA masks a plan stands for.

The mask factory (:mod:`xattn.torch.hf.mask_factory`) hands the attention function a :class:`KernelMask` for
every layer of a forward: the kernel window, and for padded or packed batches the varlen segments
(``cu_seqlens``, built once per forward, not per layer), plus the exact SDPA mask for the layers that must
fall back. :mod:`xattn.torch.hf.masks` reads HF's masks into plans; :func:`plan_without_mask` plans a call
that got none.

Shapes: ``B`` batch, ``Nq`` queries, ``Nk`` keys; SDPA masks are ``[B, 1, Nq, Nk]`` bool (True = attend).
Windows ``(left, right)`` are aligned to the bottom-right diagonal of each (segment of a) call, as
FlashAttention's (``None`` = unbounded side; causal is ``(None, 0)``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

__all__ = ["KernelMask", "PlannedMask", "plan_without_mask", "window_mask"]


@dataclass(eq=False)
class KernelMask:
    """The launch plan of every layer that shares one HF mask (built once per forward).

    ``window`` is the kernels' ``(left, right)``, relative to the bottom-right diagonal of each
    (segment of a) call on keys ``kv_start:kv_stop`` (the others are invisible to every query).
    ``cu_seqlens_q/k`` (int32 on the device, ``max_seqlen_q/k`` ints) make the call varlen over
    ``[B * Nq]`` queries and ``[B * Nk]`` keys (Nk = the kept key range): the key segments tile the keys
    (zero-query segments skip padding), so no gather is needed. ``lengths`` (a static cache: row b's queries on
    its first ``lengths[b]`` keys, the rest a segment without queries) lets a decoding call take the
    split-KV route (:func:`xattn.torch.ops.fwd_lengths`). ``sdpa_mask()`` is the exact 4D
    bool mask ``[B, 1, Nq, Nk]`` that SDPA would use (for layers that fall back); once it is written in
    place, :meth:`edited` is True and the plan no longer describes it.
    """

    batch_size: int
    q_length: int
    kv_length: int
    window: tuple[int | None, int | None]
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    kv_start: int = 0
    kv_stop: int | None = None
    description: str = ""
    notes: dict = field(default_factory=dict, repr=False)
    _materialize: object = field(default=None, repr=False)
    _sdpa: torch.Tensor | None = field(default=None, repr=False)
    _source: KernelMask | None = field(default=None, repr=False)  # the plan this one slices (its SDPA mask too)
    _aliases: list = field(default_factory=list, repr=False)  # (tensor, _version) of what shares the SDPA mask
    _written: bool = field(default=False, repr=False)
    lengths: torch.Tensor | None = None  # int32 [B] on the device: each row's valid keys (one segment per row)

    ndim = 4  # HF's mask preprocessing reads a prepared mask's rank (generate() hands it back in)

    def dim(self) -> int:
        return 4

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, 1, Nq, Nk)``, the shape of the SDPA mask this plan stands for."""
        return self.batch_size, 1, self.q_length, self.kv_length

    @property
    def causal(self) -> bool:
        return self.window == (None, 0)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def check(self, query: torch.Tensor, key: torch.Tensor) -> None:
        """Raise ValueError unless query ``[B, H, Nq, D]`` / key ``[B, H, Nk, D]`` match the mask's sizes."""
        want = (self.batch_size, self.q_length, self.kv_length)
        got = (query.shape[0], query.shape[2], key.shape[2])
        if want != got:
            raise ValueError(f"attention_mask: built for (batch, q_length, kv_length) = {want}, but the layer "
                             f"passes query/key of {got}")

    def sdpa_mask(self) -> torch.Tensor:
        """The exact SDPA mask ``[B, 1, Nq, Nk]`` (bool, True = attend), built on first use (outside inference
        mode, so that it and its views count their in-place writes: :meth:`edited`)."""
        if self._sdpa is None:
            with _counting_writes():
                mask = self._materialize()
                self._sdpa = mask.clone() if mask.is_inference() else mask
            self.watch(self._sdpa)
        return self._sdpa

    def _root(self) -> KernelMask:
        plan = self
        while plan._source is not None:
            plan = plan._source
        return plan

    def watch(self, alias: torch.Tensor) -> None:
        """Count in-place writes to ``alias`` (a tensor sharing the SDPA mask's values, and its views) as edits."""
        if not torch.compiler.is_compiling():
            self._root()._aliases.append((alias, alias._version))

    def mark_edited(self) -> None:
        """Record a write to the SDPA mask that no version counter saw."""
        self._root()._written = True

    def edited(self) -> bool:
        """Whether the SDPA mask (shared with the plans this one slices or is sliced from) was written in place
        after it was built: then its values, not this plan, are the mask. Read from torch's version counters
        of the mask, its PlannedMasks and their views, so writes that bypass them (through the SDPA mask's
        ``.data`` or a NumPy view of it) are not seen; neither are writes in traced code (False while compiling)."""
        if torch.compiler.is_compiling():
            return False
        root = self._root()
        return root._written or any(alias._version != version for alias, version in root._aliases)

    def __getitem__(self, index) -> KernelMask:
        """``mask[:, :, -n:, :]``: the plan of the last ``n`` queries, as HF slices prepared masks along the
        query dim (Gemma 4's KV-shared layers with ``logits_to_keep``). Other indexing raises TypeError."""
        whole = slice(None)
        if not (isinstance(index, tuple) and len(index) == 4 and index[0] == index[1] == index[3] == whole
                and isinstance(index[2], slice) and index[2].step in (None, 1)):
            raise TypeError(f"KernelMask (the 'ffpa' launch plan of a [B, 1, Nq, Nk] mask): only the query slice "
                            f"mask[:, :, start:, :] is supported, got {index!r}; use .sdpa_mask() for the tensor")
        start, stop, _ = index[2].indices(self.q_length)
        if stop != self.q_length:
            raise TypeError(f"KernelMask: a query slice must keep the last queries (mask[:, :, start:, :]), got "
                            f"{index[2]!r} of {self.q_length}")
        return self._last_queries(self.q_length - start)

    def _last_queries(self, n: int) -> KernelMask:
        """The same keys and window for the last ``n`` queries: a window aligned to the bottom-right
        diagonal does not move when queries are dropped from the top (in a varlen plan, from the top of
        each row's segments)."""
        drop = self.q_length - n
        if drop <= 0:
            return self
        plan = KernelMask(self.batch_size, n, self.kv_length, self.window, self.cu_seqlens_q, self.cu_seqlens_k,
                          self.max_seqlen_q, self.max_seqlen_k, self.kv_start, self.kv_stop,
                          f"{self.description}, last {n} queries", dict(self.notes),
                          lambda: self.sdpa_mask()[:, :, drop:, :], _source=self)
        if self.varlen:  # segments tile [B * Nq] row by row: keep each segment's rows past the row's first `drop`
            cu = self.cu_seqlens_q.long()
            starts, ends = cu[:-1], cu[1:]
            first_kept = torch.div(ends - 1, self.q_length, rounding_mode="floor").clamp(min=0) * self.q_length + drop
            lens = (ends - torch.maximum(starts, first_kept)).clamp(min=0) * (ends > starts)
            plan.cu_seqlens_q = torch.cat([cu.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
            plan.max_seqlen_q = min(self.max_seqlen_q, n)
        return plan


def _counting_writes():
    """Tensors made here have version counters (not inference tensors) even under ``torch.inference_mode()``."""
    return torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext()


def _mark_writes(func, args, kwargs) -> None:
    """An in-place or ``out=`` write of ``func`` to a PlannedMask marks its plan edited (it runs below autograd: no
    version counter of the mask sees it)."""
    from torch.utils._pytree import tree_leaves

    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    for a in func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            for x in tree_leaves(named.get(a.name)):
                if isinstance(x, PlannedMask):
                    x.plan.mark_edited()


def _watch_views(out, masks: list) -> None:
    """Results of a torch op that share a PlannedMask's memory (views made below autograd) count writes on their
    own version counter or the PlannedMask's, not the SDPA mask's: its plan watches both."""
    from torch.utils._pytree import tree_leaves

    for mask in masks:
        values = mask.plan.sdpa_mask()
        memory = values.untyped_storage().data_ptr()
        views = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t is not values
                 and t.untyped_storage().data_ptr() == memory]
        if views and not getattr(mask, "_watched", False):
            mask._watched = True  # the plan keeps it alive: a write through its views outlives it
            mask.plan.watch(mask)
        for view in views:
            mask.plan.watch(view)


class PlannedMask(torch.Tensor):
    """What the ``"ffpa"`` mask factory returns for a plan: HF's exact SDPA mask, a real bool ``torch.Tensor``
    ``[B, 1, Nq, Nk]`` (True = attend), built only when something reads its values; ``.plan`` is the
    :class:`KernelMask` the attention function launches.

    Shape, dtype and device are known without building anything. Any torch operation (``.all()``,
    ``.to(...)``, ``~mask``, SDPA) builds the mask once and runs on it, returning plain tensors, so
    code written for NeMo's or HF's tensor masks reads it correctly. ``mask[:, :, start:, :]`` (HF's
    query slice) returns the plan of the last queries, still planned. ``.bool()`` returns the mask
    itself. Writing it in place (``mask[..., j] = False``, ``masked_fill_``, ``out=mask``, through a view
    or a query slice) edits the mask, not the plan: the attention function then runs it on SDPA as it
    reads (:meth:`KernelMask.edited`). ``clone()`` and ``to(...)`` return plain tensors. Under context
    parallelism the mask cannot be built (it is a shard; NotImplementedError)."""

    plan: KernelMask

    @staticmethod
    def __new__(cls, plan: KernelMask, device):
        with _counting_writes():
            return torch.Tensor._make_wrapper_subclass(cls, plan.shape, dtype=torch.bool, device=torch.device(device))

    def __init__(self, plan: KernelMask, device):
        self.plan = plan

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_leaves, tree_map

        kwargs = kwargs or {}
        tracking = not torch.compiler.is_compiling()
        if tracking:
            _mark_writes(func, args, kwargs)

        def dense(x):
            return x.plan.sdpa_mask() if isinstance(x, PlannedMask) else x
        out = func(*tree_map(dense, args), **tree_map(dense, kwargs))
        if tracking:
            _watch_views(out, [x for x in tree_leaves((args, kwargs)) if isinstance(x, PlannedMask)])
        return out

    def __getitem__(self, index):
        try:
            return PlannedMask(self.plan[index], self.device)
        except TypeError:
            return self.plan.sdpa_mask()[index]

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"PlannedMask({self.plan.description or 'plan'}, shape={tuple(self.shape)}, window={self.plan.window})"


def _doc_index(cu: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment of each row, its index within the segment) for ``[total]`` packed rows."""
    t = torch.arange(total, device=cu.device)
    seg = torch.searchsorted(cu[1:].long(), t, right=True)
    return seg, t - cu.long()[seg]


def _varlen_mask(cu_q, cu_k, nq: int, nk: int, left, right) -> torch.Tensor:
    """``[1, 1, Tq, Tk]`` bool for varlen segments, bottom-right aligned per segment."""
    sq, iq = _doc_index(cu_q, nq)
    sk, jk = _doc_index(cu_k, nk)
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    rel = jk[None, :] - iq[:, None] - (lk - lq)[sq][:, None]  # key minus the query's diagonal key
    m = sq[:, None] == sk[None, :]
    if left is not None:
        m &= rel >= -left
    if right is not None:
        m &= rel <= right
    return m[None, None]


def window_mask(nq: int, nk: int, base: int, window, device) -> torch.Tensor:
    """``[Nq, Nk]`` bool: query ``i`` (at key position ``base + i``) sees key ``j`` iff
    ``-left <= j - (base + i) <= right`` (``None`` = unbounded side)."""
    left, right = window
    rel = torch.arange(nk, device=device)[None, :] - (torch.arange(nq, device=device)[:, None] + base)
    m = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left is not None:
        m &= rel >= -left
    if right is not None:
        m &= rel <= right
    return m


def plan_without_mask(query: torch.Tensor, key: torch.Tensor, window, cu_seqlens=None,
                      max_lengths=None) -> KernelMask:
    """The plan of a call that got no mask from the ``"ffpa"`` factory, or FA-style documents.

    ``window`` is bottom-right aligned (FlashAttention; causal = ``(None, 0)``). ``cu_seqlens=(cu_q,
    cu_k)`` with ``max_lengths=(max_q, max_k)`` (batch 1) make the documents varlen segments.
    """
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    left, right = window
    sizes = dict(batch_size=b, q_length=nq, kv_length=nk, window=(left, right))
    if cu_seqlens is None:
        def materialize():
            return window_mask(nq, nk, nk - nq, window, query.device)[None, None].expand(b, 1, nq, nk)
        return KernelMask(**sizes, _materialize=materialize, description="dense (no mask)")
    cu_q, cu_k = (c.to(device=query.device, dtype=torch.int32) for c in cu_seqlens)
    max_q, max_k = max_lengths
    return KernelMask(**sizes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=int(max_q),
                      max_seqlen_k=int(max_k), description="packed (cu_seqlens)",
                      _materialize=lambda: _varlen_mask(cu_q, cu_k, nq, nk, left, right))
