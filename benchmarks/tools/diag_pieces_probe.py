"""The causal diagonal of the chunked-GEMM backward (issue #23 item 3): backward time per block plan.

Each causal block is cut into ``pieces`` along its diagonal (``xattn.core.gemm_bwd.plan``); dK/dV
follow the pieces' key ranges (``split_acc``) or take zeroed P/dS whole. Prints backward ms and
TFLOP/s (2.5x the causal forward FLOPs) for each (rows, pieces, split_acc), d512 bf16, one GPU.

    python benchmarks/tools/diag_pieces_probe.py [--seqlens 8192,16384]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_ms, flops  # noqa: E402

VARIANTS = ((1024, 1, True), (1024, 2, True), (1024, 4, True), (1024, 4, False), (1024, 8, True),
            (2048, 4, True), (2048, 8, True), (1536, 6, True))


def main():
    import xattn.torch.ops as ops
    from xattn.torch import gemm_bwd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="8192,16384")
    ap.add_argument("--shapes", default="16/16,32/4")
    args = ap.parse_args()
    d = 512
    for shape in args.shapes.split(","):
        hq, hkv = map(int, shape.split("/"))
        for n in map(int, args.seqlens.split(",")):
            mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            q, k, v, dout = mk(1, n, hq, d), mk(1, n, hkv, d), mk(1, n, hkv, d), mk(1, n, hq, d)
            out, lse = ops.fwd(q, k, v, "ffpa", d ** -0.5, True, -1, -1, None, None, 0, 0)
            f = 2.5 * flops(1, hq, n, n, d, True, "fwd")
            ref = None
            for rows, pieces, split in VARIANTS:
                run = lambda: gemm_bwd.gemm_backward(dout, q, k, v, out, lse, softmax_scale=d ** -0.5,  # noqa: E731
                                                     causal=True, rows=rows, pieces=pieces, split_acc=split)
                got = run()
                if ref is None:
                    ref = got
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                t = bench_ms(run)
                print(f"Hq{hq}/Hkv{hkv} N{n} rows {rows} pieces {pieces} split_acc {split}: backward {t:.3f} ms "
                      f"({f / t / 1e9:.1f} TFLOP/s), max diff vs pieces 1 {err:.2e}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
