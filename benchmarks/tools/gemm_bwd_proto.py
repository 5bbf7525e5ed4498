"""Prototype of the chunked-GEMM d512 attention backward (issue #14), in torch + quack.

Measures whether the route can beat FFPA's backward before it is built into the core.

Per block of ``Mc`` query rows (all ``g`` query heads of a KV head stacked into one GEMM M of
``g * Mc`` rows, batched over ``L = B * Hkv``), with keys ``[0, kend)`` (``kend`` stops at the
causal limit of the block, so fully masked key blocks are never computed):

1. ``P  = exp2(Q Kᵀ · scale·log2e − lse·log2e)`` (masked entries 0), bf16     GEMM + fused epilogue
2. ``dS = P ⊙ (dO Vᵀ − δ) · scale``, bf16                                      GEMM + fused epilogue
3. ``dV += Pᵀ dO``, ``dK += dSᵀ Q`` (fp32 accumulators)                         GEMM, C = accumulator
4. ``dQ  = dS K`` (written once per block)                                      GEMM

``δ = rowsum(dO ⊙ O)``. Layout glue (row permutation, padding, fp32 -> bf16) is torch here.
``Gemms`` runs the four kinds of GEMM: ``TorchGemms`` (fp32 matmuls, any device: checks the
block logic on the CPU) and ``QuackGemms`` (quack's sm90 GEMMs with fused epilogues).

Usage on the GPU: ``python benchmarks/tools/gemm_bwd_proto.py [--out results.json]``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

LOG2E = 1.4426950408889634
MASK_PENALTY = 2.0 ** 100  # subtracted (times >= 1) from a masked score's exponent


class TorchGemms:
    """The four GEMM kinds as fp32 torch matmuls (rounded to the output dtype): a reference."""

    def scores_to_p(self, a, b, out, rowbias, rowpos, colpos, scale_log2, causal):
        x = torch.matmul(a.float(), b.float()) * scale_log2 + rowbias[..., :, None]
        if causal:
            x = x - MASK_PENALTY * torch.relu(colpos[..., None, :] - rowpos[..., :, None])
        out.copy_(torch.exp2(x))

    def dp_to_ds(self, a, b, out, p, delta, scale):
        out.copy_((torch.matmul(a.float(), b.float()) - delta[..., :, None]) * p.float() * scale)

    def add_into(self, a, b, acc):
        acc.add_(torch.matmul(a.float(), b.float()))

    def mm(self, a, b, out):
        out.copy_(torch.matmul(a.float(), b.float()))


class QuackGemms:
    """The four GEMM kinds on quack's sm90 GEMMs; the two elementwise steps fused into epilogues."""

    def __init__(self, config=None, config_long=None, p32=False):
        from quack.epilogue.frontend import gemm_epilogue
        from quack.epilogue.ops import ColVecLoad, RowVecLoad, TileLoad, Scalar
        from quack.epilogue.math import pexp2
        from quack.activation import relu
        from quack import gemm_interface

        self.gi = gemm_interface
        self.config = config
        self.config_long = config_long
        penalty = MASK_PENALTY

        @gemm_epilogue(ops={"rowbias": ColVecLoad("rowbias"), "rowpos": ColVecLoad("rowpos"),
                            "colpos": RowVecLoad("colpos"), "scale_log2": Scalar("scale_log2")})
        def p_causal(acc, rowbias, rowpos, colpos, scale_log2):
            return {"D": pexp2(acc * scale_log2 + rowbias - relu(colpos - rowpos) * penalty)}

        @gemm_epilogue(ops={"rowbias": ColVecLoad("rowbias"), "scale_log2": Scalar("scale_log2")})
        def p_full(acc, rowbias, scale_log2):
            return {"D": pexp2(acc * scale_log2 + rowbias)}

        @gemm_epilogue(ops={"p": TileLoad("p"), "delta": ColVecLoad("delta"), "scale": Scalar("scale")})
        def ds(acc, p, delta, scale):
            return {"D": (acc - delta) * p * scale}

        @gemm_epilogue(outputs=("p32",), ops={"rowbias": ColVecLoad("rowbias"), "rowpos": ColVecLoad("rowpos"),
                                              "colpos": RowVecLoad("colpos"), "scale_log2": Scalar("scale_log2")})
        def p_causal32(acc, rowbias, rowpos, colpos, scale_log2):
            e = pexp2(acc * scale_log2 + rowbias - relu(colpos - rowpos) * penalty)
            return {"D": e, "p32": e}

        @gemm_epilogue(outputs=("p32",), ops={"rowbias": ColVecLoad("rowbias"), "scale_log2": Scalar("scale_log2")})
        def p_full32(acc, rowbias, scale_log2):
            e = pexp2(acc * scale_log2 + rowbias)
            return {"D": e, "p32": e}

        self.p_causal, self.p_full, self.ds = p_causal, p_full, ds
        self.p32 = p32
        if p32:
            self.p_causal, self.p_full = p_causal32, p_full32
        self.p32_buf = None

    def _kw(self, long_k=False):
        cfg = self.config_long if long_k else self.config
        return {"config": cfg, "tuned": False} if cfg is not None else {"tuned": False}

    def scores_to_p(self, a, b, out, rowbias, rowpos, colpos, scale_log2, causal):
        outs = {"D": out}
        if self.p32:
            n = out.numel() * 2 + 64
            if self.p32_buf is None or self.p32_buf.numel() < n:
                self.p32_buf = torch.empty(n, device=out.device, dtype=torch.float32)
            outs["p32"] = self.p32_buf[: out.shape[0] * out.shape[1] * out.stride(1)].view(
                out.shape[0], out.shape[1], out.stride(1))[:, :, : out.shape[2]]
        if causal:
            self.p_causal(a, b, out=outs, rowbias=rowbias, rowpos=rowpos, colpos=colpos,
                          scale_log2=scale_log2, **self._kw())
        else:
            self.p_full(a, b, out=outs, rowbias=rowbias, scale_log2=scale_log2, **self._kw())
        self.last_p32 = outs.get("p32")

    def dp_to_ds(self, a, b, out, p, delta, scale):
        p = self.last_p32 if self.p32 else p
        self.ds(a, b, out={"D": out}, p=p, delta=delta, scale=scale, **self._kw())

    def add_into(self, a, b, acc):
        self.gi.gemm_add_inplace(a, b, acc, tuned=False)

    def mm(self, a, b, out):
        self.gi.gemm_out(a, b, out, tuned=False)


