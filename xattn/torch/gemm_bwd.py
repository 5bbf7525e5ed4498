"""Torch driver of the chunked-GEMM backward (see :mod:`xattn.core.gemm_bwd` for the math).

:func:`gemm_backward` takes dense ``[B, N, H, D]`` tensors and returns ``(dq, dk, dv)``, contiguous,
in q's dtype. The layout glue (query rows of a KV head's query heads stacked per block, δ,
fp32 -> 16-bit) runs as torch ops; the five GEMMs per block are quack sm90 GEMMs with the fused
epilogues of :mod:`xattn.core.gemm_bwd_epilogues`. Scratch: :func:`xattn.core.gemm_bwd.workspace_bytes`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from xattn.core import gemm_bwd as plan_mod

__all__ = ["gemm_backward", "QuackGemms", "TorchGemms"]

LOG2E = 1.4426950408889634


class QuackGemms:
    """The four GEMM kinds of a block on quack's sm90 GEMMs (the default per-arch config)."""

    def __init__(self):
        from quack import gemm_interface

        from xattn.core import gemm_bwd_epilogues as epi

        self._gi, self._epi = gemm_interface, epi

    def probs(self, a, b, p, p32, rowbias, rowpos, colpos, scale_log2, causal):
        out = {"D": p, "p32": p32}
        if causal:
            self._epi.probs_causal(a, b, out=out, rowbias=rowbias, rowpos=rowpos, colpos=colpos,
                                   scale_log2=scale_log2, tuned=False)
        else:
            self._epi.probs_full(a, b, out=out, rowbias=rowbias, scale_log2=scale_log2, tuned=False)

    def grad_scores(self, a, b, ds, p32, delta, scale):
        self._epi.grad_scores(a, b, out={"D": ds}, p32=p32, delta=delta, scale=scale, tuned=False)

    def add_into(self, a, b, acc):
        self._gi.gemm_add_inplace(a, b, acc, tuned=False)

    def add_to(self, a, b, c, out):
        self._gi.gemm_add(a, b, c, out=out, tuned=False)

    def mm(self, a, b, out):
        self._gi.gemm_out(a, b, out, tuned=False)


class TorchGemms:
    """The same four GEMM kinds as fp32 torch matmuls: a reference that runs anywhere (tests)."""

    def probs(self, a, b, p, p32, rowbias, rowpos, colpos, scale_log2, causal):
        x = torch.matmul(a.float(), b.float()) * scale_log2 + rowbias[..., :, None]
        if causal:
            from xattn.core.gemm_bwd_epilogues import MASK_PENALTY

            x = x - MASK_PENALTY * torch.relu(colpos[..., None, :] - rowpos[..., :, None])
        p32.copy_(torch.exp2(x))
        p.copy_(p32)

    def grad_scores(self, a, b, ds, p32, delta, scale):
        ds.copy_((torch.matmul(a.float(), b.float()) - delta[..., :, None]) * p32 * scale)

    def add_into(self, a, b, acc):
        acc.add_(torch.matmul(a.float(), b.float()))

    def add_to(self, a, b, c, out):
        out.copy_(torch.matmul(a.float(), b.float()) + c)

    def mm(self, a, b, out):
        out.copy_(torch.matmul(a.float(), b.float()))


_QUACK: QuackGemms | None = None


def _quack() -> QuackGemms:
    global _QUACK
    if _QUACK is None:
        _QUACK = QuackGemms()
    return _QUACK


def _rows_to_blocks(x: Tensor, hkv: int, rows: int, padded: int) -> Tensor:
    """``[B, N, Hq, D]`` -> ``[B*Hkv, C, rows*g, D]``, GEMM row ``r*g + i`` = query row r of head
    ``kv*g + i`` (a group's heads stay one contiguous ``g*D`` run: a fast copy). Padded rows are zero."""
    b, n, hq, d = x.shape
    g, c = hq // hkv, padded // rows
    out = torch.empty(b, hkv, c, rows, g * d, device=x.device, dtype=x.dtype)
    full = n // rows
    if full:
        out[:, :, :full].copy_(x[:, : full * rows].view(b, full, rows, hkv, g * d).permute(0, 3, 1, 2, 4))
    if n > full * rows:
        rest = n - full * rows
        out[:, :, full, :rest].copy_(x[:, full * rows:].view(b, rest, hkv, g * d).transpose(1, 2))
        out[:, :, full, rest:].zero_()
    return out.view(b * hkv, c, rows * g, d)


def _blocks_to_rows(xp: Tensor, out: Tensor, rows: int) -> None:
    """Inverse of :func:`_rows_to_blocks` into ``out`` ``[B, N, Hq, D]`` (padded rows dropped)."""
    b, n, hq, d = out.shape
    hkv = xp.shape[0] // b
    g, c = hq // hkv, xp.shape[1]
    x5 = xp.view(b, hkv, c, rows, g * d)
    full = n // rows
    if full:
        out[:, : full * rows].view(b, full, rows, hkv, g * d).copy_(x5[:, :, :full].permute(0, 2, 3, 1, 4))
    if n > full * rows:
        rest = n - full * rows
        out[:, full * rows:].view(b, rest, hkv, g * d).copy_(x5[:, :, full, :rest].transpose(1, 2))


def _vec_to_blocks(x: Tensor, hkv: int, rows: int, padded: int, fill: float) -> Tensor:
    """``[B, Hq, N]`` fp32 -> ``[B*Hkv, C, rows*g]`` in :func:`_rows_to_blocks`' row order
    (padded rows hold ``fill``); always row-contiguous, as quack's TMA needs."""
    b, hq, n = x.shape
    g, c = hq // hkv, padded // rows
    x = torch.nn.functional.pad(x, (0, padded - n), value=fill)  # may be x itself (no padding): any strides
    out = torch.empty(b, hkv, c, rows, g, device=x.device, dtype=x.dtype)
    out.copy_(x.reshape(b, hkv, g, c, rows).permute(0, 1, 3, 4, 2))
    return out.view(b * hkv, c, rows * g)


