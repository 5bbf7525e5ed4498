"""FA4 attention helpers on SDPA-layout tensors: plain causal and document-causal (packed documents, query
shards of context parallelism), as NeMo AutoModel's ``fa4`` module defines them (:mod:`xattn.torch.fa4`
publishes them under its names).

:func:`causal_fa4_attention` and :func:`document_causal_fa4_attention` take and return SDPA layout
``[batch, heads, sequence, head_dim]`` (K/V may have fewer heads than Q: GQA). The kernels read
``[batch, sequence, heads, head_dim]`` views of them (no copy for the dense call). Dimension 1 is
ALWAYS read as heads: a ``[B, N, H, D]`` tensor whose shape happens to pass the checks would be
computed as if it were ``[B, H, N, D]``, so transpose FlashAttention-layout tensors first.

Document ids are integer tensors ``[batch, sequence]``: documents numbered from 1, ids ``<= 0`` for padding
(:data:`PAD_DOC_ID`, 0, as NeMo writes them; -1 too). Every run of equal ids in a row is one varlen segment,
cut where the local query shard ends, so a query at global position ``p`` sees exactly the keys of its run up
to ``p``: FA4's causal mask is aligned to the bottom-right corner of each segment. Segments without local
queries keep their keys, so the key segments tile the flattened ``[batch * key_sequence]`` tensor and
nothing is gathered. Padding queries return zeros.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import torch

from xattn.core.device import prepare_dsl_environment

from .attention import attention
from .varlen_check import cu_seqlens_from_lengths

__all__ = ["causal_fa4_attention", "document_causal_fa4_attention", "import_fa4_modules", "safe_import",
           "varlen_layout", "varlen_segments", "LAYOUT_CACHE", "LAYOUT_GENERATION", "PAD_DOC_ID"]

_FACADE = "xattn.torch.fa4"  # NeMo's module: its ``safe_import`` is the hook import_fa4_modules looks up
_PIP_HINT = "pip install flash-attn-4==4.0.0b36"

PAD_DOC_ID = 0  # padding ids are <= 0 (0 as NeMo writes them; any id <= 0 counts as padding)
# The varlen layouts of the current step. ``LAYOUT_GENERATION`` holds ``[ids, host ids]``: a private copy of
# the step's kv_doc_ids on their device and its one host copy. A call belongs to the step when its
# kv_doc_ids hold the same values (compared on their device: one small sync per call), so a new tensor,
# an in-place write (through autograd, numpy or ``.data``) and inference-mode tensors, which have no
# version counter, always get the layout of the ids they hold. The step's layouts are keyed by
# ``(q_length, q_global_start, kv shape)``. Both are mutated in place, never rebound.
LAYOUT_CACHE: dict[tuple, Any] = {}
LAYOUT_GENERATION: list[Any] = [None, None]


def safe_import(name: str) -> tuple[bool, types.ModuleType | ImportError]:
    """``(True, module)``, or ``(False, the ImportError)`` where ``name`` does not import (NeMo's ``safe_import``)."""
    try:
        return True, importlib.import_module(name)
    except ImportError as exc:
        return False, exc


def import_fa4_modules(*names: str) -> tuple[types.ModuleType, ...]:
    """Import the named modules (e.g. ``"flash_attn.cute.interface"``, ``"cutlass.cute"``) and return them as a
    tuple in the order given; no names gives ``()``.

    Each name goes through ``safe_import`` as :mod:`xattn.torch.fa4` holds it when called (NeMo's hook: a
    replacement there is used). Every module that fails to import is listed in ONE ``ImportError``, "could not
    import <names>", ending with the pip command for FA4. On a machine without a GPU the CuTeDSL target is
    pinned to sm_90a first, so importing cutlass here does not fix it to another arch."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"names: expected module names (str), got {type(name).__name__}")
    if names:
        prepare_dsl_environment()
    load = getattr(sys.modules.get(_FACADE), "safe_import", safe_import)
    imported = [load(name) for name in names]
    missing = [name + (f" ({found})" if isinstance(found, BaseException) else "")
               for name, (ok, found) in zip(names, imported) if not ok]
    if missing:
        raise ImportError(f"FlashAttention 4 / CuTe DSL modules missing: could not import {', '.join(missing)}. "
                          f"{_PIP_HINT}")
    return tuple(module for _, module in imported)


def _sdpa_dims(query, key, value) -> tuple[int, int, int, int, int]:
    """``(B, Hq, Nq, Hkv, Nk)`` of SDPA-layout q/k/v; TypeError/ValueError naming the argument otherwise."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, sequence, head_dim] (SDPA layout), "
                             f"got shape {tuple(t.shape)}")
    (b, hq, nq, d), (bk, hkv, nk, dk) = query.shape, key.shape
    if tuple(value.shape[:3]) != (bk, hkv, nk):
        raise ValueError(f"value: shape {tuple(value.shape)} must match key {tuple(key.shape)} in "
                         "[batch, heads, sequence]")
    if bk != b:
        raise ValueError(f"key: batch {bk} != query batch {b} (dim 0)")
    if dk != d:
        raise ValueError(f"key: qk head_dim {dk} != query head_dim {d} (dim 3)")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"key: its {hkv} heads (dim 1) must divide the query's {hq} heads (GQA)")
    return b, hq, nq, hkv, nk


