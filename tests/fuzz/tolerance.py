"""Tolerances relative to fp64, scaled as FlashAttention's tests scale them.

FlashAttention's tests compare a kernel with an fp32 reference and allow a multiple of the error
that the same computation makes in the input precision (``attention_ref(..., upcast=False)``):
``|out - ref|max <= rtol * |out_lowprec - ref|max + atol``. Here the reference is fp64
(``tests/reference.py``, the suite's one reference) and the low-precision twin is
:func:`lowprec_attention`. For each quantity x of a configuration (out, lse; dq, dk, dv)::

    err(x)    = max |x - x64|            over the entries where x64 is finite
    err_lp(x) = max |x_lowprec - x64|    the same computation in bf16/fp16 (autograd for grads)
    tol(x)    = K[x] * err_lp(x) + eps(dtype) * max(max |x64|, 1)
    ratio(x)  = err(x) / tol(x)          a configuration passes iff every ratio <= 1

K = 2 for out and lse, 3 for dq, dk, dv (backward kernels accumulate over more terms). The
absolute floor is one unit in the last place of the input dtype at the quantity's largest value
(at least 1): it keeps a configuration whose low-precision twin happens to be exact (one key,
rows that see one key) from demanding bit-exactness. Besides the numbers, a configuration fails
on any NaN, on lse != -inf where a row sees no key (and out != 0 there), and on a non-finite
value where the reference is finite.

Dtype-agnostic torch code: runs on CUDA for the GPU fuzz and on the CPU for the stand-in tests.
"""

from __future__ import annotations

import math

import torch

from tests.reference import allowed

__all__ = ["K", "eps", "lowprec_attention", "lowprec_varlen_attention", "masked_attention", "max_err", "compare",
           "Check"]

K = {"out": 2.0, "lse": 2.0, "dq": 3.0, "dk": 3.0, "dv": 3.0}
_EPS = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23,
        torch.float64: 2.0 ** -52}


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of ``dtype`` (the spacing of its numbers at 1.0)."""
    return _EPS[dtype]


def lowprec_attention(q, k, v, *, scale: float, causal: bool = False, window=(None, None)):
    """Dense attention computed in q's dtype: ``(out [B, Nq, Hq, Dv], lse [B, Hq, Nq] fp32)``.

    Scores, probabilities and the PV product are rounded to the input dtype where a framework
    computing in that dtype rounds them (matmuls accumulate in fp32 inside, as cuBLAS does); lse is
    the fp32 logsumexp of the rounded scores (fp64 for fp64 inputs). Masks as in
    ``tests/reference.py``; rows that see no key give out 0 and lse -inf, and no gradient.
    Differentiable (the low-precision backward).
    """
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    mask = allowed(q.shape[1], k.shape[1], causal, window, device=q.device)
    any_key = mask.any(-1)  # [Nq]
    s = s.masked_fill(~(mask | ~any_key[:, None]), float("-inf"))  # empty rows: softmax over all, then 0
    p = torch.softmax(s, dim=-1).masked_fill(~any_key[:, None], 0)
    out = torch.einsum("bhnm,bmhd->bnhd", p, v)
    lse = torch.logsumexp(s.to(torch.promote_types(s.dtype, torch.float32)), dim=-1)
    lse = lse.masked_fill(~any_key, float("-inf"))
    return out, lse


def masked_attention(q, k, v, mask, *, scale: float) -> torch.Tensor:
    """out ``[B, Nq, Hq, Dv]`` computed in q's dtype under an explicit bool mask ``[B, Nq, Nk]`` (True =
    attend), rounded as :func:`lowprec_attention` rounds; rows without a visible key give 0 (and no
    gradient). Differentiable. The drop-in front ends' masks (HF, FA4 helpers, jax.nn) are judged on it."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    m = mask[:, None].to(s.device)
    any_key = m.any(-1, keepdim=True)
    s = s.masked_fill(~(m | ~any_key), float("-inf"))  # empty rows: softmax over all, then 0
    p = torch.softmax(s, dim=-1).masked_fill(~any_key, 0)
    return torch.einsum("bhnm,bmhd->bnhd", p, v)


