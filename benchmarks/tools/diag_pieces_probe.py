"""The causal diagonal of the chunked-GEMM backward (issue #23 item 3): backward time per block plan.

Each causal block is cut into ``pieces`` along its diagonal (``xattn.core.gemm_bwd.plan``); dK/dV
follow the pieces' key ranges (``split_acc``) or take zeroed P/dS whole; ``tile`` is the tile of
the GEMMs whose N is the head dim. Prints backward ms and TFLOP/s (2.5x the causal forward FLOPs)
for each (rows, pieces, split_acc, tile), d512 bf16, one GPU. (A variant with the dq GEMMs on a side
stream was measured once, ±4 % either way, and removed: results/logs/diag_overlap_probe_h200.log.)

    python benchmarks/tools/diag_pieces_probe.py [--seqlens 8192,16384]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_ms, flops  # noqa: E402

# (rows, pieces, split_acc, tile of the N = D GEMMs acc / mm_dq / mm_kv; None: the default,
# 128x128); the first is the default plan (the reference of "max diff"). D = 512 on 192-wide tiles
# computes 576 columns.
TILE_VARIANTS = ((128, 192), (64, 256), (128, 256))
VARIANTS = ((1024, 1, True, None), (1024, 2, True, None), (1024, 4, False, None), (2048, 4, True, None),
            *((1024, 1, True, t) for t in TILE_VARIANTS))


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
            for rows, pieces, split, tile in VARIANTS:
                tiles = {kind: tile for kind in ("acc", "mm_dq", "mm_kv")} if tile else None
                gemms = gemm_bwd.CoreGemms(q.dtype, torch.cuda.get_device_properties(0).multi_processor_count,
                                           tiles=tiles)
                run = lambda: gemm_bwd.gemm_backward(dout, q, k, v, out, lse, softmax_scale=d ** -0.5,  # noqa: E731
                                                     causal=True, rows=rows, pieces=pieces, split_acc=split,
                                                     gemms=gemms)
                got = run()
                if ref is None:
                    ref = got
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                t = bench_ms(run)
                print(f"Hq{hq}/Hkv{hkv} N{n} rows {rows} pieces {pieces} split_acc {split} tile {tile or 'default'}: "
                      f"backward {t:.3f} ms ({f / t / 1e9:.1f} TFLOP/s), max diff vs the first {err:.2e}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