def block_rows(b, hq, nk, budget_bytes):
    """Query rows per block so that P and dS (bf16, ``B * Hq * rows * Nk`` each) fit the budget."""
    rows = budget_bytes // (4 * b * hq * max(nk, 1))
    return max(64, min(1 << 20, rows // 64 * 64))


def gemm_bwd(dout, q, k, v, out, lse, *, softmax_scale, causal, gemms, budget_bytes=1 << 30, rows=None):
    """dq, dk, dv of attention from the given out/lse. Dense layouts: q/out/dout ``[B, Nq, Hq, D]``,
    k/v ``[B, Nk, Hkv, D]``, lse fp32 ``[B, Hq, Nq]`` (natural log). Causal is bottom-right aligned."""
    B, Nq, Hq, D = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    g, L = Hq // Hkv, B * Hkv
    dev, dt = q.device, q.dtype
    Mc = rows or min(block_rows(B, Hq, Nk, budget_bytes), -(-Nq // 64) * 64)
    C = -(-Nq // Mc)
    Np = C * Mc
    shift = Nk - Nq

    def rows_first(x):  # [B, Nq, Hq, D] -> [L, C, g*Mc, D], zero padded rows
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, Np - Nq))
        x = x.view(B, C, Mc, Hkv, g, D).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(L, C, g * Mc, D)

    def vec_rows(x, fill):  # [B, Hq, Nq] -> [L, C, g*Mc]
        x = torch.nn.functional.pad(x, (0, Np - Nq), value=fill)
        return x.view(B, Hkv, g, C, Mc).permute(0, 1, 3, 2, 4).reshape(L, C, g * Mc).contiguous()

    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # [B, Hq, Nq]
    qp, dop = rows_first(q), rows_first(dout)
    kp = k.permute(0, 2, 1, 3).reshape(L, Nk, D)
    vp = v.permute(0, 2, 1, 3).reshape(L, Nk, D)
    rowbias = vec_rows(torch.where(torch.isfinite(lse), -lse * LOG2E, -math.inf), -math.inf)
    deltap = vec_rows(delta, 0.0)
    pos = (torch.arange(Np, device=dev, dtype=torch.float32) + shift)
    rowpos = pos.view(C, 1, Mc).expand(C, g, Mc).reshape(1, C, g * Mc).expand(L, C, g * Mc).contiguous()
    nk8 = -(-Nk // 8) * 8  # row strides of P, dS and colpos: 16-byte aligned for TMA
    colpos = torch.arange(nk8, device=dev, dtype=torch.float32).expand(L, nk8).contiguous()
    dk_acc = torch.zeros(L, Nk, D, device=dev, dtype=torch.float32)
    dv_acc = torch.zeros_like(dk_acc)
    dqp = torch.zeros(L, C, g * Mc, D, device=dev, dtype=dt)
    p_buf = torch.empty(L * g * Mc * nk8, device=dev, dtype=dt)
    ds_buf = torch.empty_like(p_buf)
    scale_log2 = softmax_scale * LOG2E
    for c in range(C):
        kend = min(Nk, (c + 1) * Mc + shift) if causal else Nk
        if kend <= 0:
            continue
        k8 = -(-kend // 8) * 8
        p = p_buf[: L * g * Mc * k8].view(L, g * Mc, k8)[:, :, :kend]
        ds = ds_buf[: L * g * Mc * k8].view(L, g * Mc, k8)[:, :, :kend]
        gemms.scores_to_p(qp[:, c], kp[:, :kend].mT, p, rowbias[:, c], rowpos[:, c], colpos[:, :kend],
                          scale_log2, causal)
        gemms.dp_to_ds(dop[:, c], vp[:, :kend].mT, ds, p, deltap[:, c], softmax_scale)
        gemms.add_into(p.mT, dop[:, c], dv_acc[:, :kend])
        gemms.add_into(ds.mT, qp[:, c], dk_acc[:, :kend])
        gemms.mm(ds, kp[:, :kend], dqp[:, c])
    dq = dqp.view(B, Hkv, C, g, Mc, D).permute(0, 2, 4, 1, 3, 5).reshape(B, Np, Hq, D)[:, :Nq]
    dk = dk_acc.view(B, Hkv, Nk, D).transpose(1, 2).to(dt)
    dv = dv_acc.view(B, Hkv, Nk, D).transpose(1, 2).to(dt)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


def reference(q, k, v, dout, scale, causal):
    """fp64 attention forward + backward: (out, lse, dq, dk, dv)."""
    q64, k64, v64 = (x.double().detach().requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kk, vv = k64.repeat_interleave(g, 2), v64.repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q64, kk) * scale
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1).nan_to_num(), vv)
    o.backward(dout.double())
    return o.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def max_err(x, ref):
    return (x.double() - ref).abs().max().item()


def check_cpu():
    """Block logic vs fp64 on the CPU with the reference GEMMs (several blocks, padding, GQA, Nq != Nk)."""
    torch.manual_seed(0)
    for (b, nq, nk, hq, hkv, d, causal, rows) in [(2, 200, 200, 4, 2, 32, True, 64),
                                                  (1, 130, 190, 6, 2, 16, True, 64),
                                                  (1, 190, 130, 3, 3, 16, True, 64),
                                                  (2, 150, 170, 4, 1, 32, False, 64)]:
        q = torch.randn(b, nq, hq, d)
        k, v = torch.randn(b, nk, hkv, d), torch.randn(b, nk, hkv, d)
        dout = torch.randn(b, nq, hq, d)
        scale = d ** -0.5
        o, lse, dq, dk, dv = reference(q, k, v, dout, scale, causal)
        got = gemm_bwd(dout, q, k, v, o.float(), lse.float(), softmax_scale=scale, causal=causal,
                       gemms=TorchGemms(), rows=rows)
        errs = [max_err(x, r) for x, r in zip(got, (dq, dk, dv))]
        print(f"cpu b{b} nq{nq} nk{nk} h{hq}/{hkv} causal={causal}: errs {errs}")
        assert max(errs) < 1e-3, errs


def flops(b, hq, nq, nk, d, causal):
    f = 4 * b * hq * nq * nk * d
    return f / 2 if causal else f


def bench_gpu(out_path):
    import triton.testing as tt
    import xattn.torch.ops as ops

    results = []
    torch.manual_seed(0)
    variants = {"p16": QuackGemms(), "p32": QuackGemms(p32=True)}
    # correctness: small, several blocks, GQA, Nq != Nk, N not a multiple of the tile
    ratios = {name: [] for name in variants}
    for seed in range(4):
        for (b, nq, nk, hq, hkv, causal, dt) in [(1, 1000, 1000, 8, 2, True, torch.bfloat16),
                                                 (2, 777, 1200, 4, 4, False, torch.bfloat16),
                                                 (1, 1200, 777, 8, 1, True, torch.float16)]:
            torch.manual_seed(seed)
            d = 512
            q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
            k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
            v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
            dout = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
            scale = d ** -0.5
            o64, lse64, dq64, dk64, dv64 = reference(q, k, v, dout, scale, causal)
            o, lse = ops.fwd(q, k, v, "ffpa", scale, causal, -1, -1, None, None, 0, 0)
            ffpa = ops.bwd(dout, q, k, v, o, lse, "ffpa", scale, causal, -1, -1, None, None, 0, 0)
            row = {"kind": "accuracy", "seed": seed, "b": b, "nq": nq, "nk": nk, "hq": hq, "hkv": hkv,
                   "causal": causal, "dtype": str(dt)}
            for name, x, r in zip(("dq", "dk", "dv"), ffpa, (dq64, dk64, dv64)):
                row[f"{name}_err_ffpa"] = max_err(x, r)
            for vname, gemms in variants.items():
                mine = gemm_bwd(dout, q, k, v, o, lse, softmax_scale=scale, causal=causal, gemms=gemms, rows=256)
                for name, x, r in zip(("dq", "dk", "dv"), mine, (dq64, dk64, dv64)):
                    row[f"{name}_err_{vname}"] = max_err(x, r)
                    ratios[vname].append(row[f"{name}_err_{vname}"] / row[f"{name}_err_ffpa"])
            print(row, flush=True)
            results.append(row)
    for vname, r in ratios.items():
        print(f"{vname}: err/ffpa_err max {max(r):.3f} mean {sum(r) / len(r):.3f}", flush=True)
        results.append({"kind": "accuracy_summary", "variant": vname, "max_ratio": max(r),
                        "mean_ratio": sum(r) / len(r)})
    gemms = variants["p16"]
    for (hq, hkv, causal) in [(32, 4, True), (16, 16, True)]:
        for n in (1024, 2048, 4096):
            b, d = 1, 512
            q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
            scale = d ** -0.5
            o, lse = ops.fwd(q, k, v, "ffpa", scale, causal, -1, -1, None, None, 0, 0)
            t_ffpa = tt.do_bench(lambda: ops.bwd(dout, q, k, v, o, lse, "ffpa", scale, causal, -1, -1,
                                                 None, None, 0, 0), return_mode="median")
            f = flops(b, hq, n, n, d, causal)
            for vname, gm in variants.items():
                t = tt.do_bench(lambda: gemm_bwd(dout, q, k, v, o, lse, softmax_scale=scale, causal=causal,
                                                 gemms=gm), return_mode="median")
                row = {"kind": "speed_small", "variant": vname, "n": n, "hq": hq, "hkv": hkv, "causal": causal,
                       "ffpa_bwd_tflops": 2.5 * f / t_ffpa / 1e9, "gemm_bwd_tflops": 2.5 * f / t / 1e9}
                print(row, flush=True)
                results.append(row)
    for (hq, hkv, causal) in [(32, 4, True), (16, 16, False), (16, 16, True)]:
        for n in (8192,):
            b, d = 1, 512
            q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
            dout = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
            scale = d ** -0.5
            o, lse = ops.fwd(q, k, v, "ffpa", scale, causal, -1, -1, None, None, 0, 0)
            t_fwd = tt.do_bench(lambda: ops.fwd(q, k, v, "ffpa", scale, causal, -1, -1, None, None, 0, 0),
                                return_mode="median")
            t_ffpa = tt.do_bench(lambda: ops.bwd(dout, q, k, v, o, lse, "ffpa", scale, causal, -1, -1,
                                                 None, None, 0, 0), return_mode="median")
            for budget, gemms in ((1 << 30, variants["p16"]), (1 << 30, variants["p32"])):
                t = tt.do_bench(lambda: gemm_bwd(dout, q, k, v, o, lse, softmax_scale=scale, causal=causal,
                                                 gemms=gemms, budget_bytes=budget), return_mode="median")
                f = flops(b, hq, n, n, d, causal)
                row = {"kind": "speed", "variant": "p32" if gemms.p32 else "p16", "n": n, "hq": hq, "hkv": hkv, "causal": causal,
                       "budget_mib": budget >> 20, "rows": block_rows(b, hq, n, budget),
                       "fwd_ms": t_fwd, "ffpa_bwd_ms": t_ffpa, "gemm_bwd_ms": t,
                       "ffpa_bwd_tflops": 2.5 * f / t_ffpa / 1e9, "gemm_bwd_tflops": 2.5 * f / t / 1e9,
                       "fwd_bwd_tflops_ffpa": 3.5 * f / (t_fwd + t_ffpa) / 1e9,
                       "fwd_bwd_tflops_gemm": 3.5 * f / (t_fwd + t) / 1e9}
                print(row, flush=True)
                results.append(row)
            del q, k, v, dout, o, lse
            torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="check the block logic on the CPU only")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.cpu or not torch.cuda.is_available():
        check_cpu()
        sys.exit(0)
    bench_gpu(args.out)
