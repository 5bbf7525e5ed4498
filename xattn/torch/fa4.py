"""FA4 helpers for torch: plain causal attention and document-causal attention over packed rows
whose queries are a shard of the key sequence (context parallelism).

Layout ``[B, N, H, D]`` (FlashAttention). Document ids are int tensors ``[B, N]`` with 0 =
padding. Causal is bottom-right aligned per segment, so a query shard that starts at global
position ``q_global_start`` sees exactly the keys of its document up to itself.
"""

from __future__ import annotations

import importlib

import torch

from .attention import attention

__all__ = ["import_fa4_modules", "causal_fa4_attention", "document_causal_fa4_attention"]


def import_fa4_modules(*names: str):
    """Import FA4 modules by name (default ``flash_attn.cute``); one ``ImportError`` lists all missing."""
    names = names or ("flash_attn.cute",)
    modules, missing = [], []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    if missing:
        raise ImportError("FA4 modules missing: " + "; ".join(missing) + ". pip install flash-attn-4==4.0.0b36")
    return modules[0] if len(modules) == 1 else tuple(modules)


def causal_fa4_attention(query, key, value, scale: float):
    """Causal FA4 attention: query ``[B, Nq, Hq, D]``, key/value ``[B, Nk, Hkv, D]`` -> ``[B, Nq, Hq, Dv]``."""
    return attention(query, key, value, softmax_scale=scale, causal=True, family="fa4")


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


_layout_cache: dict = {}


def _varlen_layout(kv_doc_ids, q_length: int, q_global_start: int):
    """``(cu_q, cu_k, max_q, max_k)`` on the ids' device; cached per step, keyed by the doc-id tensor."""
    key = (id(kv_doc_ids), kv_doc_ids._version, tuple(kv_doc_ids.shape), q_length, q_global_start)
    hit = _layout_cache.get("entry")
    if hit is not None and hit[0] == key:
        return hit[1]
    q_lens, k_lens = _varlen_segments(kv_doc_ids, q_length, q_global_start)

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=kv_doc_ids.device)
    layout = (cu(q_lens), cu(k_lens), max(q_lens), max(k_lens))
    _layout_cache["entry"] = (key, layout)
    return layout


def document_causal_fa4_attention(query, key, value, q_doc_ids, kv_doc_ids, q_global_start: int, scale: float):
    """Document-causal FA4 attention for a query shard: query ``[B, Nq, Hq, D]``, key/value ``[B, Nk, Hkv, D]``.

    ``q_doc_ids [B, Nq]``, ``kv_doc_ids [B, Nk]`` (0 = padding); queries are global positions
    ``q_global_start .. + Nq`` of each row. Padding queries get zero output.
    """
    b, nq = query.shape[:2]
    nk = key.shape[1]
    cu_q, cu_k, max_q, max_k = _varlen_layout(kv_doc_ids, nq, q_global_start)
    out = attention(query.reshape(b * nq, *query.shape[2:]), key.reshape(b * nk, *key.shape[2:]),
                    value.reshape(b * nk, *value.shape[2:]), softmax_scale=scale, causal=True,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, family="fa4")
    out = out.reshape(b, nq, *out.shape[1:])
    return out * (q_doc_ids != 0)[:, :, None, None].to(out.dtype)
