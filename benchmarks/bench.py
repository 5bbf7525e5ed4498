"""xattn benchmarks (GPU machine): one command, rows in one JSON file + a markdown table.

    python benchmarks/bench.py [--suite core] [--out benchmarks/results/core.json] [--quick]

Suite ``core``: the core called on torch tensors vs the native upstream calls on the same
inputs, same run — ``ffpa_attn.ffpa_attn_func(..., backend="cutedsl")`` (d512) and
``flash_attn.cute.flash_attn_func`` (d128) at B2 H16 N8192 bf16, causal and not, fwd and
fwd+bwd; plus host time per call at B1 H8 N128.

Timing: ``triton.testing.do_bench`` medians after warm-up, fresh ``randn`` inputs. FLOPs
follow FlashAttention: fwd 4*B*Hq*Nq*Nk*D (causal: half), fwd+bwd 3.5x fwd.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import xattn.core as xc  # noqa: E402
from xattn.core.spec import library_versions  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def flops(b, hq, nq, nk, d, causal, pass_):
    f = 4 * b * hq * nq * nk * d * (0.5 if causal else 1.0)
    return f * (3.5 if pass_ == "fwd+bwd" else 1.0)


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def bench_and_host_ms(fn) -> tuple[float, float]:
    """``(bench_ms(fn), host ms of one more call)``: the GPU-time median, and the wall time one call takes to
    enqueue its work (the stream idle before and after it)."""
    ms = bench_ms(fn)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    return ms, host


def cuda_profile(fn, reps: int):
    """``fn`` once (warm-up), then ``reps`` calls under ``torch.profiler`` (CUDA activity); the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return prof


