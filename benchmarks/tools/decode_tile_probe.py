"""Where FA4's split-KV decode loses to SDPA at d128 (#43): the split launch compiled with other tiles and the
combine launched with programmatic dependent launch (PDL), each timed in a CUDA graph beside torch SDPA.

A variant replaces the shipped launcher in xattn's in-process launcher table (``xattn.core.cache``) for the
probe's calls only; it is compiled here (FA4 ~10 s a tile on a CPU), never stored in the disk cache. Each
variant's out is checked against fp32 SDPA before it is timed.

    python benchmarks/tools/decode_tile_probe.py [--shapes B:NK,...] [--tiles 128x128,64x128,64x64]
        [--splits 0,8,16,32] [--pdl 0,1] [--compile-only]

Variants: tile ``MxN`` (or ``MxNsK``: K pipeline stages for K and V, default FlashAttention's 2) of the split
launch (FlashAttention's sm90 forward, one MMA warpgroup per 64 rows;
``128x128`` is flash_attn's own d128 choice; ``xattn.core.split_kv.SPLIT_TILES`` the shipped one) x combine PDL
off/on x num_splits (0: the route's rule). ``--compile-only`` compiles the variants on a CPU
(CUTE_DSL_ARCH=sm_90a) and exits.
Timing: ``do_bench`` median of a graph replay (L2 flushed between runs), as benchmarks/decode_attention.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

HQ, HKV, D = 32, 8, 128


def split_spec():
    """The key the route looks the split launch up by for Hq32/Hkv8 d128 bf16 (varlen, non-causal: the splits see
    no mask; the decode tile's :class:`~xattn.core.split_kv.SplitFwdSpec` where the core has one)."""
    from xattn.core.spec import KernelSpec
    from xattn.core.split_kv import split_launch_spec

    return split_launch_spec(KernelSpec("fa4", "fwd", "bfloat16", D, D, HQ // HKV, causal=False, varlen=True))


def compile_split(spec, tile_m: int, tile_n: int, stages: int = 2):
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from xattn.core import fa4_sm90
    from xattn.core.symbolic import CUTE_DTYPES, Dims, compile_launcher

    cfg = fa4_sm90._tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    g = spec.qhead_per_kvhead
    kernel = FlashAttentionForwardSm90(
        CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, g, is_causal=spec.causal, is_local=spec.is_local,
        pack_gqa=g > 1, tile_m=tile_m, tile_n=tile_n, num_stages=stages, num_threads=128 * (tile_m // 64 + 1),
        Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    dims = Dims(spec)
    return compile_launcher(fa4_sm90._VarlenFwd(kernel, spec), (*dims.qkv(), *dims.cu_seqlens(), *dims.out_lse()))


def compile_combine(spec, pdl: bool):
    from xattn.core.combine_sm90 import compile_combine as build

    return build(spec, pdl=pdl)


def _tile(text: str) -> tuple[int, int, int]:
    """``"64x64"`` -> (64, 64, 2); ``"64x64s3"`` -> (64, 64, 3): tile_m, tile_n, pipeline stages."""
    dims, _, stages = text.partition("s")
    tm, tn = (int(x) for x in dims.split("x"))
    return tm, tn, int(stages or 2)


def _install(spec, function):
    from xattn.core import cache

    cache._entries[spec] = cache.Launcher(spec, function, function, 0.0, "probe")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1:8192,1:32768,8:8192", help="B:NK,... (Hq32/Hkv8 d128, q_len 1)")
    ap.add_argument("--tiles", default="128x128,64x128,64x64")
    ap.add_argument("--splits", default="0,8,16,32", help="num_splits values for B1 (B>1: 0 and 4)")
    ap.add_argument("--pdl", default="0,1")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    tiles = [_tile(t) for t in args.tiles.split(",")]
    pdls = [bool(int(x)) for x in args.pdl.split(",")]
    from xattn.core.split_kv import CombineSpec

    spec, cspec = split_spec(), CombineSpec("fa4", "bfloat16", D)
    built = {}
    for tm, tn, st in tiles:
        t0 = time.perf_counter()
        try:
            built[("tile", tm, tn, st)] = compile_split(spec, tm, tn, st)
            print(f"compiled split {tm}x{tn}s{st} in {time.perf_counter() - t0:.1f} s", flush=True)
        except Exception as exc:  # a tile FlashAttention cannot build is reported, the rest go on
            print(f"split {tm}x{tn}s{st}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for pdl in pdls:
        t0 = time.perf_counter()
        built[("combine", pdl)] = compile_combine(cspec, pdl)
        print(f"compiled combine pdl={pdl} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.compile_only:
        return
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import xattn.torch as xt
    from xattn.core import cache

    def graph_ms(fn):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return do_bench(graph.replay, warmup=25, rep=200, return_mode="median")

    for shape in args.shapes.split(","):
        b, nk = (int(x) for x in shape.split(":"))
        g = torch.Generator(device="cuda").manual_seed(nk + b)
        q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, nk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, nk, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True).transpose(1, 2)
        sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True))
        print(f"B{b} {nk // 1024}k sdpa {sdpa * 1e3:.1f} us", flush=True)
        splits = [int(s) for s in args.splits.split(",")] if b == 1 else [0, 4]
        for key, fn in built.items():
            if key[0] != "tile":
                continue
            _install(spec, fn)
            for pdl in pdls:
                _install(cspec, built[("combine", pdl)])
                for s in splits:
                    call = lambda: xt.attention(q, k, v, causal=True, num_splits=s)  # noqa: E731
                    before = set(cache._entries)
                    err = (call().float() - ref).abs().max().item()
                    for other in set(cache._entries) - before:  # the route took a launcher the probe did not set
                        print(f"  note: the call also loaded {other.short_name()}", flush=True)
                    ms = graph_ms(call)
                    print(f"B{b} {nk // 1024}k tile {key[1]}x{key[2]}s{key[3]} pdl {int(pdl)} S={s or 'auto'}: "
                          f"{ms * 1e3:.1f} us ({ms / sdpa:.3f} of sdpa), out err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
