"""Host time of one split-KV decode call (issue #43, GPU machine): per-call loop time against stream time, and
where the host time goes (cProfile by function, torch.profiler by CPU op) for the eager rows whose ``ms`` sits
far above ``ms_graph`` in ``benchmarks/results/decode_attention_h200.json``.

    python benchmarks/tools/split_host_probe.py [--shapes d512:1:4:8192,d128:1:1:8192]   # name:B:Nq:Nk
        [--calls contiguous,sdpa,growing,fused,kvcache,paged64,packed,vllm64] [--profile] [--patterns] [--legacy-side]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {"d512": (512, 32, 4), "d256": (256, 32, 16), "d128": (128, 32, 8)}


def main() -> None:
    import torch
    from host_cost import gpu_us, us_per_call


    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="d512:1:1:8192,d512:1:4:8192,d128:1:1:8192")
    ap.add_argument("--calls", default="contiguous,fused", help=f"of {','.join(CALLS)}")
    ap.add_argument("--profile", action="store_true", help="cProfile and torch.profiler tables of each call")
    ap.add_argument("--patterns", action="store_true",
                    help="each call's host time in three patterns: back to back, after do_bench's L2 flush (no sync), "
                         "after a synchronize; the same with xattn's launches stubbed; torch.profiler of the flush "
                         "pattern")
    ap.add_argument("--legacy-side", action="store_true",
                    help="the causal tail's second stream as before session 20 (torch.cuda's Python stream wrappers), "
                         "to time against the default in the same process")
    args = ap.parse_args()
    if args.legacy_side:
        from xattn.torch import split_kv

        split_kv.Side = _LegacySide
    for item in args.shapes.split(","):
        name, b, nq, nk = item.split(":")
        d, hq, hkv = SHAPES[name]
        b, nq, nk = int(b), int(nq), int(nk)
        with torch.no_grad():
            for call in args.calls.split(","):
                fn = CALLS[call](b, nq, nk, d, hq, hkv)
                host = us_per_call(fn, torch.cuda.synchronize, n=100, loops=10)
                print(f"{item} {call}: host {host:.1f} us/call, stream {gpu_us(fn, 100):.1f} us/call", flush=True)
                if args.profile:
                    _profile(f"{item} {call}", fn)
                if args.patterns:
                    _patterns(f"{item} {call}", fn)


def _inputs(b, nq, nk, d, hq, hkv):
    import torch

    g = torch.Generator(device="cuda").manual_seed(nk + nq)
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def _paged(b, nq, nk, d, hq, hkv, page=64):
    """q and the same keys in a pool of shuffled pages, its table and lengths (a few keys short of full)."""
    import torch

    q, k, v = _inputs(b, nq, nk, d, hq, hkv)
    pages = b * nk // page
    order = torch.randperm(pages, device="cuda")
    pool_k = k.reshape(pages, page, hkv, d)[order.argsort()]
    pool_v = v.reshape(pages, page, hkv, d)[order.argsort()]
    table = order.view(b, nk // page).to(torch.int32)
    return q, pool_k, pool_v, table, torch.full((b,), nk - 3, dtype=torch.int32, device="cuda")


def _contiguous(b, nq, nk, d, hq, hkv, splits=0):
    import xattn.torch as xt

    q, k, v = _inputs(b, nq, nk, d, hq, hkv)
    return lambda: xt.attention(q, k, v, causal=True, num_splits=splits)


def _kvcache(b, nq, nk, d, hq, hkv):
    import torch

    import xattn.torch as xt

    q, k, v = _inputs(b, nq, nk, d, hq, hkv)
    lengths = torch.full((b,), nk - 3, dtype=torch.int32, device="cuda")
    return lambda: xt.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True)


def _paged_call(b, nq, nk, d, hq, hkv):
    import xattn.torch as xt

    q, pool_k, pool_v, table, lengths = _paged(b, nq, nk, d, hq, hkv)
    return lambda: xt.attention_with_kvcache(q, pool_k, pool_v, cache_seqlens=lengths, page_table=table, causal=True)


def _packed(b, nq, nk, d, hq, hkv):
    import torch

    import xattn.torch as xt

    q, k, v = _inputs(b, nq, nk, d, hq, hkv)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda") * nq
    cu_k = torch.arange(b + 1, dtype=torch.int32, device="cuda") * nk
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    return lambda: xt.attention(flat(q), flat(k), flat(v), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=nq,
                                max_seqlen_k=nk, causal=True)


def _vllm(b, nq, nk, d, hq, hkv):
    import torch

    import xattn.torch as xt

    q, pool_k, pool_v, table, lengths = _paged(b, nq, nk, d, hq, hkv)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device="cuda") * nq
    q = q.reshape(b * nq, hq, d)
    return lambda: xt.paged_attention(q, pool_k, pool_v, table, lengths, cu_seqlens_q=cu_q, max_seqlen_q=nq,
                                      causal=True)


def _growing(b, nq, nk, d, hq, hkv):
    """The contiguous call on a cache that grows by one key per call, as HF's ``DynamicCache`` decodes: every call
    has a new length (the split route sets up each; 4096 lengths in turn, more than its memo holds)."""
    import itertools

    import xattn.torch as xt

    q, k, v = _inputs(b, nq, nk + 4096, d, hq, hkv)
    step = itertools.count()

    def call():
        n = nk + next(step) % 4096
        return xt.attention(q, k[:, :n], v[:, :n], causal=True)

    return call


def _sdpa(b, nq, nk, d, hq, hkv):
    """torch SDPA on HF's ``[B, H, N, D]`` layout with ``enable_gqa`` (decode_attention.py's ``sdpa`` row): the host
    time xattn's eager call is judged against."""
    import torch
    import torch.nn.functional as F

    q, k, v = (t.transpose(1, 2) for t in _inputs(b, nq, nk, d, hq, hkv))
    mask = None if nq == 1 else torch.ones(nq, nk, dtype=torch.bool, device="cuda").tril(nk - nq)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