def _delta(dout: Tensor, out: Tensor) -> Tensor:
    """``rowsum(dO ⊙ O)`` in fp32, ``[B, Hq, N]``, in slices of ~256 MiB of fp32 temporaries."""
    b, n, hq, d = out.shape
    delta = torch.empty(b, n, hq, device=out.device, dtype=torch.float32)
    step = max(1, (256 << 20) // max(1, 4 * b * hq * d))
    for s in range(0, n, step):
        e = min(n, s + step)
        delta[:, s:e] = (dout[:, s:e].float() * out[:, s:e].float()).sum(-1)
    return delta.transpose(1, 2)


def gemm_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *,
                  softmax_scale: float, causal: bool, gemms=None, rows: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor]:
    """dq ``[B, Nq, Hq, D]``, dk/dv ``[B, Nk, Hkv, D]`` (summed over each GQA group) from the given
    out/lse (lse fp32 ``[B, Hq, Nq]``, natural log; ``-inf`` rows contribute nothing).

    Causal is bottom-right aligned. ``gemms`` defaults to quack's GEMMs; ``rows`` overrides the
    block rows that the budget (``XATTN_GEMM_BWD_BUDGET_MIB``) gives.
    """
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    g, L = Hq // Hkv, B * Hkv
    dev, dt = q.device, q.dtype
    gemms = _quack() if gemms is None else gemms
    p = plan_mod.plan(B, Nq, Nk, Hq, causal, rows=rows)
    R, C, Np, nk8 = p.rows, p.num_blocks, p.padded_q, p.keys_stride
    shift = Nk - Nq

    qp = _rows_to_blocks(q, Hkv, R, Np)
    dop = _rows_to_blocks(dout, Hkv, R, Np)
    kp = k.permute(0, 2, 1, 3).reshape(L, Nk, D)
    vp = v.permute(0, 2, 1, 3).reshape(L, Nk, D)
    rowbias = _vec_to_blocks(torch.where(torch.isfinite(lse), lse * -LOG2E, -math.inf), Hkv, R, Np, -math.inf)
    delta = _vec_to_blocks(_delta(dout, out), Hkv, R, Np, 0.0)
    pos = torch.arange(Np, device=dev, dtype=torch.float32) + shift
    rowpos = pos.view(1, C, R, 1).expand(L, C, R, g).reshape(L, C, R * g)
    colpos = torch.arange(nk8, device=dev, dtype=torch.float32).expand(L, nk8).contiguous()
    if C > 1:  # fp32 accumulators of dk/dv over the blocks (one block writes dk/dv directly)
        dk_acc = torch.zeros(L, Nk, D, device=dev, dtype=torch.float32)
        dv_acc = torch.zeros_like(dk_acc)
    dqp = torch.empty(L, C, g * R, D, device=dev, dtype=dt)
    n_scores = L * g * R * nk8
    p_buf = torch.empty(n_scores, device=dev, dtype=dt)
    ds_buf = torch.empty(n_scores, device=dev, dtype=dt)
    p32_buf = torch.empty(n_scores, device=dev, dtype=torch.float32)
    dk = torch.empty(B, Nk, Hkv, D, device=dev, dtype=dt)
    dv = torch.empty_like(dk)
    scale_log2 = softmax_scale * LOG2E
    assert p.blocks[-1][1] == Nk  # the last block's rows reach the last key (causal bottom-right too)
    for c, (_, kend) in enumerate(p.blocks):
        if kend <= 0:
            dqp[:, c].zero_()  # every row of the block is before the first key
            continue
        k8 = -(-kend // plan_mod.ROW_ALIGN) * plan_mod.ROW_ALIGN
        view = lambda buf: buf[: L * g * R * k8].view(L, g * R, k8)[:, :, :kend]  # noqa: E731
        pb, dsb, p32 = view(p_buf), view(ds_buf), view(p32_buf)
        gemms.probs(qp[:, c], kp[:, :kend].mT, pb, p32, rowbias[:, c], rowpos[:, c], colpos[:, :kend],
                    scale_log2, causal)
        gemms.grad_scores(dop[:, c], vp[:, :kend].mT, dsb, p32, delta[:, c], softmax_scale)
        if c < C - 1:
            gemms.add_into(pb.mT, dop[:, c], dv_acc[:, :kend])
            gemms.add_into(dsb.mT, qp[:, c], dk_acc[:, :kend])
        else:  # the last block sees every key (kend == Nk): it writes dk/dv in their final layout
            for b in range(B):
                ls = slice(b * Hkv, (b + 1) * Hkv)
                if C > 1:
                    gemms.add_to(pb[ls].mT, dop[ls, c], dv_acc[ls], dv[b].transpose(0, 1))
                    gemms.add_to(dsb[ls].mT, qp[ls, c], dk_acc[ls], dk[b].transpose(0, 1))
                else:
                    gemms.mm(pb[ls].mT, dop[ls, c], dv[b].transpose(0, 1))
                    gemms.mm(dsb[ls].mT, qp[ls, c], dk[b].transpose(0, 1))
        gemms.mm(dsb, kp[:, :kend], dqp[:, c])
    dq = torch.empty(B, Nq, Hq, D, device=dev, dtype=dt)
    _blocks_to_rows(dqp, dq, R)
    return dq, dk, dv
