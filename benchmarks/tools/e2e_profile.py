"""Where the torch e2e Gemma 4 step's GPU time goes: CUDA time per kernel, ``ffpa`` vs ``none``.

The step of :func:`benchmarks.e2e_gemma4.build_torch_step` (HF Gemma 4 with the 31B layer dims),
profiled for two steps after a warm-up; prints the kernels with the most CUDA time and the
total, so the attention part of ``attn_share`` can be read kernel by kernel, and the Python call
sites of host-device synchronisations in one step.

    python benchmarks/tools/e2e_profile.py [--impls ffpa,none] [--seqlen 8192] [--rows 30]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def profile(impl: str, n: int, rows: int) -> None:
    from benchmarks.bench import cuda_profile
    from benchmarks.e2e_gemma4 import build_torch_step

    step = build_torch_step(impl, n)
    prof = cuda_profile(step, 2)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) / 2e3
    print(f"=== {impl} N{n}: {total:.1f} ms CUDA time per step (kernels, self time) ===")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        print(f"{e.self_device_time_total / 2e3:9.2f} ms {e.count // 2:5d}x  {e.key[:110]}")
    _report_syncs(step)
    sys.stdout.flush()


def _report_syncs(step) -> None:
    """Host-device synchronisations in one step (they stall the launch queue), by Python call site."""
    import collections
    import warnings

    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    print(f"synchronising calls in one step: {sum(sites.values())}")
    for site, count in sites.most_common(8):
        print(f"  {count:4d}x  {site}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="ffpa,none")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args(argv)
    for impl in args.impls.split(","):
        profile(impl, args.seqlen, args.rows)


if __name__ == "__main__":
    main()
