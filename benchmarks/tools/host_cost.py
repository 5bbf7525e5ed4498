"""Host cost per call of both front ends on the GPU, with the real kernels (issue #25): what a caller's
thread pays per decode-sized call (B 1, H 8, N 128; HF: one query over 4096 keys), core included.

Each row is the best of 15 loops of 200 calls; the GPU is synchronised between loops, never inside one,
so a loop measures the time to enqueue (200 launches cannot fill the launch queue). ``gpu_us`` is the
kernel time per call on the stream (torch: CUDA events around a loop), to show that the loop was not
bound by the GPU. JAX calls are jitted (the C++ dispatch path); ``jit floor`` is a one-op program, XLA's
own cost per call; "each of 8 calls in one jit" is (8 chained calls - 1 call) / 7, what one more call
costs inside a model's program. Torch rows run under ``no_grad`` (decode).

    python benchmarks/tools/host_cost.py [--label after] [--out benchmarks/results/host_cost_h200.json]

``--out`` continues the file; a row measured again (same label, commit, front end, call) keeps the best
of its runs (``runs`` lists them): run before and after alternately, since a host's speed drifts.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def us_per_call(fn, wait, n: int = 200, loops: int = 15) -> float:
    """Best wall time per call (µs) of ``loops`` loops of ``n`` back-to-back calls, ``wait()`` between loops."""
    for _ in range(50):
        fn()
    wait()
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        wait()
    return best


def gpu_us(fn, n: int = 200) -> float:
    """Stream time per call (µs, CUDA events around ``n`` back-to-back calls of ``fn``)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def torch_rows() -> list[dict]:
    import torch
    from transformers import masking_utils as mu

    import xattn.core as xc
    import xattn.torch as xt
    from xattn.torch import ffpa_attention as fa

    class Layer(torch.nn.Module):
        is_causal = True

    layer, nk = Layer(), 4096
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q, q5 = mk(1, 128, 8, 128), mk(1, 128, 8, 512)
    o, o5 = torch.empty_like(q), torch.empty_like(q5)
    lse = torch.empty(1, 8, 128, device="cuda")
    hq, hk = mk(1, 32, 1, 512), mk(1, 4, nk, 512)
    sq, sk = mk(1, 32, 1, 256), mk(1, 16, 1024, 256)
    pad = torch.ones(1, nk, dtype=torch.bool, device="cuda")
    window = mu.sliding_window_causal_mask_function(1024)
    full = lambda: fa.ffpa_mask(1, 1, nk, q_offset=nk - 1, mask_function=mu.causal_mask_function,  # noqa: E731
                                attention_mask=pad)
    sliding = lambda: fa.ffpa_mask(1, 1, 1024, q_offset=nk - 1, kv_offset=nk - 1024,  # noqa: E731
                                   mask_function=window, attention_mask=pad)
    full_mask, sliding_mask = full(), sliding()
    cases = {
        "core fa4_fwd d128 (caller's out/lse)": lambda: xc.fa4_fwd(q, q, q, o, lse, softmax_scale=0.1),
        "core ffpa_fwd d512 (caller's out/lse)": lambda: xc.ffpa_fwd(q5, q5, q5, o5, lse, softmax_scale=0.1),
        "xattn.torch.attention d128 (FA4)": lambda: xt.attention(q, q, q, softmax_scale=0.1),
        "xattn.torch.attention d512 (FFPA)": lambda: xt.attention(q5, q5, q5, softmax_scale=0.1),
        "HF ffpa_mask, full layer (dynamic cache)": full,  # one mask tensor: its padding read is remembered
        "HF ffpa_mask, full layer, a new padding mask each call (as decode)": lambda: fa.ffpa_mask(
            1, 1, nk, q_offset=nk - 1, mask_function=mu.causal_mask_function,
            attention_mask=torch.ones(1, nk, dtype=torch.bool, device="cuda")),
        "HF ffpa_attention_forward, d512 decode": lambda: fa.ffpa_attention_forward(layer, hq, hk, hk, full_mask,
                                                                                    scaling=1.0),
        "HF ffpa_attention_forward, d256 sliding decode": lambda: fa.ffpa_attention_forward(
            layer, sq, sk, sk, sliding_mask, scaling=1.0),
    }
    out = []
    with torch.no_grad():
        for name, fn in cases.items():
            host = us_per_call(fn, torch.cuda.synchronize)
            out.append(dict(front_end="torch", call=name, us_per_call=round(host, 1), gpu_us=round(gpu_us(fn), 1)))
            print(f"{host:8.1f} us  (GPU {out[-1]['gpu_us']:6.1f} us)  torch  {name}", flush=True)
    return out