def _lse_dtype(q) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def lowprec_varlen_attention(q, k, v, cu_q, cu_k, *, scale: float, causal: bool = False, window=(None, None)):
    """Packed twin of :func:`lowprec_attention`: ``(out [Tq, Hq, Dv], lse [Hq, Tq])``, per document."""
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(bounds_q) - 1):
        qs, qe, ks, ke = bounds_q[b], bounds_q[b + 1], bounds_k[b], bounds_k[b + 1]
        if qe == qs:
            continue
        if ke == ks:  # queries without keys
            outs.append(q.new_zeros((qe - qs, q.shape[1], v.shape[-1])))
            lses.append(torch.full((q.shape[1], qe - qs), float("-inf"), device=q.device, dtype=_lse_dtype(q)))
            continue
        o, l_ = lowprec_attention(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], scale=scale, causal=causal,
                                  window=window)
        outs.append(o[0])
        lses.append(l_[0])
    tail = q.shape[0] - bounds_q[-1]  # tokens after the last document belong to none
    outs.append(q.new_zeros((tail, q.shape[1], v.shape[-1])))
    lses.append(torch.full((q.shape[1], tail), float("-inf"), device=q.device, dtype=_lse_dtype(q)))
    return torch.cat(outs), torch.cat(lses, dim=1)


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |x - ref|`` (fp64) over the entries where ``ref`` is finite; 0 for no such entry."""
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return 0.0
    return (x.to(torch.float64)[fin] - ref.to(torch.float64)[fin]).abs().max().item()


def _max_abs(ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    return ref.to(torch.float64)[fin].abs().max().item() if bool(fin.any()) else 0.0


class Check:
    """Errors and tolerance of one quantity: ``err``, ``err_lp``, ``tol``, ``ratio``, ``problems``."""

    def __init__(self, name: str, err: float, err_lp: float, tol: float, problems: list[str]):
        self.name, self.err, self.err_lp, self.tol, self.problems = name, err, err_lp, tol, problems
        self.ratio = err / tol if tol > 0 else (0.0 if err == 0 else math.inf)

    @property
    def ok(self) -> bool:
        return not self.problems and self.ratio <= 1.0

    def __repr__(self) -> str:
        extra = f" {'; '.join(self.problems)}" if self.problems else ""
        return (f"{self.name}: err {self.err:.3g} / tol {self.tol:.3g} (lowprec {self.err_lp:.3g}) "
                f"= {self.ratio:.3g}{extra}")


def compare(name: str, got: torch.Tensor, ref64: torch.Tensor, ref_lp: torch.Tensor, dtype: torch.dtype) -> Check:
    """Judge ``got`` against the fp64 reference, scaled by the low-precision twin's error (module doc)."""
    problems = []
    if got.shape != ref64.shape:
        return Check(name, math.inf, 0.0, 0.0, [f"shape {tuple(got.shape)} != {tuple(ref64.shape)}"])
    if bool(torch.isnan(got).any()):
        problems.append(f"{int(torch.isnan(got).sum())} NaN")
    fin = torch.isfinite(ref64)
    if bool((~torch.isfinite(got) & fin).any()):
        problems.append(f"{int((~torch.isfinite(got) & fin).sum())} non-finite where the reference is finite")
    if bool((~fin).any()) and not bool((got[~fin] == ref64[~fin].to(got.dtype)).all()):
        problems.append("entries where the reference is -inf (rows that see no key) differ")
    err = max_err(torch.nan_to_num(got, nan=0.0) if problems else got, ref64)
    err_lp = max_err(ref_lp, ref64)
    tol = K[name] * err_lp + eps(dtype) * max(_max_abs(ref64), 1.0)
    return Check(name, err, err_lp, tol, problems)
