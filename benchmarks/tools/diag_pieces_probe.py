"""The causal diagonal of the chunked-GEMM backward (issue #23 item 3): backward time per block plan.

Each causal block is cut into ``pieces`` along its diagonal (``xattn.core.gemm_bwd_plan.plan``); dK/dV
follow the pieces' key ranges (``split_acc``) or take zeroed P/dS whole; ``tiles`` picks the tile of
GEMM kinds (the N = D ones: dK/dV, dq; the P / dS ones). Prints backward ms and TFLOP/s (2.5x the causal forward FLOPs)
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

# (rows, pieces, split_acc, tiles: {GEMM kind: (M, N)}, None: the defaults, KIND_TILES); the first is the
# default plan (the reference of "max diff"). The N = D GEMMs (acc / mm_dq / mm_kv): D = 512 on 192-wide tiles
# computes 576 columns (128x128 won, session 4). The P / dS GEMMs (probs_causal, grad_scores: N = keys) are
# the next candidates for the causal Hq16/Hkv16 8k row (issue #23): their tile and schedule.
D_KINDS, SCORE_KINDS = ("acc", "mm_dq", "mm_kv"), ("probs_causal", "grad_scores")
TILE_VARIANTS = ((128, 192), (64, 256), (128, 256))
SCORE_TILE_VARIANTS = ((128, 128), (128, 256), (256, 128))
VARIANTS = ((1024, 1, True, None), (1024, 2, True, None), (1024, 4, False, None), (2048, 4, True, None),
            *((1024, 1, True, {kind: t for kind in D_KINDS}) for t in TILE_VARIANTS),
            *((1024, 1, True, {kind: t for kind in SCORE_KINDS}) for t in SCORE_TILE_VARIANTS))


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
            for rows, pieces, split, tiles in VARIANTS:
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
                print(f"Hq{hq}/Hkv{hkv} N{n} rows {rows} pieces {pieces} split_acc {split} tiles {tiles or 'default'}: "
                      f"backward {t:.3f} ms ({f / t / 1e9:.1f} TFLOP/s), max diff vs the first {err:.2e}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
