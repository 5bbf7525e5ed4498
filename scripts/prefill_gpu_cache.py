"""Compile, on this CPU machine, the launchers that the GPU tests and benchmarks use, and pack
the disk-cache entries into ``.gpu/kc/kernels.tar.xz`` (git-ignored) for the device call.

Device minutes are scarce; compiling ~130 launchers there costs most of a call. The GPU
machine loads these entries exactly as a cluster loads a cache filled on a login node
(``python -m xattn warmup --arch sm_90a``), which is itself a feature under test. Launchers
not listed here are simply compiled on the GPU.

    bash scripts/prefill_env.sh && .venv312/bin/python scripts/prefill_gpu_cache.py [--jobs 2] [--list] [--fuzz]

The key holds the Python minor version, so run it with the GPU machine's (3.12).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def specs(recorded=None, fuzz=False):
    """Every launcher spec the GPU tests and ``benchmarks/`` ask for (a superset is harmless), plus
    those a CPU test run recorded (``XATTN_RECORD_SPECS=path pytest ...``; JSON rows of KernelSpec fields),
    plus, with ``fuzz``, the launcher pool of ``pytest -m fuzz`` (``tests/fuzz/space.py``)."""
    import json

    from xattn.core.spec import KernelSpec, supports

    out = []
    if fuzz:
        from tests.fuzz.space import kvcache_launchers, launcher_pool, paged_launchers, split_launchers

        # the torch fuzz's split, paged and KV-cache routes
        out += launcher_pool() + split_launchers() + paged_launchers() + kvcache_launchers()
    for row in json.load(open(recorded)) if recorded else []:
        out.append(KernelSpec(**row))
        if row["family"] == "fa4":  # the GPU twins run both dtypes and both passes; FA4 compiles in seconds
            for dtype in ("bfloat16", "float16"):
                for direction in ("fwd", "bwd"):
                    out.append(KernelSpec(**{**row, "dtype": dtype, "direction": direction}))

    def add(family, d, dv, g, causal=False, varlen=False, window=(None, None), dtype="bfloat16",
            directions=("fwd", "bwd")):
        for direction in directions:
            out.append(KernelSpec(family, direction, dtype, d, dv, g, causal, varlen, *window))

    for g in (1, 2, 4, 8):
        for causal in (False, True):
            for varlen in (False, True):
                add("ffpa", 512, 512, g, causal, varlen)
    add("ffpa", 512, 512, 2, True, dtype="float16", directions=("fwd",))
    for causal in (False, True):  # benchmarks/full.py --part fp16 (Gemma 4 global layer, Hq 32 / Hkv 4)
        add("ffpa", 512, 512, 8, causal, dtype="float16")
    for causal in (False, True):  # tests/torch/test_gemm_bwd_varlen_gpu.py: fp16 packed documents, GQA 4
        add("ffpa", 512, 512, 4, causal, varlen=True, dtype="float16")
    from xattn.core.gemm_sm90 import D32_KINDS, GemmSpec
    from xattn.core.warmup import gemm_backward_launchers  # the chunked-GEMM d512 backward's launchers

    out += [g for dtype in ("bfloat16", "float16") for g in gemm_backward_launchers(dtype)]
    tile_variants = ((128, 192), (64, 256), (128, 256))  # benchmarks/tools/diag_pieces_probe.py's A/B (bf16)
    out += [GemmSpec(kind, "bfloat16", d32, tile) for tile in tile_variants for kind in ("acc", "mm_dq", "mm_kv")
            for d32 in ((False, True) if kind in D32_KINDS else (False,))]
    out += [GemmSpec(kind, "bfloat16", False, tile) for tile in ((128, 128), (128, 256), (256, 128))
            for kind in ("probs_causal", "grad_scores")]  # the same probe's P / dS tile A/B
    out += [GemmSpec(kind, "bfloat16", False, None, "float32") for kind in ("probs_causal", "grad_scores")]  # p32
    for d, dtype in ((320, "bfloat16"), (384, "float16"), (448, "bfloat16")):
        for causal in (False, True):
            add("ffpa", d, d, 2, causal, dtype=dtype)
    for causal in (False, True):
        for varlen in (False, True):
            add("ffpa", 384, 384, 1, causal, varlen)
    for (d, dv), gs in (((64, 64), (1, 4)), ((96, 96), (1, 2)), ((128, 128), (1, 2, 4)), ((192, 128), (1,)),
                        ((256, 256), (1, 2))):
        for g in gs:
            add("fa4", d, dv, g, False)
            add("fa4", d, dv, g, True)
            add("fa4", d, dv, g, False, window=(100, 0))
    for d, dv, g in ((128, 128, 4), (128, 128, 1), (192, 128, 1), (256, 256, 2)):
        for causal in (False, True):
            add("fa4", d, dv, g, causal, varlen=True)
    add("fa4", 256, 256, 2, False, window=(1023, 0))
    add("fa4", 256, 256, 2, False, varlen=True, window=(1023, 0), directions=("fwd",))  # decode, padded batches
    for dtype in ("bfloat16", "float16"):  # tiny Gemma 4 in the HF parity test (both dtypes)
        for varlen in (False, True):
            add("fa4", 256, 256, 2, False, varlen, window=(15, 0), dtype=dtype)
            add("ffpa", 512, 512, 8, True, varlen, dtype=dtype)
    for dtype in ("bfloat16", "float16"):  # FA4 helpers (tests/torch/test_fa4_helpers_gpu.py)
        for d, dv in ((128, 128), (192, 128), (256, 256)):
            for g in (1, 2, 4):
                add("fa4", d, dv, g, True, varlen=True, dtype=dtype)
                add("fa4", d, dv, g, True, dtype=dtype)
    add("fa4", 256, 256, 2, False, window=(63, 0))  # JAX sliding-window test
    add("fa4", 128, 128, 2, True, dtype="float16", directions=("fwd",))
    for dtype in ("bfloat16", "float16"):  # ring / CP tests (tests/*/test_ring_gpu.py): tiny Gemma 4 halo, fp16 ring
        add("fa4", 256, 256, 2, False, window=(4, 0), dtype=dtype)
        add("ffpa", 512, 512, 4, True, dtype=dtype)
    add("fa4", 256, 256, 2, False, window=(1023, 0), dtype="float16")
    for window in ((1500, 0), (137, 0), (100, 37)):  # JAX ring halo tests (d128 GQA 4)
        add("fa4", 128, 128, 4, False, window=window)
    for window in ((6, 0), (6, None), (None, 4), (0, 0), (3, 2)):  # window spellings (test_window_forms_gpu.py)
        add("fa4", 128, 128, 2, False, window=window)
    from xattn.core.split_kv import COMBINE_CHUNKS, CombineSpec
    for dtype in ("bfloat16", "float16"):  # the split-KV decode route (tests/torch/test_split_kv_gpu.py, decode bench)
        for family, d, g in (("ffpa", 512, 8), ("ffpa", 512, 4), ("fa4", 128, 4), ("fa4", 256, 2)):
            for causal in (False, True):
                add(family, d, d, g, causal, varlen=True, dtype=dtype, directions=("fwd",))
            out += [CombineSpec(family, dtype, d, c) for c in COMBINE_CHUNKS]  # the route picks one by P
    add("fa4", 128, 128, 4, False, varlen=True, window=(64, 0), directions=("fwd",))  # tests/torch/test_kvcache_gpu.py
    # tests/torch/test_paged_gpu.py and the decode bench's paged rows; d96: benchmarks/tools/paged_tile_probe.py
    paged = [("ffpa", 512, (8, 4), (64, 256)), ("ffpa", 384, (1,), (128,)), ("fa4", 128, (8, 4), (16, 64, 128, 256)),
             ("fa4", 256, (2,), (64, 256)), ("fa4", 96, (2,), (16, 128))]
    for family, d, gs, sizes in paged:
        for g in gs:
            for ps in sizes:
                for causal in (False, True):
                    out.append(KernelSpec(family, "fwd", "bfloat16", d, d, g, causal, page_size=ps))
    out.append(KernelSpec("fa4", "fwd", "bfloat16", 256, 256, 2, False, False, 1023, 0, page_size=256))
    for family, d, g, ps in (("ffpa", 512, 4, 64), ("ffpa", 512, 8, 256), ("fa4", 128, 4, 16), ("fa4", 256, 2, 64),
                             ("ffpa", 512, 8, 64)):
        out.append(KernelSpec(family, "fwd", "bfloat16", d, d, g, True, True, page_size=ps))  # prefill over pages
    for family, d, ps in (("ffpa", 512, 64), ("ffpa", 512, 256), ("fa4", 128, 128)):  # HF CB's block-table decode
        for causal in (False, True):  # (tests/torch/test_hf_continuous_batching_gpu.py: Hq 4 / Hkv 2)
            out.append(KernelSpec(family, "fwd", "bfloat16", d, d, 2, causal, page_size=ps))
    out.append(KernelSpec("fa4", "fwd", "bfloat16", 256, 256, 2, False, False, 4, 0, page_size=16))
    for family, d, g, ps in (("ffpa", 512, 8, 64), ("ffpa", 512, 8, 256), ("fa4", 128, 4, 16), ("fa4", 128, 4, 128),
                             ("fa4", 128, 4, 64), ("fa4", 128, 4, 256)):  # JAX (tests, benchmarks/paged_jax.py)
        out.append(KernelSpec(family, "fwd", "bfloat16", d, d, g, page_size=ps, kv_heads_first=True))
    out += [CombineSpec("ffpa", "bfloat16", 384, c) for c in COMBINE_CHUNKS]
    from xattn.core.paged import PagedMetaSpec
    out += [PagedMetaSpec(family, tail, packed) for family in ("ffpa", "fa4") for tail in (False, True)
            for packed in (False, True)]  # the paged split route's index kernel
    from xattn.core.split_kv import SplitMetaSpec
    out += [SplitMetaSpec(family, tail, packed) for family in ("ffpa", "fa4") for tail in (False, True)
            for packed in (False, True)]  # the contiguous split route's, with device lengths
    from xattn.core.split_kv import split_launch_spec
    out += [KernelSpec("fa4", "fwd", dtype, 128, 128, g, False, True) for dtype in ("bfloat16", "float16")
            for g in (1, 2, 4, 8)]  # the split launch's decode tile at every GQA ratio the GPU tests draw
    from xattn.core.paged import tma_page_rows
    mapped = [dataclasses.replace(s, page_size=tma_page_rows(s.family, s.head_dim, s.head_dim_v, s.page_size))
              for s in out if isinstance(s, KernelSpec) and s.page_size and not s.varlen and not s.kv_heads_first
              and not s.is_local]
    out += [s if s.causal else split_launch_spec(s) for s in mapped]  # torch's paged split route reads pages of
    # several key tiles as pages of one: its split launches (on the decode tile where the core has one) and tail
    out += [split_launch_spec(s) for s in out if isinstance(s, KernelSpec) and split_launch_spec(s) is not s]
    out += [split_launch_spec(s, shared_q=True) for s in out  # torch's contiguous split launch: q as it is
            if isinstance(s, KernelSpec) and type(s) is KernelSpec and s.varlen and not s.causal]
    from xattn.core.split_kv import BATCHED_SLOT_FAMILIES, TAIL_SLOT_FAMILIES, SlotCallSpec
    out += [SlotCallSpec(s.family, s.dtype, s.head_dim, s.head_dim_v, s.qhead_per_kvhead, c, tail, batched)
            for s in out if isinstance(s, KernelSpec) and s.varlen and not s.causal and not s.is_local  # torch's
            and s.page_size is None for c in COMBINE_CHUNKS  # slot calls, one sequence and batched
            for batched in (False, True) if not batched or s.family in BATCHED_SLOT_FAMILIES
            for tail in (False, True) if not tail or batched or s.family in TAIL_SLOT_FAMILIES]
    seen, unique = set(), []
    for s in out:
        if s not in seen and (not isinstance(s, KernelSpec) or supports(s) is None):
            seen.add(s)
            unique.append(s)
    return unique


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--recorded", default=None, help="also the specs a CPU run recorded (XATTN_RECORD_SPECS)")
    ap.add_argument("--fuzz", action="store_true", help="also the fuzz launcher pool (pytest -m fuzz)")
    ap.add_argument("--only", default=None, help="only the launchers whose short name matches this regex")
    ap.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # "i/n": build every n-th spec
    args = ap.parse_args()
    todo = specs(args.recorded, args.fuzz)
    if args.only:
        import re
        todo = [s for s in todo if re.search(args.only, s.short_name())]
    if args.list:
        print("\n".join(s.short_name() for s in todo), f"\n{len(todo)} launchers", sep="")
        return
    # outside .gpu/ (pack.sh wipes it), so a later session's prefill only compiles what changed
    cache = Path(os.environ.setdefault("XATTN_CACHE_DIR", str(ROOT / ".prefill-cache")))
    if args.shard:
        i, n = map(int, args.shard.split("/"))
        from xattn.core import warmup

        warmup.run(todo[i::n], out=sys.stdout)
        return
    extra = (["--recorded", args.recorded] if args.recorded else []) + (["--only", args.only] if args.only else []) \
        + (["--fuzz"] if args.fuzz else [])
    procs = [subprocess.Popen([sys.executable, __file__, "--shard", f"{i}/{args.jobs}", *extra], env=os.environ)
             for i in range(args.jobs)]
    if any(p.wait() for p in procs):
        sys.exit("prefill: a shard failed")
    target = ROOT / ".gpu" / "kc" / "kernels.tar.xz"
    target.parent.mkdir(parents=True, exist_ok=True)  # pack.sh wipes .gpu/
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        with tarfile.open(tmp.name, "w:xz") as tar:
            for f in sorted(cache.glob("*")):  # .o (the commit point), .so, .json; no locks
                if f.is_file():
                    tar.add(f, arcname=f.name)
    os.replace(tmp.name, target)
    print(f"prefill: {target} ({target.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
