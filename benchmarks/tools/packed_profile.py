"""Where a packed d512 backward's time goes vs the same documents as a dense batch (H200): CUDA time
per kernel of the backward alone (the custom op ``xattn::bwd``), and its wall time per call.

    python benchmarks/tools/packed_profile.py [--docs 2048,mix16k]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_and_host_ms, cuda_profile  # noqa: E402
from benchmarks.packed import D, HKV, HQ, causal_flops, documents  # noqa: E402


def main(argv=None):
    import xattn.torch.ops as ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default="2048,mix16k")
    args = ap.parse_args(argv)
    for spec in args.docs.split(","):
        lens = documents(spec)
        t, mx = sum(lens), max(lens)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = mk(t, HQ, D), mk(t, HKV, D), mk(t, HKV, D), mk(t, HQ, D)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out, lse = ops.fwd(q, k, v, "ffpa", D ** -0.5, True, -1, -1, cu, cu, mx, mx)
        runs = {"varlen": lambda: ops.bwd(dout, q, k, v, out, lse, "ffpa", D ** -0.5, True, -1, -1, cu, cu, mx, mx)}
        if len(set(lens)) == 1:
            b, n = len(lens), lens[0]
            dense = [x.view(b, n, *x.shape[1:]) for x in (dout, q, k, v, out)]
            lse_d = lse.view(HQ, b, n).transpose(0, 1).contiguous()
            runs["dense"] = lambda: ops.bwd(*dense, lse_d, "ffpa", D ** -0.5, True, -1, -1, None, None, 0, 0)
        f = causal_flops(lens) / 3.5 * 2.5
        for name, run in runs.items():
            prof = cuda_profile(run, 3)
            print(f"=== {spec} {name} ({len(lens)} documents): CUDA time of 3 backwards ===")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))
            ms, host = bench_and_host_ms(run)
            print(f"{spec} {name}: backward {ms:.3f} ms ({f / ms / 1e9:.0f} TFLOP/s), host {host:.2f} ms per call",
                  flush=True)


if __name__ == "__main__":
    main()