def host_us_per_call(fn, n=300) -> float:
    """Wall time per call of an enqueue loop (kernel time of a tiny problem included)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


class CoreTorch:
    """The core on torch tensors, allocating outputs/workspace as a front end would."""

    def __init__(self, family, q, k, v, causal, scale):
        self.family, self.q, self.k, self.v, self.causal, self.scale = family, q, k, v, causal, scale
        self.fwd_fn = xc.ffpa_fwd if family == "ffpa" else xc.fa4_fwd
        self.bwd_fn = xc.ffpa_bwd if family == "ffpa" else xc.fa4_bwd
        dt = "bfloat16" if q.dtype == torch.bfloat16 else "float16"
        g = q.shape[2] // k.shape[2]
        self.fwd_fill = xc.KernelSpec(family, "fwd", dt, q.shape[-1], v.shape[-1], g, causal).output_fill()
        self.bwd_fill = xc.KernelSpec(family, "bwd", dt, q.shape[-1], v.shape[-1], g, causal).output_fill()
        self.layout = xc.bwd_workspace(family, q.shape, k.shape, head_dim_v=v.shape[-1], causal=causal)

    def _new(self, like_shape, dtype, name, fills):
        if name in fills:
            return torch.full(like_shape, fills[name], dtype=dtype, device="cuda")
        return torch.empty(like_shape, dtype=dtype, device="cuda")

    def fwd(self):
        q = self.q
        out = self._new((*q.shape[:-1], self.v.shape[-1]), q.dtype, "out", self.fwd_fill)
        lse = self._new((q.shape[0], q.shape[2], q.shape[1]), torch.float32, "lse", self.fwd_fill)
        self.fwd_fn(q, self.k, self.v, out, lse, softmax_scale=self.scale, causal=self.causal)
        return out, lse

    def fwd_bwd(self, dout):
        out, lse = self.fwd()
        grads = [self._new(t.shape, t.dtype, n, self.bwd_fill) for t, n in
                 ((self.q, "dq"), (self.k, "dk"), (self.v, "dv"))]
        ws = [torch.empty(s, dtype=torch.float32, device="cuda") if f is None else
              torch.full(s, f, dtype=torch.float32, device="cuda") for _, s, _, f in self.layout]
        self.bwd_fn(dout, self.q, self.k, self.v, out, lse, *grads, softmax_scale=self.scale,
                    causal=self.causal, workspace=ws)
        return grads


def native(family, q, k, v, causal, scale):
    """Upstream call on the same [B, N, H, D] tensors (FFPA takes the SDPA view, no copy)."""
    if family == "ffpa":
        from ffpa_attn import ffpa_attn_func

        def run(q, k, v):
            o = ffpa_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                               scale=scale, enable_gqa=q.shape[2] != k.shape[2], backend="cutedsl")
            return o.transpose(1, 2)
        return run
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        o = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
        return o[0] if isinstance(o, tuple) else o
    return run


def throughput_rows(device, quick, repeat=3):
    rows = []
    b, h, n = (1, 8, 2048) if quick else (2, 16, 8192)
    for family, d, native_name in (("ffpa", 512, "ffpa_attn.ffpa_attn_func(cutedsl)"),
                                   ("fa4", 128, "flash_attn.cute.flash_attn_func")):
        for causal in (False, True):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            dout = torch.randn_like(q)
            scale = 1 / math.sqrt(d)
            core = CoreTorch(family, q, k, v, causal, scale)
            nat = native(family, q, k, v, causal, scale)
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def nat_fwd_bwd():
                o = nat(qg, kg, vg)
                torch.autograd.grad(o, (qg, kg, vg), dout)
            cases = [("xattn.core(torch)", "fwd", core.fwd),
                     ("xattn.core(torch)", "fwd+bwd", lambda: core.fwd_bwd(dout)),
                     (native_name, "fwd", lambda: nat(q, k, v)), (native_name, "fwd+bwd", nat_fwd_bwd)]
            for _, _, fn in cases:
                fn()  # compile / warm
            # core and native interleaved, `repeat` rounds: clock drift hits both alike, and the
            # spread across rounds says how much of a core-vs-native gap is noise
            times = {i: [] for i in range(len(cases))}
            for _ in range(repeat):
                for i, (_, _, fn) in enumerate(cases):
                    times[i].append(bench_ms(fn))
            for i, (method, pass_, _) in enumerate(cases):
                ms = statistics.median(times[i])
                tf = flops(b, h, n, n, d, causal, pass_) / ms / 1e9
                rows.append(dict(method=method, head_dim=d, causal=causal, batch=b, heads_q=h, heads_kv=h,
                                 seqlen=n, dtype="bfloat16", varlen=False, **{"pass": pass_}, ms=round(ms, 4),
                                 tflops=round(tf, 1), ms_rounds=[round(t, 4) for t in times[i]], device=device))
                log(f"{method:36s} d{d} causal={causal!s:5} {pass_:7s} {ms:8.3f} ms {tf:6.1f} TFLOP/s "
                    f"(rounds {min(times[i]):.3f}-{max(times[i]):.3f} ms)")
    return rows


def host_rows(device):
    rows = []
    b, h, n = 1, 8, 128
    for family, d, native_name in (("ffpa", 512, "ffpa_attn.ffpa_attn_func(cutedsl)"),
                                   ("fa4", 128, "flash_attn.cute.flash_attn_func")):
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        scale = 1 / math.sqrt(d)
        out = torch.empty_like(q)
        lse = torch.empty(b, h, n, device="cuda")
        fwd_fn = xc.ffpa_fwd if family == "ffpa" else xc.fa4_fwd
        nat = native(family, q, k, v, False, scale)
        launcher = xc.get_launcher(xc.KernelSpec(family, "fwd", "bfloat16", d, d))
        cases = [("xattn.core(torch)", lambda: fwd_fn(q, k, v, out, lse, softmax_scale=scale)),
                 ("compiled launcher, no checks", lambda: launcher.function(q, k, v, out, lse, scale)),
                 (native_name, lambda: nat(q, k, v))]
        for method, fn in cases:
            us = host_us_per_call(fn)
            rows.append(dict(method=method, head_dim=d, causal=False, batch=b, heads_q=h, heads_kv=h, seqlen=n,
                             dtype="bfloat16", varlen=False, **{"pass": "fwd"}, ms=round(us / 1e3, 5),
                             tflops=None, us_per_call=round(us, 1), device=device))
            log(f"host  {method:36s} d{d} {us:8.1f} us/call")
    return rows


def markdown(rows) -> str:
    lines = ["| method | d | causal | pass | B | H | N | ms | TFLOP/s | us/call |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['head_dim']} | {r['causal']} | {r['pass']} | {r['batch']} | "
                     f"{r['heads_q']} | "
                     f"{r['seqlen']} | {r['ms']} | {r['tflops'] if r['tflops'] is not None else ''} | "
                     f"{r.get('us_per_call', '')} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="core", choices=["core"])
    ap.add_argument("--out", default="benchmarks/results/core.json")
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved core/native rounds per shape (median reported)")
    args = ap.parse_args(argv)
    device = torch.cuda.get_device_name()
    log(f"device {device}; suite {args.suite}")
    rows = throughput_rows(device, args.quick, args.repeat) + host_rows(device)
    versions = ", ".join(f"{k} {v}" for k, v in library_versions()) + f", torch {torch.__version__}"
    for r in rows:
        r.update(versions=versions, date=time.strftime("%Y-%m-%d"), python=platform.python_version())
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)
    md = markdown(rows)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(f"Device: {device}; {versions}\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()
