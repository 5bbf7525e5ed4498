"""JAX paged decoding (issue #44): ``xattn.jax.paged_attention`` against Pallas' GPU ``paged_attention`` (the peer)
on the same call, time per call and the share of HBM bandwidth it reaches.

    python benchmarks/paged_jax.py [--out FILE] [--shapes d512,d128] [--caches 8192,32768] [--batches 1,8]
                                   [--page-sizes 64,256] [--impls xattn,pallas]

The call is Pallas' own: q ``[B, Hq, D]`` (one query per sequence, pre-scaled), pools ``[Hkv, pages, page_size,
D]`` of shuffled pages, ``block_tables [B, cache_len / page_size]``, ``lengths = cache_len``; bf16, fresh random
values, jitted, timed by the wall loop of ``benchmarks/full.py`` (``time_jax``: back-to-back calls, one
``block_until_ready`` per round, median of 5 rounds). Pallas runs with its default tiling (``block_h=16,
pages_per_compute_block=8, k_splits=16``) where that tiling can run, else the nearest one that can
(:func:`pallas_tiling`: a fixed rule over the shapes, nothing is tuned on the device). ``hbm_fraction`` = bytes of
K and V read / time / 4.3 TB/s, as ``benchmarks/decode_attention.py``.

Rows: ``impl, family, head_dim, hq, hkv, batch, cache_len, page_size, ms, hbm_fraction, status`` (a call that fails
gives its error as ``status``; the run goes on).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HBM_BYTES_PER_S = 4.3e12
SHAPES = {"d512": ("ffpa", 512, 32, 4), "d256": ("fa4", 256, 32, 16), "d128": ("fa4", 128, 32, 8)}


def log(msg: str) -> None:
    print(f"[paged-jax {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def inputs(d: int, hq: int, hkv: int, b: int, nk: int, ps: int, seed: int = 0, dtype: str = "bfloat16"):
    """``(q, k_pages, v_pages, block_tables, lengths)`` of one call (``dtype``; the pool has 2 spare pages)."""
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    per = nk // ps
    pages = b * per + 2
    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = (jax.random.normal(kq, (b, hq, d), jnp.float32) * d ** -0.5).astype(dt)
    k_pages = jax.random.normal(kk, (hkv, pages, ps, d), dt)
    v_pages = jax.random.normal(kv, (hkv, pages, ps, d), dt)
    tables = jax.random.permutation(kp, pages)[:b * per].reshape(b, per).astype(jnp.int32)
    return q, k_pages, v_pages, tables, jnp.full((b,), nk, jnp.int32)


PALLAS_SMEM_BYTES = 232448  # shared memory per block on the H200 (what Pallas' launch reports as available)


def pallas_tiling(head_dim: int, page_size: int, pages_per_sequence: int) -> dict | None:
    """Keyword arguments for Pallas' GPU ``paged_attention`` that it can run, or None where none fits.

    Its defaults (``pages_per_compute_block=8, k_splits=16``) need ``k_splits`` to divide the table's width and a
    block of 2 x pages_per_compute_block x page_size x head_dim 16-bit keys and values in shared memory (at d512
    with pages of 64 rows that is 1 MiB). This keeps the defaults where they run; otherwise the largest
    ``k_splits`` <= 16 that divides the width and the largest ``pages_per_compute_block`` <= 8 (capped, as Pallas
    does, at a split's pages) that divides a split's pages and fits the H200's shared memory.
    """
    k_splits = next(k for k in (16, 8, 4, 2, 1) if pages_per_sequence % k == 0)
    per_split = pages_per_sequence // k_splits
    for block in (8, 4, 2, 1):
        block = min(block, per_split)
        smem = 2 * block * page_size * head_dim * 2 + 2 * 16 * head_dim * 2
        if per_split % block == 0 and smem <= PALLAS_SMEM_BYTES:
            return dict(pages_per_compute_block=block, k_splits=k_splits)
    return None


def function(impl: str, tiling: dict | None = None):
    """The jitted call of ``impl`` (``xattn`` or ``pallas``, with ``tiling`` from :func:`pallas_tiling`)."""
    import functools

    import jax

    if impl == "xattn":
        import xattn.jax as xj

        return jax.jit(xj.paged_attention)
    if impl == "pallas":
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

        return jax.jit(functools.partial(paged_attention, **(tiling or {})))
    raise ValueError(f"impl {impl!r}: expected xattn or pallas")


def measure(impl: str, family: str, d: int, hq: int, hkv: int, b: int, nk: int, ps: int,
            dtype: str = "bfloat16") -> dict:
    from benchmarks.full import time_jax

    row = dict(impl=impl, family=family, head_dim=d, hq=hq, hkv=hkv, batch=b, cache_len=nk, page_size=ps)
    try:
        args = inputs(d, hq, hkv, b, nk, ps, seed=nk + b + ps, dtype=dtype)
        tiling = pallas_tiling(d, ps, nk // ps) if impl == "pallas" else None
        if impl == "pallas":
            if tiling is None:
                return dict(row, status=f"not run: no Pallas tiling fits d{d} pages of {ps} in shared memory")
            row.update(tiling)
        ms = time_jax(function(impl, tiling), *args)
    except Exception as exc:  # a row says why, the run goes on (OOM, the peer's limits)
        return dict(row, status=f"error: {type(exc).__name__}: {str(exc)[:200]}")
    kv_bytes = 2 * b * nk * hkv * d * 2  # (16-bit keys and values)
    return dict(row, ms=round(ms, 4), hbm_fraction=round(kv_bytes / (ms * 1e-3) / HBM_BYTES_PER_S, 4), status="ok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="d512,d128")
    ap.add_argument("--caches", default="8192,32768")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--page-sizes", default="64,256")
    ap.add_argument("--impls", default="xattn,pallas")
    args = ap.parse_args()
    rows = []
    if args.out and os.path.exists(args.out):
        rows = json.load(open(args.out)).get("rows", [])
    for shape in args.shapes.split(","):
        family, d, hq, hkv = SHAPES[shape]
        for b in map(int, args.batches.split(",")):
            for nk in map(int, args.caches.split(",")):
                for ps in map(int, args.page_sizes.split(",")):
                    for impl in args.impls.split(","):
                        row = measure(impl, family, d, hq, hkv, b, nk, ps)
                        rows.append(row)
                        log(" ".join(f"{k}={row.get(k)}" for k in ("impl", "head_dim", "batch", "cache_len",
                                                                   "page_size", "ms", "hbm_fraction", "status")))
                        if args.out:
                            with open(args.out, "w") as f:
                                json.dump({"benchmark": "paged_jax", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
