"""The causal diagonal of the chunked-GEMM backward (issue #23 item 3): backward time per block plan.

Each causal block is cut into ``pieces`` along its diagonal (``xattn.core.gemm_bwd_plan.plan``); dK/dV
follow the pieces' key ranges (``split_acc``) or take zeroed P/dS whole; ``tiles`` picks the tile of
GEMM kinds (the N = D ones: dK/dV, dq; the P / dS ones); ``p_dtype`` the copy of P that dS is formed from
(fp16, the default, or fp32 as before). Prints backward ms and TFLOP/s (2.5x the causal forward FLOPs) and the
gradients' max error vs an fp32 reference for each variant, d512 bf16, one GPU. (A variant with the dq GEMMs on a side
stream was measured once, ±4 % either way, and removed: results/logs/diag_overlap_probe_h200.log.)

    python benchmarks/tools/diag_pieces_probe.py [--seqlens 8192,16384] [--variants default,p32]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_ms, flops  # noqa: E402

# name -> (rows, pieces, split_acc, tiles: {GEMM kind: (M, N)}, None: the defaults, KIND_TILES; p_dtype).
# The N = D GEMMs (acc / mm_dq / mm_kv): D = 512 on 192-wide tiles
# computes 576 columns (128x128 won, session 4). The P / dS GEMMs (probs_causal, grad_scores: N = keys) are
# the next candidates for the causal Hq16/Hkv16 8k row (issue #23): their tile and schedule.
D_KINDS, SCORE_KINDS = ("acc", "mm_dq", "mm_kv"), ("probs_causal", "grad_scores")
TILE_VARIANTS = ((128, 192), (64, 256), (128, 256))
SCORE_TILE_VARIANTS = ((128, 128), (128, 256), (256, 128))
VARIANTS = {"default": (1024, 1, True, None, "float16"), "p32": (1024, 1, True, None, "float32"),
            "pieces2": (1024, 2, True, None, "float16"), "pieces4_zeroed": (1024, 4, False, None, "float16"),
            "rows2048_pieces4": (2048, 4, True, None, "float16"),
            **{f"d_tiles_{m}x{n}": (1024, 1, True, {kind: (m, n) for kind in D_KINDS}, "float16")
               for m, n in TILE_VARIANTS},
            **{f"score_tiles_{m}x{n}": (1024, 1, True, {kind: (m, n) for kind in SCORE_KINDS}, "float16")
               for m, n in SCORE_TILE_VARIANTS}}


def main():
    import xattn.torch.ops as ops
    from xattn.torch import gemm_bwd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="8192,16384")
    ap.add_argument("--shapes", default="16/16,32/4")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=1, help="time the variants this many times, alternating")
    args = ap.parse_args()
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            ap.error(f"unknown variant {name!r}; expected some of {', '.join(VARIANTS)}")
    d = 512
    for shape in args.shapes.split(","):
        hq, hkv = map(int, shape.split("/"))
        for n in map(int, args.seqlens.split(",")):
            mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
            q, k, v, dout = mk(1, n, hq, d), mk(1, n, hkv, d), mk(1, n, hkv, d), mk(1, n, hq, d)
            out, lse = ops.fwd(q, k, v, "ffpa", d ** -0.5, True, -1, -1, None, None, 0, 0)
            f = 2.5 * flops(1, hq, n, n, d, True, "fwd")
            ref = _reference(q, k, v, dout, d ** -0.5)
            for repeat in range(args.repeats):
                for name in names:
                    rows, pieces, split, tiles, p_dtype = VARIANTS[name]
                    gemms = gemm_bwd.CoreGemms(q.dtype, torch.cuda.get_device_properties(0).multi_processor_count,
                                               tiles=tiles, p_dtype=p_dtype)
                    run = lambda: gemm_bwd.gemm_backward(dout, q, k, v, out, lse, softmax_scale=d ** -0.5,  # noqa: E731
                                                         causal=True, rows=rows, pieces=pieces, split_acc=split,
                                                         gemms=gemms)
                    err = "" if repeat else ", max err vs fp32 dq/dk/dv " + " / ".join(
                        f"{(a.float() - b).abs().max().item():.2e}" for a, b in zip(run(), ref))
                    t = bench_ms(run)
                    print(f"Hq{hq}/Hkv{hkv} N{n} {name} (rows {rows} pieces {pieces} split_acc {split} tiles "
                          f"{tiles or 'default'} p_dtype {p_dtype}): backward {t:.3f} ms ({f / t / 1e9:.1f} TFLOP/s)"
                          f"{err}", flush=True)
            del ref
            torch.cuda.empty_cache()


def _reference(q, k, v, dout, scale):
    """fp32 dq/dk/dv of causal attention (GQA by repeated K/V), by query chunks of the fp32 sdpa."""
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    o = torch.nn.functional.scaled_dot_product_attention(qf, kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1),
                                                         is_causal=True, scale=scale)
    o.backward(dout.float().transpose(1, 2))
    return tuple(x.grad.transpose(1, 2) for x in (qf, kf, vf))


if __name__ == "__main__":
    main()
