"""One decoding attention call against a KV cache (issue #43): time and the share of HBM bandwidth it reaches.

    python benchmarks/decode_attention.py [--out FILE] [--shapes d512,d256,d128] [--caches 8192,32768,131072]
                                          [--batches 1,8] [--impls xattn,xattn-fused,sdpa]

The call is ``xattn.torch.attention(q [B, Nq, Hq, D], k, v [B, Nk, Hkv, D], causal=True)`` (bf16, fresh
random values; q_len 1, and 4 for d512), timed with ``triton.testing.do_bench`` (median of its repetitions;
do_bench flushes the L2 cache between runs). Impls:

* ``xattn``: the route :func:`xattn.core.routes.forward_route` picks (``split-kv`` where the rule splits);
* ``xattn-fused``: ``num_splits=1``, the fused kernel (the route before #43);
* ``xattn-sN``: ``num_splits=N`` (a sweep of the split count);
* ``xattn-pagedPS``: ``xt.attention_with_kvcache(..., page_table=)`` on the same keys in a pool of shuffled pages
  of PS rows (rows get ``paged: true, page_size``; issue #44);
* ``xattn-packed`` / ``xattn-packed-fused``: the same call packed (q ``[B Nq, Hq, D]``, k/v ``[B Nk, Hkv, D]``,
  ``cu_seqlens_q/k``, ``max_seqlen_q = Nq``: vLLM's and HF continuous batching's decode step), the route's pick /
  ``num_splits=1`` (rows get ``packed: true``);
* ``xattn-pagedPS-cpasync``: the same, FA4 reading pages of several key tiles as they are (cp.async), not as
  pages of one tile (TMA, :func:`xattn.core.paged.tma_page_rows`);
* ``xattn-vllmPS``: vLLM's paged decode call, ``xt.paged_attention(q packed, pools, page_table, seqused_k,
  cu_seqlens_q=, max_seqlen_q=Nq)`` on pages of PS rows (``paged: true, packed: true``);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on HF's ``[B, H, N, D]`` layout with
  ``enable_gqa`` (at q_len 1 causal is no mask; at q_len > 1 the bottom-right causal mask as a boolean ``attn_mask``,
  what HF hands SDPA for a speculative step: SDPA's ``is_causal`` aligns top-left, so its Nq queries would see Nq
  keys. Rows before session 24 at q_len > 1 used ``is_causal`` and time another problem).

``hbm_fraction`` = bytes of K and V read / time / the device's bandwidth (``hbm_bytes_per_s`` in each row: 4.3 TB/s
on an H200, the copy bandwidth the issue measured; 3.35 TB/s on an H100 SXM, its nominal peak). ``ms`` times the
eager call, host included: do_bench enqueues calls back to back, so a call whose
host work outlasts its kernels is timed by its host work. ``ms_graph`` replays the same call captured in a
CUDA graph: the kernels alone, as a serving engine or HF's static-cache generate runs decode steps.

``host_us``: the median host time of one eager call after a ``synchronize`` (its enqueueing, plus the host thread's
wake-up after the wait: it grew with the cache length for SDPA and xattn alike in session 30; the back-to-back host
cost is ``benchmarks/tools/split_host_probe.py --patterns``). The first row is measured once more before the run
and dropped (a process's first timed calls ran slow).

Rows: ``impl, family, head_dim, hq, hkv, batch, q_len, cache_len, ms, hbm_fraction, ms_graph,
hbm_fraction_graph, host_us, route, splits, status``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HBM_BYTES_PER_S = {"H200": 4.3e12, "H100": 3.35e12}  # by the device name's model; other devices: no fraction
SHAPES = {  # name: (family, head_dim, hq, hkv): Gemma-4-31B's global layer, its sliding layer without a window, Llama
    "d512": ("ffpa", 512, 32, 4),
    "d256": ("fa4", 256, 32, 16),
    "d128": ("fa4", 128, 32, 8),
}


def log(msg: str) -> None:
    print(f"[decode-attn {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def measure(impl: str, family: str, d: int, hq: int, hkv: int, b: int, nq: int, nk: int) -> dict:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import xattn.torch as xt
    from xattn.core import routes, split_kv
    from xattn.torch.split_kv import num_sms

    row = dict(impl=impl, family=family, head_dim=d, hq=hq, hkv=hkv, batch=b, q_len=nq, cache_len=nk)
    g = torch.Generator(device="cuda").manual_seed(nk + b + nq)
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    if impl == "sdpa":
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        mask = None if nq == 1 else torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)
        fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, enable_gqa=True)  # noqa: E731
        row.update(route="sdpa", splits=None)
    elif impl.startswith(("xattn-paged", "xattn-vllm")):  # the same keys in a pool of shuffled pages (issue #44)
        import xattn.torch.paged as torch_paged

        own_pages = impl.endswith("-cpasync")  # FA4: pages of two key tiles read as they are (cp.async), not as tiles
        ps = int(impl.removeprefix("xattn-paged").removeprefix("xattn-vllm").removesuffix("-cpasync"))
        torch_paged._split_rows = _own_page_rows if own_pages else _TILE_ROWS
        pages = b * nk // ps
        perm = torch.randperm(pages, device="cuda", generator=g)
        k_pool = torch.empty(pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16)
        v_pool = torch.empty_like(k_pool)
        k_pool[perm] = k.reshape(pages, ps, hkv, d)
        v_pool[perm] = v.reshape(pages, ps, hkv, d)
        table = perm.view(b, nk // ps).to(torch.int32)
        lengths = torch.full((b,), nk, dtype=torch.int32, device="cuda")
        if impl.startswith("xattn-vllm"):
            cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32) * nq
            qp = q.reshape(b * nq, hq, d)
            fn = lambda: xt.paged_attention(qp, k_pool, v_pool, table, lengths, cu_seqlens_q=cu_q,  # noqa: E731
                                            max_seqlen_q=nq, causal=True)
            row.update(packed=True)
        else:
            fn = lambda: xt.attention_with_kvcache(q, k_pool, v_pool, cache_seqlens=lengths,  # noqa: E731
                                                   causal=True, page_table=table)
        row.update(route="paged", splits=None, paged=True, page_size=ps)
    elif impl.startswith("xattn-packed"):  # vLLM's / HF continuous batching's packed decode step (#43)
        num_splits = 1 if impl == "xattn-packed-fused" else 0
        cu_q = torch.arange(b + 1, device="cuda", dtype=torch.int32) * nq
        cu_k = torch.arange(b + 1, device="cuda", dtype=torch.int32) * nk
        qp, kp, vp = q.reshape(b * nq, hq, d), k.reshape(b * nk, hkv, d), v.reshape(b * nk, hkv, d)
        fn = lambda: xt.attention(qp, kp, vp, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,  # noqa: E731
                                  max_seqlen_q=nq, max_seqlen_k=nk, num_splits=num_splits)
        route = routes.forward_route(routes.FwdProblem(family, b, hkv, hq // hkv, nq, nk, causal=True, varlen=True,
                                                       num_sms=num_sms(q.device), num_splits=num_splits), "auto")
        row.update(route=route.name, splits=route.plan.splits if route.plan else 1, packed=True)
    else:
        fixed = {"xattn": 0, "xattn-fused": 1}
        num_splits = fixed[impl] if impl in fixed else int(impl.removeprefix("xattn-s"))
        fn = lambda: xt.attention(q, k, v, causal=True, num_splits=num_splits)  # noqa: E731
        route = routes.forward_route(routes.FwdProblem(family, b, hkv, hq // hkv, nq, nk, causal=True,
                                                       num_sms=num_sms(q.device), num_splits=num_splits), "auto")
        row.update(route=route.name, splits=route.plan.splits if route.plan else 1,
                   max_partials=split_kv.MAX_PARTIALS)
    try:
        fn()
        torch.cuda.synchronize()
        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        ms_graph = do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        host_us = _host_us(fn)
    except torch.OutOfMemoryError:
        return dict(row, status="oom")
    except Exception as exc:  # a row says why, the run goes on
        return dict(row, status=f"error: {type(exc).__name__}: {str(exc)[:200]}")
    kv_bytes = 2 * b * nk * hkv * d * 2
    peak = next((v for k, v in HBM_BYTES_PER_S.items() if k in torch.cuda.get_device_name()), None)
    share = lambda t: round(kv_bytes / (t * 1e-3) / peak, 4) if peak else None  # noqa: E731
    return dict(row, ms=round(ms, 4), hbm_fraction=share(ms), ms_graph=round(ms_graph, 4),
                hbm_fraction_graph=share(ms_graph), host_us=round(host_us, 1), hbm_bytes_per_s=peak, status="ok")


def _host_us(fn, calls: int = 50) -> float:
    """Median host time of one eager call (µs): from the call to its return, after a ``synchronize`` (never a wait
    for earlier work; the host thread's wake-up after that wait included)."""
    import statistics

    import torch

    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


_TILE_ROWS = None  # xattn.torch.paged._split_rows, kept when the module is first imported


def _own_page_rows(family, d, dv, k_pages, v_pages):
    return k_pages.shape[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default="d512,d256,d128")
    ap.add_argument("--caches", default="8192,32768,131072")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--impls", default="xattn,xattn-fused,sdpa",
                    help="also xattn-sN, xattn-pagedPS, xattn-packed(-fused), xattn-vllmPS (module docstring)")
    ap.add_argument("--q-lens", default=None, help="queries per sequence (default: 1, and 4 for d512)")
    args = ap.parse_args()
    import torch

    import xattn.torch.paged as torch_paged

    global _TILE_ROWS
    _TILE_ROWS = torch_paged._split_rows

    rows = []
    # a throwaway first measurement: the process's first timed calls ran slow (the first row's eager ms 1.5-3.5x
    # the same row's later ones, H100 session 30), the rows must not depend on their order
    first_shape = SHAPES[args.shapes.split(",")[0]]
    warm = measure(args.impls.split(",")[0], *first_shape, int(args.batches.split(",")[0]), 1,
                   int(args.caches.split(",")[0]))
    log(f"warm-up row (not kept): ms={warm.get('ms')} ms_graph={warm.get('ms_graph')} status={warm.get('status')}")
    for name in args.shapes.split(","):
        family, d, hq, hkv = SHAPES[name]
        for b in map(int, args.batches.split(",")):
            for nk in map(int, args.caches.split(",")):
                for nq in (map(int, args.q_lens.split(",")) if args.q_lens else (1, 4) if d == 512 else (1,)):
                    for impl in args.impls.split(","):
                        if impl == "sdpa" and d == 512 and b > 1:
                            continue  # SDPA's d512 path is the math one: slow; the B1 rows say enough
                        row = measure(impl, family, d, hq, hkv, b, nq, nk)
                        row.update(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"))
                        rows.append(row)
                        log(" ".join(f"{k}={row.get(k)}" for k in ("impl", "head_dim", "batch", "q_len", "cache_len",
                                                                   "ms", "hbm_fraction", "ms_graph",
                                                                   "hbm_fraction_graph", "host_us", "route", "splits",
                                                                   "status")))
                        if args.out:
                            with open(args.out, "w") as f:
                                json.dump({"suite": __doc__.split("\n\n")[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
