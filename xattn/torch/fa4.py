"""FA4 helpers for torch: a drop-in for NeMo AutoModel's ``nemo_automodel.components.attention.fa4``.

The same functions, parameter names, defaults, layouts and results as that module, with the attention
computed by xattn's FA4 launchers (head dims 64, 96, 128, 192/128, 192, 256; fp16/bf16 on sm90) through
:func:`xattn.torch.attention.attention_with_lse` instead of ``flash_attn.cute``'s own autograd functions.

Layouts:

* :func:`causal_fa4_attention` and :func:`document_causal_fa4_attention` take and return SDPA layout
  ``[batch, heads, sequence, head_dim]`` (K/V may have fewer heads than Q: GQA). The kernels read
  ``[batch, sequence, heads, head_dim]`` views of them (no copy for the dense call). Dimension 1 is
  ALWAYS read as heads: a ``[B, N, H, D]`` tensor whose shape happens to pass the checks would be
  computed as if it were ``[B, H, N, D]``, so transpose FlashAttention-layout tensors first.
* The entry points returned by :func:`_load_fa4` keep FlashAttention's layouts: dense ``[B, N, H, D]``,
  varlen ``[T, H, D]`` with int32 ``cu_seqlens``; lse ``[B, H, N]`` / ``[H, T]`` fp32. A call using a
  feature xattn's launchers lack (``softcap``, ``mask_mod``/``score_mod``, ``deterministic=True``, ...)
  is handed to ``flash_attn.cute``'s own function with the same arguments, as NeMo's ``_load_fa4`` returns
  those functions themselves.

Document ids are integer tensors ``[batch, sequence]``: documents numbered from 1, ids ``<= 0`` for padding
(``_PAD_DOC_ID``, 0, as NeMo writes them; -1 too). Every run of equal ids in a row is one varlen segment, cut
where the local query shard ends, so a query at global position ``p`` sees exactly the keys of its run up to
``p``: FA4's causal mask is aligned to the bottom-right corner of each segment. Segments without local queries
keep their keys, so the key segments tile the flattened ``[batch * key_sequence]`` tensor and nothing is
gathered. Padding queries return zeros.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from xattn.core.checks import check_window
from xattn.core.device import prepare_dsl_environment
from xattn.core.info import missing_modules
from xattn.core.spec import window_side

from .attention import attention, attention_with_lse

__all__ = ["import_fa4_modules", "causal_fa4_attention", "document_causal_fa4_attention"]

_log = logging.getLogger(__name__)
_PAD_DOC_ID = 0  # padding ids are <= 0 (0 as NeMo writes them; any id <= 0 counts as padding)
# The varlen layouts of the current step. ``_LAYOUT_GENERATION`` holds ``[ids, host ids]``: a private copy of
# the step's kv_doc_ids on their device and its one host copy. A call belongs to the step when its
# kv_doc_ids hold the same values (compared on their device: one small sync per call), so a new tensor,
# an in-place write (through autograd, numpy or ``.data``) and inference-mode tensors, which have no
# version counter, always get the layout of the ids they hold. The step's layouts are keyed by
# ``(q_length, q_global_start, kv shape)``.
_LAYOUT_CACHE: dict[tuple, Any] = {}
_LAYOUT_GENERATION: list[Any] = [None, None]

_PIP_HINT = "pip install flash-attn-4==4.0.0b36"
_FA4_PACKAGES = ("flash_attn", "cutlass", "tvm_ffi", "quack")  # what xattn's FA4 launchers import


def import_fa4_modules(*names: str) -> tuple[types.ModuleType, ...]:
    """Import the named modules (e.g. ``"flash_attn.cute.interface"``, ``"cutlass.cute"``) and return them as a
    tuple in the order given; no names gives ``()``.

    Every module that fails to import is listed in ONE ``ImportError`` that ends with the pip command for
    FA4. On a machine without a GPU the CuTeDSL target is pinned to sm_90a first (xattn does this before
    any kernel import), so importing cutlass here does not fix it to another arch."""
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"names: expected module names (str), got {type(name).__name__}")
    if names:
        prepare_dsl_environment()
    modules, missing = [], []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        raise ImportError(f"FlashAttention 4 / CuTe DSL modules missing: {'; '.join(missing)}. {_PIP_HINT}")
    return tuple(modules)


# --- the FA4 entry points (flash_attn.cute's calling convention, xattn's kernels) --------------------

# Arguments that pick how flash_attn.cute splits the work, never the result: accepted and ignored.
_SCHEDULING_HINTS = frozenset({"num_splits", "pack_gqa", "min_seqlen_k", "scheduler_metadata",
                               "seqlen_k_per_split", "disable_scheduler_metadata"})
_SERVED = frozenset({"q", "k", "v", "softmax_scale", "causal", "window_size", "return_lse", "cu_seqlens_q",
                     "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"})


def _missing_packages() -> list[str]:
    return missing_modules(_FA4_PACKAGES)


@functools.cache
def _load_fa4() -> tuple[Callable, Callable]:
    """The FA4 dense and varlen entry points ``(flash_attn_func, flash_attn_varlen_func)``, resolved once.

    They take ``flash_attn.cute``'s arguments (names, order, defaults) and return what it returns,
    ``(out, lse)``, but run on xattn's launchers (see :func:`flash_attn_func`). Raises ``ImportError``
    with the pip command when the FA4 stack is not installed (checked without importing it)."""
    missing = _missing_packages()
    if missing:
        raise ImportError(f"FlashAttention 4 needs the Python packages {', '.join(missing)}: {_PIP_HINT}")
    return flash_attn_func, flash_attn_varlen_func


@functools.cache
def _defaults(fn) -> dict[str, Any]:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()}


def _unserved(fn, given: dict[str, Any]) -> str | None:
    """The first argument of ``fn`` set away from its default that xattn's launchers do not serve, else None."""
    for name, default in _defaults(fn).items():
        if name in _SERVED or name in _SCHEDULING_HINTS:
            continue
        value = given[name]
        if value is default or (not isinstance(value, torch.Tensor) and value == default):
            continue
        return name
    if given["return_lse"] and torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (given["q"], given["k"], given["v"])):
        return "return_lse under autograd"  # flash_attn.cute differentiates through its lse; xattn's has no gradient
    return None


