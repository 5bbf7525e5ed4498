"""Where the chunked-GEMM backward's time goes (H200): CUDA time per kernel for one backward,
and what quack's autotuner would gain over the default GEMM config.

    python benchmarks/tools/gemm_bwd_profile.py
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_ms, flops  # noqa: E402


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
        run()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
        print(f"=== Hq{hq}/Hkv{hkv} causal={causal} N{n}: CUDA time of 3 backwards ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
        f = 2.5 * flops(1, hq, n, n, d, causal, "fwd")
        t_default = bench_ms(run)
        gemms = gemm_bwd._quack()
        for name in ("probs_causal", "probs_full", "grad_scores"):
            fn = getattr(gemms._epi, name)
            setattr(gemms._epi, name, lambda *a, _fn=fn, **kw: _fn(*a, **dict(kw, tuned=True)))
        gi = gemms._gi  # noqa: F841
        orig = (gi.gemm_add_inplace, gi.gemm_out)

        class Tuned:
            gemm_add_inplace = staticmethod(lambda *a, **kw: orig[0](*a, **dict(kw, tuned=True)))
            gemm_out = staticmethod(lambda *a, **kw: orig[1](*a, **dict(kw, tuned=True)))
        gemms._gi = Tuned
        run()
        t_tuned = bench_ms(run)
        print(f"default config {t_default:.3f} ms ({f / t_default / 1e9:.0f} TFLOP/s), "
              f"autotuned {t_tuned:.3f} ms ({f / t_tuned / 1e9:.0f} TFLOP/s)", flush=True)
        gemm_bwd._QUACK = None  # the next shape starts from the default config again
        importlib.reload(gemms._epi)


if __name__ == "__main__":
    main()