def jax_rows() -> list[dict]:
    import jax
    import jax.numpy as jnp

    import xattn.jax as xj

    ks = jax.random.split(jax.random.PRNGKey(0), 2)
    q = jax.random.normal(ks[0], (1, 128, 8, 128), jnp.bfloat16)
    q5 = jax.random.normal(ks[1], (1, 128, 8, 512), jnp.bfloat16)
    fa4 = jax.jit(lambda q, k, v: xj.flash_attention(q, k, v, scale=0.1, backend="kernel"))
    ffpa = jax.jit(lambda q, k, v: xj.ffpa_attention(q, k, v, scale=0.1, backend="kernel"))
    cases = {
        "jit floor (one elementwise op)": (jax.jit(lambda q, k, v: q * 2), q),
        "xattn.jax.flash_attention d128 (jit)": (fa4, q),
        "xattn.jax.ffpa_attention d512 (jit)": (ffpa, q5),
        "xattn.jax.flash_attention d128 (AOT compiled)": (fa4.lower(q, q, q).compile(), q),
        "xattn.jax.ffpa_attention d512 (AOT compiled)": (ffpa.lower(q5, q5, q5).compile(), q5),
    }
    def chained(fn, n):  # n dependent calls in one program
        def run(q, k, v):
            for _ in range(n):
                q = fn(q, k, v)
            return q
        return jax.jit(run)

    def timed(fn, x, loop=200):
        last = [None]

        def call():
            last[0] = fn(x, x, x)
        return us_per_call(call, lambda: jax.block_until_ready(last[0]), n=loop)

    out = []
    for name, (fn, x) in cases.items():
        host = timed(fn, x)
        out.append(dict(front_end="jax", call=name, us_per_call=round(host, 1)))
        print(f"{host:8.1f} us  jax    {name}", flush=True)
        if "AOT" in name:
            print(fn.as_text()[-2500:], flush=True)  # the optimised program one call runs
    # inside a model's jit (as Flax models call it): each extra call costs XLA's launch of one more custom call
    for label, fn, x in (("flash_attention d128", xj.flash_attention, q),
                         ("ffpa_attention d512", xj.ffpa_attention, q5)):
        call = lambda q, k, v, fn=fn: fn(q, k, v, scale=0.1, backend="kernel")  # noqa: E731
        one, eight = timed(chained(call, 1), x, 50), timed(chained(call, 8), x, 50)
        name = f"xattn.jax.{label}, each of 8 calls in one jit"
        out.append(dict(front_end="jax", call=name, us_per_call=round((eight - one) / 7, 1)))
        print(f"{out[-1]['us_per_call']:8.1f} us  jax    {name} (1 call: {one:.1f} us, 8 calls: {eight:.1f} us)",
              flush=True)
    return out


def merge(old: list[dict], rows: list[dict]) -> list[dict]:
    """``old`` rows continued by ``rows``: a row measured again (same label, commit, front end, call) keeps
    every run in ``runs`` and the best of them as ``us_per_call``; other old rows stay as they were."""
    key = lambda r: (r["label"], r["commit"], r["front_end"], r["call"])  # noqa: E731
    seen = {key(r): r for r in old}
    for r in rows:
        r["runs"] = seen.get(key(r), {}).get("runs", []) + [r["us_per_call"]]
        r["us_per_call"] = min(r["runs"])
    keys = {key(r) for r in rows}
    return [r for r in old if key(r) not in keys] + rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after")
    ap.add_argument("--out")
    ap.add_argument("--front-ends", default="torch,jax")
    ap.add_argument("--commit", help="the commit of the xattn tree measured (default: git's HEAD here)")
    args = ap.parse_args()
    commit = args.commit
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:  # no git on the machine
            commit = ""
    rows = []
    if "torch" in args.front_ends:
        rows += torch_rows()
    if "jax" in args.front_ends:
        rows += jax_rows()
    import torch

    device = torch.cuda.get_device_name(0)
    for r in rows:
        r.update(label=args.label, commit=commit, device=device, date=time.strftime("%Y-%m-%d"))
    if args.out:
        old = json.load(open(args.out)) if os.path.exists(args.out) else []
        rows = merge(old, rows)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