_HANDED_OVER: set[str] = set()


def _flash_attn_cute(fn, given: dict[str, Any]):
    """``flash_attn.cute``'s own ``fn`` on the caller's arguments, or None when xattn's launchers serve them all.
    The first hand-over per argument is logged (INFO)."""
    why = _unserved(fn, given)
    if why is None:
        return None
    if why not in _HANDED_OVER:
        _HANDED_OVER.add(why)
        _log.info("xattn fa4: %s runs on flash_attn.cute's own %s (xattn's launchers lack it)", why, fn.__name__)
    (interface,) = import_fa4_modules("flash_attn.cute.interface")
    return getattr(interface, fn.__name__)(**given)


def _fa4_window(causal: bool, window_size) -> tuple:
    """flash_attn.cute's reading of ``window_size``: ``(-1, -1)`` means unbounded; causal forces right = 0.
    Each side is first judged as everywhere in xattn (``None`` / ``-1`` unbounded, other negatives raise),
    also the right side that causality then overrides."""
    left, right = check_window(window_size)
    window_side("left", left)
    window_side("right", right)
    if left is not None and right is not None and left < 0 and right < 0:
        left = right = None
    if causal and (left is not None or right is not None):
        right = 0
    return left, right


def _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse, **varlen):
    """``(out, lse)`` as flash_attn.cute returns them: lse is None unless asked for or q/k/v require grad."""
    needs_grad = any(t.requires_grad for t in (q, k, v))
    out, lse = attention_with_lse(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                  window_size=_fa4_window(causal, window_size), family="fa4", **varlen)
    return out, (lse if return_lse or needs_grad else None)


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """``flash_attn.cute.flash_attn_func`` on xattn's FA4 launchers: q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D/Dv]``
    -> ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] fp32 or None)``; out is differentiable.

    Served: ``softmax_scale`` (None = 1/sqrt(D)), ``causal`` and ``window_size`` (bottom-right aligned),
    ``return_lse`` (outside autograd). Scheduling hints (``num_splits``, ``pack_gqa``) are ignored. A call
    with any other argument away from its default (``qv``, ``softcap``, ``learnable_sink``,
    ``score_mod``/``mask_mod``, block sparsity, ``deterministic=True``, the sparse-MLA gather options) or
    ``return_lse=True`` under autograd runs on ``flash_attn.cute.flash_attn_func`` itself, same arguments
    (ImportError with the pip command where it is not installed)."""
    handed = _flash_attn_cute(flash_attn_func, locals())
    if handed is not None:
        return handed
    return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse)


def _max_len(cu_seqlens, given) -> int:
    if given is not None:
        return int(given)
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0


