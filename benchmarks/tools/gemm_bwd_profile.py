"""Where the chunked-GEMM backward's time goes (H200): CUDA time per kernel for one backward.

Do not add quack's autotuner here (``tuned=True``): it compiles every config on the device and
cost a whole session's device budget once; tune on the CPU-compiled launchers instead.

    python benchmarks/tools/gemm_bwd_profile.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_ms, cuda_profile, flops  # noqa: E402


def main():
    import xattn.torch.ops as ops
    from xattn.torch import gemm_bwd

    os.environ["XATTN_BWD_ROUTE"] = "gemm"
    for hq, hkv, causal in ((32, 4, True), (16, 16, True)):
        n, d = 8192, 512
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = mk(1, n, hq, d), mk(1, n, hkv, d), mk(1, n, hkv, d), mk(1, n, hq, d)
        out, lse = ops.fwd(q, k, v, "ffpa", d ** -0.5, causal, -1, -1, None, None, 0, 0)
        run = lambda: gemm_bwd.gemm_backward(dout, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal)  # noqa: E731
        prof = cuda_profile(run, 3)
        print(f"=== Hq{hq}/Hkv{hkv} causal={causal} N{n}: CUDA time of 3 backwards ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        f = 2.5 * flops(1, hq, n, n, d, causal, "fwd")
        t = bench_ms(run)
        print(f"backward {t:.3f} ms ({f / t / 1e9:.0f} TFLOP/s)", flush=True)


if __name__ == "__main__":
    main()
