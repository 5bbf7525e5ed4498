"""Host time of one split-KV decode call (issue #43, GPU machine): per-call loop time against stream time, and
where the host time goes (cProfile by function, torch.profiler by CPU op) for the eager rows whose ``ms`` sits
far above ``ms_graph`` in ``benchmarks/results/decode_attention_h200.json``.

    python benchmarks/tools/split_host_probe.py [--shapes d512:1:4:8192,d128:1:1:8192]   # name:B:Nq:Nk
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"d512": (512, 32, 4), "d256": (256, 32, 16), "d128": (128, 32, 8)}


def main() -> None:
    import torch
    from host_cost import gpu_us, us_per_call

    import xattn.torch as xt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="d512:1:1:8192,d512:1:4:8192,d128:1:1:8192")
    args = ap.parse_args()
    for item in args.shapes.split(","):
        name, b, nq, nk = item.split(":")
        d, hq, hkv = SHAPES[name]
        b, nq, nk = int(b), int(nq), int(nk)
        g = torch.Generator(device="cuda").manual_seed(nk + nq)
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        with torch.no_grad():
            for splits in (0, 1):
                fn = lambda: xt.attention(q, k, v, causal=True, num_splits=splits)  # noqa: E731
                host = us_per_call(fn, torch.cuda.synchronize, n=100, loops=10)
                print(f"{item} num_splits={splits}: host {host:.1f} us/call, stream {gpu_us(fn, 100):.1f} us/call",
                      flush=True)
            fn = lambda: xt.attention(q, k, v, causal=True)  # noqa: E731
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"--- {item} cProfile, 300 calls (tottime) ---\n" + "\n".join(s.getvalue().splitlines()[6:30]))
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as p:
                for _ in range(50):
                    fn()
                torch.cuda.synchronize()
            print(f"--- {item} torch.profiler, 50 calls ---")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


if __name__ == "__main__":
    main()