CALLS = {"contiguous": _contiguous, "sdpa": _sdpa, "growing": _growing, "fused": lambda *a: _contiguous(*a, splits=1),
         "kvcache": _kvcache, "paged64": _paged_call, "packed": _packed, "vllm64": _vllm}


class _LegacySide:
    """The second stream of the causal tail before session 20: torch.cuda's Python stream wrappers and a fresh
    event per wait (``Stream.wait_stream``), the A/B baseline of ``--legacy-side``."""

    _streams: dict = {}

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            self.stream = self._streams.get(device.index)
            if self.stream is None:
                self.stream = self._streams[device.index] = torch.cuda.Stream(device)

    def __bool__(self):
        return True

    def fork(self):
        return self.after_main()

    def after_main(self):
        import contextlib

        import torch

        if not self.cuda:
            return contextlib.nullcontext()
        self.stream.wait_stream(self.main)
        return torch.cuda.stream(self.stream)

    def join(self):
        if self.cuda:
            self.main.wait_stream(self.stream)


def _patterns(label, fn, reps: int = 200):
    """Median host µs of one call: back to back, after do_bench's L2 flush (a 256 MB ``zero_``, no sync) and after a
    synchronize; then the same with xattn's launch entries stubbed (Python and allocations alone); then the top CPU
    ops of the flush pattern (torch.profiler), to find a call that blocks on the GPU."""
    import statistics
    import time

    import torch

    from xattn.torch import ops

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def host(before) -> float:
        times = []
        for _ in range(reps):
            before()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    kinds = {"back to back": lambda: None, "after flush": flush.zero_, "after sync": torch.cuda.synchronize}
    real = dict(ops.LAUNCH)
    for stubbed in (False, True):
        if stubbed:
            for name in ops.LAUNCH:
                ops.LAUNCH[name] = lambda *a, **k: None
        try:
            cells = ", ".join(f"{kind} {host(before):.1f}" for kind, before in kinds.items())
        finally:
            ops.LAUNCH.update(real)
        print(f"{label}{' (launches stubbed)' if stubbed else ''}: host us per call, median of {reps}: {cells}",
              flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(50):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    print(f"--- {label} torch.profiler, 50 calls after a flush ---")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


def _profile(label, fn):
    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    print(f"--- {label} cProfile, 300 calls (tottime) ---\n" + "\n".join(s.getvalue().splitlines()[6:30]))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
    print(f"--- {label} torch.profiler, 50 calls ---")
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18), flush=True)


if __name__ == "__main__":
    main()
