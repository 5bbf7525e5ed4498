"""SDPA-layout references for the FA4 helper tests (CPU and GPU): attention under an explicit mask, in any
dtype (fp64 for the truth, fp16/bf16 for the error budget), and the masks the helpers promise."""

import torch


def causal_mask(batch: int, n: int, device=None) -> torch.Tensor:
    """``[B, N, N]`` bool: query i sees keys j <= i."""
    pos = torch.arange(n, device=device)
    return (pos[None, :] <= pos[:, None]).expand(batch, n, n)


def document_causal_mask(q_doc_ids, kv_doc_ids, q_global_start: int) -> torch.Tensor:
    """``[B, Nq, Nk]`` bool: the query at global position p sees the keys of its run of equal document ids
    (padding runs included) at positions <= p."""
    change = kv_doc_ids[:, 1:] != kv_doc_ids[:, :-1]
    runs = torch.cat([torch.zeros_like(change[:, :1]), change], 1).long().cumsum(1)
    nq, nk = q_doc_ids.shape[1], kv_doc_ids.shape[1]
    q_runs = runs[:, q_global_start:q_global_start + nq]
    pos_q = torch.arange(nq, device=runs.device) + q_global_start
    pos_k = torch.arange(nk, device=runs.device)
    return (q_runs[:, :, None] == runs[:, None, :]) & (pos_k[None, None, :] <= pos_q[None, :, None])


def sdpa_reference(q, k, v, mask, scale: float, dtype=torch.float64, keep_queries=None) -> torch.Tensor:
    """q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nk, D/Dv]`` (GQA: Hkv divides Hq), mask ``[B, Nq, Nk]`` bool ->
    ``[B, Hq, Nq, Dv]`` computed in ``dtype`` (differentiable). Rows with no visible key and rows where
    ``keep_queries [B, Nq]`` is False are zero."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    visible = mask[:, None]
    p = torch.softmax(s.masked_fill(~visible, torch.finfo(dtype).min), -1)
    keep = visible.any(-1, keepdim=True)
    if keep_queries is not None:
        keep = keep & keep_queries[:, None, :, None].bool()
    return torch.where(keep, p @ v, torch.zeros((), dtype=dtype, device=q.device))
