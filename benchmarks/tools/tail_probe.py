"""Where FFPA's causal tail of a speculative decode step should run (issue #43, GPU machine): one sequence, q_len 4,
on the slot launch. Times, in one process, with ``triton.testing.do_bench`` (L2 flushed, median) over several rounds:

* ``eager``: the slot call (splits, tail and combine in one host function, one stream);
* ``graph-beside``: a CUDA graph of the launches one by one, the tail on a second stream (a parallel branch);
* ``graph-one-call``: a CUDA graph of the slot call (the tail after the splits on one stream);
* ``q1-graph``: the same cache with one query (the issue's target: q_len 4 within 10 % of q_len 1).

    python benchmarks/tools/tail_probe.py [--caches 8192,32768,131072] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> None:
    import torch
    from triton.testing import do_bench

    import xattn.torch as xt
    from xattn.torch import split_kv

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caches", default="8192,32768,131072")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    d, hq, hkv = 512, 32, 4
    for nk in map(int, args.caches.split(",")):
        g = torch.Generator(device="cuda").manual_seed(nk)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        k, v = mk(1, nk, hkv, d), mk(1, nk, hkv, d)
        q4, q1 = mk(1, 4, hq, d), mk(1, 1, hq, d)

        def graph_of(q, beside):
            split_kv.CAPTURED_TAIL_BESIDE = beside
            xt.attention(q, k, v, causal=True)  # set up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                xt.attention(q, k, v, causal=True)
            split_kv.CAPTURED_TAIL_BESIDE = True
            return graph.replay

        fns = {"eager": lambda: xt.attention(q4, k, v, causal=True), "graph-beside": graph_of(q4, True),
               "graph-one-call": graph_of(q4, False), "q1-graph": graph_of(q1, True)}
        times = {name: [] for name in fns}
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3)
        line = "  ".join(f"{name} {' / '.join(f'{t:.1f}' for t in ts)}" for name, ts in times.items())
        print(f"d512 B1 q4 Nk {nk} (us, {args.rounds} rounds): {line}", flush=True)


if __name__ == "__main__":
    main()
