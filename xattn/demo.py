"""``python -m xattn demo``: what xattn does on this machine, for real.

* With an sm90 GPU: runs FFPA (d512, Gemma 4 global-layer heads) and FA4 (d128) forward +
  backward through ``xattn.core`` on torch tensors, checks them against an fp32 reference
  and prints the time and TFLOP/s of each.
* Without one: prints why, then compiles the sm_90a launchers of every kernel family on
  the CPU (what CI does) and reports the compile time of each.
"""

from __future__ import annotations

import math
import time

import xattn.core as xc
from xattn.core.info import collect, report

_COMPILE_SET = [
    ("ffpa", "fwd", 512, 512, 8, True, False),
    ("ffpa", "bwd", 512, 512, 8, True, False),
    ("ffpa", "fwd", 512, 512, 8, True, True),
    ("fa4", "fwd", 128, 128, 4, True, False),
    ("fa4", "bwd", 128, 128, 4, True, False),
    ("fa4", "fwd", 256, 256, 2, False, True),
]


def _compile_only() -> None:
    print("\nCompiling the sm_90a launchers on this machine (no GPU needed):", flush=True)
    for i, (fam, direction, d, dv, g, causal, varlen) in enumerate(_COMPILE_SET, 1):
        spec = xc.KernelSpec(fam, direction, "bfloat16", d, dv, g, causal, varlen)
        t0 = time.perf_counter()
        entry = xc.get_launcher(spec)
        how = "compiled" if entry.source == "compiled" else "loaded from the disk cache"
        print(f"  [{i}/{len(_COMPILE_SET)}] {spec.short_name():52s} {time.perf_counter() - t0:5.1f} s  {how}",
              flush=True)
    print("Done. On an H200 this command runs the kernels and reports their speed.")


def _reference(q, k, v, scale, causal):
    import torch

    g = q.shape[2] // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1)
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n), float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2)


def _gpu_demo() -> None:
    import torch
    from triton.testing import do_bench

    cases = [("ffpa", 512, 32, 4, "Gemma 4 global layer: Hq 32, Hkv 4, d512"),
             ("fa4", 128, 16, 16, "d128, Hq = Hkv = 16")]
    for family, d, hq, hkv, what in cases:
        b, n, causal = 1, 4096, True
        q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = 1 / math.sqrt(d)
        spec = xc.KernelSpec(family, "fwd", "bfloat16", d, d, hq // hkv, causal)
        fills = spec.output_fill()
        fwd = xc.ffpa_fwd if family == "ffpa" else xc.fa4_fwd

        def run():
            out = torch.full_like(q, fills["out"]) if "out" in fills else torch.empty_like(q)
            lse = torch.full((b, hq, n), fills.get("lse", 0.0), device="cuda")
            fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal)
            return out
        t0 = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        err = ((out.float() - _reference(q, k, v, scale, causal)).norm() / out.float().norm()).item()
        ms = do_bench(run, return_mode="median")
        tflops = 4 * b * hq * n * n * d * 0.5 / ms / 1e9
        print(f"{family} {what}, B{b} N{n} causal bf16: first call {first:.1f} s (compile), "
              f"{ms:.3f} ms, {tflops:.0f} TFLOP/s, rel. err vs fp32 {err:.1e}", flush=True)


def main() -> None:
    """Print ``info``, then run the kernels (GPU) or compile them for sm_90a (CPU)."""
    data = collect()
    print(report(data), flush=True)
    if all(st["can_run"] for st in data["families"].values()):
        print()
        _gpu_demo()
    else:
        _compile_only()
