"""d512 backward routes (issue #14): FFPA's fused backward vs the chunked-GEMM backward.

    python benchmarks/bwd_routes.py [--seqlens 8192,16384] [--frameworks torch,jax] [--dtypes bfloat16,float16]
        [--routes ffpa,gemm] [--shapes 32/4/causal,16/16/full,16/16/causal]
        [--out benchmarks/results/bwd_routes_h200.json]

Shapes: the issue's three target rows (B1, d512): Hq32/Hkv4 causal (Gemma 4 global layers),
Hq16/Hkv16 non-causal, Hq16/Hkv16 causal; bf16 and fp16. Per (shape, N, dtype, route):
``bwd`` (the custom op ``xattn::bwd`` alone) and ``fwd+bwd`` (``xattn.torch.attention`` forward +
``backward()`` through autograd), TFLOP/s with the FlashAttention convention (fwd 4·B·Hq·N²·D,
causal half; bwd 2.5x, fwd+bwd 3.5x), and the backward's peak memory beyond its inputs
(``extra_gib``: max allocated during the call minus allocated before it, outputs included).
JAX (``--frameworks``): ``xattn.jax.ffpa_attention`` fwd+bwd under ``jax.jit(jax.grad)``, both routes.
The route is forced with ``XATTN_BWD_ROUTE``. Timing: ``triton.testing.do_bench`` medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.bench import bench_ms, flops  # noqa: E402

SHAPES = ((32, 4, True), (16, 16, False), (16, 16, True))
TARGETS = {(32, 4, True): 400, (16, 16, False): 450, (16, 16, True): 400}  # fwd+bwd TFLOP/s, N >= 8k


def shape_name(shape) -> str:
    hq, hkv, causal = shape
    return f"{hq}/{hkv}/{'causal' if causal else 'full'}"


def log(msg: str) -> None:
    print(f"[bwd-routes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def measure(hq, hkv, causal, n, dtype, route) -> list[dict]:
    import xattn.torch as xt
    import xattn.torch.ops as ops

    os.environ["XATTN_BWD_ROUTE"] = route
    d, scale = 512, 512 ** -0.5
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype)  # noqa: E731
    q, k, v, dout = mk(1, n, hq, d), mk(1, n, hkv, d), mk(1, n, hkv, d), mk(1, n, hq, d)
    out, lse = ops.fwd(q, k, v, "ffpa", scale, causal, -1, -1, None, None, 0, 0)

    def bwd():
        return ops.bwd(dout, q, k, v, out, lse, "ffpa", scale, causal, -1, -1, None, None, 0, 0)

    bwd()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = bwd()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2 ** 30
    del grads
    t_bwd = bench_ms(bwd)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        qg.grad = kg.grad = vg.grad = None
        xt.attention(qg, kg, vg, causal=causal).backward(dout)

    t_all = bench_ms(fwd_bwd)
    base = dict(method="xattn.torch", route=route, heads_q=hq, heads_kv=hkv, causal=causal, seqlen=n,
                dtype=str(dtype).replace("torch.", ""), head_dim=d, device=torch.cuda.get_device_name(),
                target_fwd_bwd_tflops=TARGETS[(hq, hkv, causal)])
    f = flops(1, hq, n, n, d, causal, "fwd")
    return [dict(base, **{"pass": "bwd", "ms": round(t_bwd, 4), "tflops": round(2.5 * f / t_bwd / 1e9, 1),
                          "extra_gib": round(extra, 3)}),
            dict(base, **{"pass": "fwd+bwd", "ms": round(t_all, 4), "tflops": round(3.5 * f / t_all / 1e9, 1)})]


def measure_jax(hq, hkv, causal, n, dtype, route) -> list[dict]:
    """fwd+bwd of ``xattn.jax.ffpa_attention`` under ``jax.jit(jax.grad(...))`` (the JAX stopwatch of
    benchmarks/full.py); the route is read when the function is traced."""
    import jax

    import benchmarks.full as full

    os.environ["XATTN_BWD_ROUTE"] = route
    full.DTYPE = dtype  # of the inputs jax_callable makes
    fn, args = full.jax_callable("xattn.jax", 512, hq, hkv, n, causal, "fwd+bwd")
    ms = full.time_jax(fn, *args)
    del fn, args
    jax.clear_caches()
    f = flops(1, hq, n, n, 512, causal, "fwd")
    return [dict(method="xattn.jax", route=route, heads_q=hq, heads_kv=hkv, causal=causal, seqlen=n, dtype=dtype,
                 head_dim=512, device=torch.cuda.get_device_name(), target_fwd_bwd_tflops=TARGETS[(hq, hkv, causal)],
                 **{"pass": "fwd+bwd", "ms": round(ms, 4), "tflops": round(3.5 * f / ms / 1e9, 1)})]


def markdown(rows) -> str:
    lines = ["| shape | N | dtype | FFPA bwd | GEMM bwd | fwd+bwd FFPA | fwd+bwd GEMM | target | GEMM bwd extra GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = [r for r in rows if r["method"] == "xattn.torch"]
    key = lambda r: (r["heads_q"], r["heads_kv"], r["causal"], r["seqlen"], r["dtype"])  # noqa: E731
    for k in dict.fromkeys(key(r) for r in rows):
        get = {(r["route"], r["pass"]): r for r in rows if key(r) == k}
        if not all((rt, p) in get for rt in ("ffpa", "gemm") for p in ("bwd", "fwd+bwd")):
            continue
        hq, hkv, causal, n, dt = k
        shape = f"Hq{hq}/Hkv{hkv} {'causal' if causal else 'non-causal'}"
        lines.append(f"| {shape} | {n} | {dt} | {get['ffpa', 'bwd']['tflops']} | {get['gemm', 'bwd']['tflops']} | "
                     f"{get['ffpa', 'fwd+bwd']['tflops']} | **{get['gemm', 'fwd+bwd']['tflops']}** | "
                     f">= {get['gemm', 'bwd']['target_fwd_bwd_tflops']} | {get['gemm', 'bwd']['extra_gib']} |")
    return "\n".join(lines)


def markdown_jax(rows) -> str:
    lines = ["| shape | N | dtype | fwd+bwd FFPA bwd | fwd+bwd GEMM bwd | target |", "|---|---|---|---|---|---|"]
    get = {(r["heads_q"], r["heads_kv"], r["causal"], r["seqlen"], r["dtype"], r["route"]): r
           for r in rows if r["method"] == "xattn.jax"}
    for (hq, hkv, causal, n, dt, route), r in get.items():
        other = get.get((hq, hkv, causal, n, dt, "ffpa"))
        if route != "gemm" or other is None:
            continue
        lines.append(f"| Hq{hq}/Hkv{hkv} {'causal' if causal else 'non-causal'} | {n} | {dt} | {other['tflops']} | "
                     f"**{r['tflops']}** | >= {r['target_fwd_bwd_tflops']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlens", default="8192,16384")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--routes", default="ffpa,gemm")
    ap.add_argument("--shapes", default=",".join(shape_name(s) for s in SHAPES),
                    help="Hq/Hkv/causal|full, comma-separated (the issue's three rows by default)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    frameworks = args.frameworks.split(",")
    wanted = args.shapes.split(",")
    unknown = set(wanted) - {shape_name(s) for s in SHAPES}
    if unknown:
        ap.error(f"--shapes: unknown {sorted(unknown)}; known: {[shape_name(s) for s in SHAPES]}")
    for hq, hkv, causal in (s for s in SHAPES if shape_name(s) in wanted):
        for n in (int(x) for x in args.seqlens.split(",")):
            for dt in args.dtypes.split(","):
                for route in args.routes.split(","):
                    got = measure(hq, hkv, causal, n, getattr(torch, dt), route) if "torch" in frameworks else []
                    if "jax" in frameworks:
                        got += measure_jax(hq, hkv, causal, n, dt, route)
                    for r in got:
                        log(f"{r['method']} {route} Hq{hq}/Hkv{hkv} causal={causal} N{n} {dt} {r['pass']}: "
                            f"{r['tflops']} TFLOP/s")
                    rows += got
                    torch.cuda.empty_cache()
                    if args.out:
                        with open(args.out, "w") as f:
                            json.dump({"rows": rows}, f, indent=1)
    print(markdown(rows))
    print(markdown_jax(rows))


if __name__ == "__main__":
    main()
