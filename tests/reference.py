"""The one attention reference every test compares against (torch, fp64 by default).

Layouts as in xattn.core: dense q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D(v)]; varlen [T, H, D]
with cu_seqlens. Causal and windows are bottom-right aligned (FlashAttention): query i of
a segment with Nq queries and Nk keys sees key j iff
``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (causal: left=inf, right=0).
Rows that see no key give out = 0 and lse = -inf, and no gradient.
"""

from __future__ import annotations

import torch


def allowed(nq: int, nk: int, causal: bool, window=(None, None), device=None) -> torch.Tensor:
    """Bool mask [Nq, Nk] of visible keys."""
    i = torch.arange(nq, device=device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=device)[None, :]
    left, right = window
    if causal:
        right = 0
    mask = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if right is not None:
        mask &= j <= i + right
    if left is not None:
        mask &= j >= i - left
    return mask


def attention(q, k, v, *, scale: float, causal: bool = False, window=(None, None), dtype=torch.float64):
    """Dense reference; returns (out [B, Nq, Hq, Dv] in ``dtype``, lse [B, Hq, Nq])."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    mask = allowed(q.shape[1], k.shape[1], causal, window, device=q.device)
    any_key = mask.any(-1)  # [Nq]
    s = s.masked_fill(~mask, -1e30)
    p = torch.softmax(s, dim=-1) * any_key[:, None]
    out = torch.einsum("bhnm,bmhd->bnhd", p, v)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~any_key, float("-inf"))
    return out, lse


def varlen_attention(q, k, v, cu_q, cu_k, *, scale: float, causal: bool = False, window=(None, None),
                     dtype=torch.float64):
    """Packed reference; returns (out [Tq, Hq, Dv], lse [Hq, Tq]). Tokens past cu[-1] get 0 / -inf."""
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]), dtype=dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=dtype, device=q.device)
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs, qe, ks, ke = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if qe == qs:
            continue
        if ke == ks:  # no keys: zero output, -inf lse (already there)
            continue
        o, l_ = attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=scale, causal=causal,
                          window=window, dtype=dtype)
        outs.append((qs, qe, o[0]))
        lses.append((qs, qe, l_[0]))
    if outs:  # stitch without in-place writes so autograd flows
        pieces_o, pieces_l, pos = [], [], 0
        for (qs, qe, o), (_, _, l_) in zip(outs, lses):
            pieces_o += [out[pos:qs], o]
            pieces_l += [lse[:, pos:qs], l_]
            pos = qe
        pieces_o.append(out[pos:])
        pieces_l.append(lse[:, pos:])
        out, lse = torch.cat(pieces_o), torch.cat(pieces_l, dim=1)
    return out, lse


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over finite reference entries (fp64)."""
    fin = torch.isfinite(ref)
    x, ref = x.to(torch.float64)[fin], ref.to(torch.float64)[fin]
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def attention_bwd(dout, q, k, v, out, lse, *, scale: float, causal: bool = False, window=(None, None)):
    """Dense backward from the SUPPLIED out/lse (FlashAttention formulas, fp64, no autograd)."""
    f = torch.float64
    g = q.shape[2] // k.shape[2]
    kk, vv = k.to(f).repeat_interleave(g, dim=2), v.to(f).repeat_interleave(g, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q.to(f), kk) * scale
    mask = allowed(q.shape[1], k.shape[1], causal, window, device=q.device)
    lse = lse.to(f)[..., None]
    p = torch.where(mask & torch.isfinite(lse), torch.exp(s - torch.where(torch.isfinite(lse), lse, 0)), 0)
    do = dout.to(f)
    dvv = torch.einsum("bhnm,bnhd->bmhd", p, do)
    dp = torch.einsum("bnhd,bmhd->bhnm", do, vv)
    delta = torch.einsum("bnhd,bnhd->bhn", do, out.to(f))[..., None]
    ds = p * (dp - delta)
    dq = torch.einsum("bhnm,bmhd->bnhd", ds, kk) * scale
    dkk = torch.einsum("bhnm,bnhd->bmhd", ds, q.to(f)) * scale
    b, m, hkv = k.shape[:3]
    # explicit sizes, not -1: a reshape of 0 elements (B, Nk or Nq = 0) cannot infer one
    return dq, dkk.reshape(b, m, hkv, g, q.shape[-1]).sum(3), dvv.reshape(b, m, hkv, g, v.shape[-1]).sum(3)


def poison_allocator():
    """Leave NaN in freed blocks of torch's CUDA caching allocator (large and small pools), so a partial row that no
    kernel writes reads NaN rather than a lucky 0 (GPU tests)."""
    blocks = [torch.full((2 ** 26,), float("nan"), device="cuda")]
    blocks += [torch.full((2 ** 16,), float("nan"), device="cuda") for _ in range(64)]
    del blocks