def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                           max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                           gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
                           block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False,
                           scheduler_metadata=None, seqlen_k_per_split=None, disable_scheduler_metadata=False,
                           gather_bwd_recompute_p=False, gather_bwd_token_chunk=None):
    """``flash_attn.cute.flash_attn_varlen_func`` on xattn's FA4 launchers: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D/Dv]``,
    int32 ``cu_seqlens_q/k [S + 1]`` -> ``(out [Tq, Hq, Dv], lse [Hq, Tq] fp32 or None)``.

    As :func:`flash_attn_func`, plus: ``max_seqlen_q/k`` default to the longest segment (read on the
    host); without cu_seqlens, q/k/v are dense ``[B, N, H, D]``. ``seqused_q/k``, ``page_table`` and
    the other unserved arguments hand the call to ``flash_attn.cute.flash_attn_varlen_func`` itself.

    Checked mode: the signature is flash_attn.cute's, so there is no ``check_inputs`` keyword here;
    ``XATTN_CHECK_INPUTS=1`` checks cu_seqlens on their device before the launch (int32, start 0,
    non-decreasing, end <= T, segments <= max_seqlen; one host sync; a ``ValueError`` naming the first
    bad index). Unchecked (the default), bad cu_seqlens are undefined behaviour, as in flash_attn.cute."""
    given = dict(locals())
    handed = _flash_attn_cute(flash_attn_varlen_func, given)
    if handed is not None:
        return handed
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse)
    if cu_seqlens_q is None or cu_seqlens_k is None:  # one side packed: flash_attn.cute's own function
        (interface,) = import_fa4_modules("flash_attn.cute.interface")
        return interface.flash_attn_varlen_func(**given)
    return _run_fa4(q, k, v, softmax_scale, causal, window_size, return_lse, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=_max_len(cu_seqlens_q, max_seqlen_q),
                    max_seqlen_k=_max_len(cu_seqlens_k, max_seqlen_k))


# --- the helpers (SDPA layout) ---------------------------------------------------------------------

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


def _varlen_segments(kv_doc_ids, q_length: int, q_global_start: int) -> tuple[list[int], list[int]]:
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
    held = _LAYOUT_GENERATION[0]
    return (held is not None and held.shape == kv_doc_ids.shape and held.dtype == kv_doc_ids.dtype
            and held.device == kv_doc_ids.device and bool(torch.equal(held, kv_doc_ids)))


def _cumulative(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32).to(device)


def _build_layout(q_doc_ids, kv_doc_ids, q_length: int, q_global_start: int):
    ids = _LAYOUT_GENERATION[1]  # the step's one device -> host copy
    if not torch.equal(q_doc_ids.detach().cpu(), ids[:, q_global_start:q_global_start + q_length]):
        raise ValueError(f"q_doc_ids: must equal kv_doc_ids[:, {q_global_start}:{q_global_start + q_length}] "
                         "(the ids of the local queries)")
    q_lens, k_lens = _varlen_segments(ids, q_length, q_global_start)
    device = kv_doc_ids.device
    return _cumulative(q_lens, device), _cumulative(k_lens, device), max(q_lens, default=0), max(k_lens, default=0)


def _varlen_layout(q_doc_ids: torch.Tensor, kv_doc_ids: torch.Tensor,
                   q_global_start: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """FA4 varlen layout ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a query shard.

    ``q_doc_ids [B, Nq]`` are the ids of the local queries, i.e. ``kv_doc_ids[:, q_global_start:][:, :Nq]``
    (checked once per step); ``kv_doc_ids [B, Nk]`` are the ids of all keys. The cu_seqlens are int32
    ``[segments + 1]`` on ``kv_doc_ids``' device (segments from :func:`_varlen_segments`). Cached for the
    step by value: every layer whose ``kv_doc_ids`` hold the step's ids reuses the layout (one compare on
    their device per call; the ids reach the host once per step); ids that differ in any element, however
    they were written, start a new step."""
    q_length = _check_doc_ids(q_doc_ids, kv_doc_ids, q_global_start)
    if not _same_step(kv_doc_ids):
        _LAYOUT_CACHE.clear()
        ids = kv_doc_ids.detach()
        _LAYOUT_GENERATION[:] = [ids.clone(), ids.cpu()]
    key = (q_length, q_global_start, tuple(kv_doc_ids.shape))
    layout = _LAYOUT_CACHE.get(key)
    if layout is None:
        layout = _LAYOUT_CACHE[key] = _build_layout(q_doc_ids, kv_doc_ids, q_length, q_global_start)
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
    cu_q, cu_k, max_q, max_k = _varlen_layout(q_doc_ids, kv_doc_ids, q_global_start)
    out = attention(query.transpose(1, 2).reshape(b * nq, hq, -1), key.transpose(1, 2).reshape(b * nk, hkv, -1),
                    value.transpose(1, 2).reshape(b * nk, hkv, -1), softmax_scale=scale, causal=True,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, family="fa4",
                    check_inputs=False)  # built here from the ids: valid by construction
    out = out.view(b, nq, hq, -1).transpose(1, 2)
    return out.masked_fill((q_doc_ids <= _PAD_DOC_ID)[:, None, :, None], 0.0)  # padding rows: 0, NaN-free