def causal_fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention on FA4, in SDPA layout.

    ``query [B, Hq, Nq, D]``, ``key [B, Hkv, Nk, D]``, ``value [B, Hkv, Nk, Dv]`` (``Hkv`` divides ``Hq``)
    -> ``[B, Hq, Nq, Dv]`` (a transposed view of the kernel's ``[B, N, Hq, Dv]`` output), differentiable.
    ``scale`` multiplies ``q @ k^T`` (``None``: ``1/sqrt(D)``, as FA4). With ``Nq != Nk`` the causal mask is
    FA4's, bottom-right aligned: query i sees keys ``j <= i + Nk - Nq`` (queries that see no key give 0);
    dim 1 is heads (see the module docstring)."""
    _sdpa_dims(query, key, value)
    try:
        out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), softmax_scale=scale,
                        causal=True, family="fa4")
    except (TypeError, ValueError) as exc:
        if "softmax_scale" in str(exc):  # this function's parameter is `scale`: name it so
            raise type(exc)(str(exc).replace("softmax_scale", "scale")) from None
        raise
    return out.transpose(1, 2)


def varlen_segments(kv_doc_ids, q_length: int, q_global_start: int) -> tuple[list[int], list[int]]:
    """Per-document key runs of each row, split at the end of the local query shard.

    Returns ``(q_lens, k_lens)``: key segments tile ``[B * Nk]``; each query position
    ``q_global_start .. q_global_start + q_length - 1`` of a row lands in the segment holding it
    (segments before or after the shard get zero queries). Example: doc ids
    ``[[1,1,1,2,2,2,2,0]]``, q_length 2, start 4 -> q lens ``[0,2,0,0]``, k lens ``[3,3,1,1]``.
    """
    end = q_global_start + q_length
    q_lens, k_lens = [], []
    for row in kv_doc_ids.tolist():
        if end > len(row) or q_global_start < 0:
            raise ValueError(f"query shard [{q_global_start}, {end}) is outside the {len(row)} keys")
        start = 0
        while start < len(row):
            stop = start + 1
            while stop < len(row) and row[stop] == row[start] and stop != end:
                stop += 1
            q_lens.append(max(0, min(stop, end) - max(start, q_global_start)))
            k_lens.append(stop - start)
            start = stop
    return q_lens, k_lens


def _check_doc_ids(q_doc_ids, kv_doc_ids, q_global_start) -> int:
    """The query length; TypeError/ValueError naming the argument for ids that cannot describe a shard."""
    for name, ids in (("q_doc_ids", q_doc_ids), ("kv_doc_ids", kv_doc_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
                or ids.dtype == torch.bool:
            raise TypeError(f"{name}: expected an integer tensor [batch, sequence], got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != 2:
            raise ValueError(f"{name}: expected [batch, sequence], got shape {tuple(ids.shape)}")
    if isinstance(q_global_start, bool) or not isinstance(q_global_start, int):
        raise TypeError(f"q_global_start: expected an int, got {type(q_global_start).__name__}")
    (b, nq), (bk, nk) = q_doc_ids.shape, kv_doc_ids.shape
    if b != bk:
        raise ValueError(f"q_doc_ids: batch {b} != kv_doc_ids batch {bk}")
    if q_global_start < 0 or q_global_start + nq > nk:
        raise ValueError(f"q_global_start: the query shard [{q_global_start}, {q_global_start + nq}) is outside "
                         f"the {nk} keys of kv_doc_ids")
    return nq


def _same_step(kv_doc_ids: torch.Tensor) -> bool:
    """Whether these ids hold the current step's values (same shape, dtype and device, equal elements)."""
    held = LAYOUT_GENERATION[0]
    return (held is not None and held.shape == kv_doc_ids.shape and held.dtype == kv_doc_ids.dtype
            and held.device == kv_doc_ids.device and bool(torch.equal(held, kv_doc_ids)))


def _build_layout(q_doc_ids, kv_doc_ids, q_length: int, q_global_start: int):
    ids = LAYOUT_GENERATION[1]  # the step's one device -> host copy
    if not torch.equal(q_doc_ids.detach().cpu(), ids[:, q_global_start:q_global_start + q_length]):
        raise ValueError(f"q_doc_ids: must equal kv_doc_ids[:, {q_global_start}:{q_global_start + q_length}] "
                         "(the ids of the local queries)")
    q_lens, k_lens = varlen_segments(ids, q_length, q_global_start)
    device = kv_doc_ids.device
    return (cu_seqlens_from_lengths(q_lens, device), cu_seqlens_from_lengths(k_lens, device), max(q_lens, default=0),
            max(k_lens, default=0))


def varlen_layout(q_doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor,
                   q_global_start: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """FA4 varlen layout ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a query shard.

    ``q_doc_ids [B, Nq]`` are the ids of the local queries, i.e. ``kv_doc_ids[:, q_global_start:][:, :Nq]``
    (checked once per step); ``kv_doc_ids [B, Nk]`` are the ids of all keys. The cu_seqlens are int32
    ``[segments + 1]`` on ``kv_doc_ids``' device (segments from :func:`varlen_segments`). Cached for the
    step by value: every layer whose ``kv_doc_ids`` hold the step's ids reuses the layout (one compare on
    their device per call; the ids reach the host once per step); ids that differ in any element, however
    they were written, start a new step."""
    q_length = _check_doc_ids(q_doc_ids, kv_doc_ids, q_global_start)
    if not _same_step(kv_doc_ids):
        LAYOUT_CACHE.clear()
        ids = kv_doc_ids.detach()
        LAYOUT_GENERATION[:] = [ids.clone(), ids.cpu()]
    key = (q_length, q_global_start, tuple(kv_doc_ids.shape))
    layout = LAYOUT_CACHE.get(key)
    if layout is None:
        layout = LAYOUT_CACHE[key] = _build_layout(q_doc_ids, kv_doc_ids, q_length, q_global_start)
    return layout


def document_causal_fa4_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_doc_ids: torch.Tensor,
                                  kv_doc_ids: torch.Tensor, q_global_start: int, scale: float) -> torch.Tensor:
    """Causal attention within documents for a contiguous query shard against all keys, on FA4 varlen.

    ``query [B, Hq, Nq, D]`` holds global positions ``q_global_start .. q_global_start + Nq - 1`` of each
    row; ``key [B, Hkv, Nk, D]`` and ``value [B, Hkv, Nk, Dv]`` hold all ``Nk`` positions. ``q_doc_ids [B, Nq]``
    / ``kv_doc_ids [B, Nk]``: document ids (``<= 0`` = padding), ``q_doc_ids`` being the shard's slice of
    ``kv_doc_ids``. A query sees the keys of its document run up to its own position. Returns
    ``[B, Hq, Nq, Dv]`` (SDPA layout), differentiable; padding queries are zero. ``scale`` multiplies
    ``q @ k^T``. Unequal qk/v head dims (192/128) run as they are."""
    b, hq, nq, hkv, nk = _sdpa_dims(query, key, value)
    for name, ids, n in (("q_doc_ids", q_doc_ids, nq), ("kv_doc_ids", kv_doc_ids, nk)):
        if isinstance(ids, torch.Tensor) and tuple(ids.shape) != (b, n):
            raise ValueError(f"{name}: expected shape {(b, n)} ([batch, sequence] of the attention inputs), "
                             f"got {tuple(ids.shape)}")
        if isinstance(ids, torch.Tensor) and ids.device != query.device:
            raise ValueError(f"{name}: on {ids.device}, the attention runs on {query.device}")
    cu_q, cu_k, max_q, max_k = varlen_layout(q_doc_ids, kv_doc_ids, q_global_start)
    out = attention(query.transpose(1, 2).reshape(b * nq, hq, -1), key.transpose(1, 2).reshape(b * nk, hkv, -1),
                    value.transpose(1, 2).reshape(b * nk, hkv, -1), softmax_scale=scale, causal=True,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, family="fa4",
                    check_inputs=False)  # built here from the ids: valid by construction
    out = out.view(b, nq, hq, -1).transpose(1, 2)
    return out.masked_fill((q_doc_ids <= PAD_DOC_ID)[:, None, :, None], 0.0)  # padding rows: 0, NaN-free
