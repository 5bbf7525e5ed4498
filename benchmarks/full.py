"""The full comparison (issue #6), GPU machine: xattn vs every alternative, rows into one JSON.

    python benchmarks/full.py --part d512 --out benchmarks/results/full_h200.json   # and: small, sliding,
    python benchmarks/full.py --part small --append ...                              # varlen, host, peak, fp16
    python benchmarks/full.py --dry-run                                              # list the plan (CPU)

Each part fits one device call; ``--append`` merges into the same file. Rows follow the core
suite's form (method, head_dim, causal, batch, heads_q, heads_kv, seqlen, pass, ms, tflops, device,
dtype, varlen, us_per_call) plus ``status`` ("ok", "oom", "refused: ...", "error: ...") and ``part``.
Timing: torch paths use ``triton.testing.do_bench`` medians; JAX paths the median wall time of
``block_until_ready`` loops after warm-up. A path slower than 1.5 s per call is timed over 3 calls.
TFLOP/s: fwd 4*B*Hq*Nq*Nk*D (causal: half), fwd+bwd 3.5x. ``benchmarks/report.py`` turns the JSON
into the markdown table and the PNG plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
SLOW_MS = 1500.0  # a method slower than this per call is not run at twice the N (4x the work; its row says so)
D512_HEADS = ((32, 4), (16, 16))  # Gemma 4 global layers; MHA
SMALL = ((128, 16, 16), (256, 32, 16))  # (head_dim, Hq, Hkv)
DTYPE = "bfloat16"  # of the inputs; main() sets "float16" for the part "fp16"


def plan(part: str):
    """``[(method, d, hq, hkv, n, causal, pass)]`` for a part (no GPU needed)."""
    rows = []
    if part == "d512":
        methods = ("xattn.torch", "xattn.jax", "ffpa_attn native", "torch sdpa", "jax xla", "jax cudnn")
        for (hq, hkv) in D512_HEADS:
            for n in SEQLENS:
                for causal in (False, True):
                    for p in ("fwd", "fwd+bwd"):
                        rows += [(m, 512, hq, hkv, n, causal, p) for m in methods]
    elif part == "small":
        methods = ("xattn.torch", "xattn.jax", "flash_attn.cute native", "torch sdpa", "jax cudnn")
        for d, hq, hkv in SMALL:
            for n in (4096, 8192, 16384):
                for causal in (False, True):
                    for p in ("fwd", "fwd+bwd"):
                        rows += [(m, d, hq, hkv, n, causal, p) for m in methods]
    elif part == "hf":  # issue #3: the HF attention function vs the native kernel, same run
        for (hq, hkv) in D512_HEADS:
            for n in (4096, 8192, 16384):
                for p in ("fwd", "fwd+bwd"):
                    rows += [(m, 512, hq, hkv, n, True, p) for m in ("xattn HF ffpa_attention_forward",
                                                                    "xattn.torch", "ffpa_attn native")]
    elif part == "sliding":
        rows += [(m, 256, 32, 16, 8192, "window1024", p) for m in ("xattn.torch fa4 local", "torch flex attention")
                 for p in ("fwd", "fwd+bwd")]
    elif part == "varlen":
        rows += [(m, d, hq, hkv, 16384, True, p) for m in ("xattn.torch varlen", "xattn.jax varlen")
                 for d, hq, hkv in ((512, 32, 4), (128, 16, 16)) for p in ("fwd", "fwd+bwd")]
    elif part == "host":
        rows += [(m, d, 8, 8, 128, False, "fwd") for d, ms in ((512, ("xattn.torch", "xattn.jax", "ffpa_attn native")),
                                                               (128, ("xattn.torch", "xattn.jax",
                                                                      "flash_attn.cute native")))
                 for m in ms]
    elif part == "fp16":  # the Gemma 4 global layer in fp16 (every other part is bf16); SDPA rows last
        for methods in (("xattn.torch", "xattn.jax", "ffpa_attn native"), ("torch sdpa",)):
            for causal in (False, True):
                for p in ("fwd", "fwd+bwd"):
                    rows += [(m, 512, 32, 4, 8192, causal, p) for m in methods]
    elif part == "peak":
        rows.append(("torch bf16 matmul 8192^3", 0, 0, 0, 8192, False, "matmul"))
    else:
        raise ValueError(f"--part: unknown {part!r}")
    return rows


def flops(b, hq, nq, nk, d, causal, pass_, window=None):
    if window is not None:
        pairs = sum(min(i + 1, window) for i in range(nq))
    else:
        pairs = nq * nk * (0.5 if causal else 1.0)
    return 4 * b * hq * pairs * d * (3.5 if pass_ == "fwd+bwd" else 1.0)


# --- timing -----------------------------------------------------------------------------------

def time_torch(fn) -> float:
    import torch
    from triton.testing import do_bench

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t0
    if once > 1.5:
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def host_ms(fn) -> float:
    """Wall time per call of an enqueue loop (the core suite's measure), in ms."""
    from benchmarks.bench import host_us_per_call

    return host_us_per_call(fn) / 1e3


def wall_loop_ms(call, wait) -> float:
    """Median wall time per call (ms) of back-to-back ``call()``s, ``wait(last result)`` once per
    round, after warm-up; the JAX stopwatch (``time_jax``), also used on torch by the timing probe."""
    wait(call())
    t0 = time.perf_counter()
    wait(call())
    once = time.perf_counter() - t0
    reps = 3 if once > 1.5 else max(5, min(200, int(0.3 / max(once, 1e-6))))
    ts = []
    for _ in range(5 if reps > 3 else 1):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = call()
        wait(out)
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts) * 1e3


def time_jax(fn, *args) -> float:
    import jax

    return wall_loop_ms(lambda: fn(*args), jax.block_until_ready)


# --- the methods ------------------------------------------------------------------------------

def _torch_inputs(d, hq, hkv, n, b=1):
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda h: torch.randn(b, n, h, d, device="cuda", dtype=getattr(torch, DTYPE), generator=g)  # noqa: E731
    return mk(hq), mk(hkv), mk(hkv)


def torch_callable(method, d, hq, hkv, n, causal, pass_):
    import torch

    q, k, v = _torch_inputs(d, hq, hkv, n)
    scale = 1 / math.sqrt(d)
    window = 1024 if causal == "window1024" else None
    causal_flag = causal is True or window is not None
    if method in ("xattn.torch", "xattn.torch fa4 local"):
        import xattn.torch as xt

        fam = "ffpa" if d > 256 else "fa4"
        ws = (window - 1, 0) if window else (None, None)
        f = lambda q, k, v: xt.attention(q, k, v, softmax_scale=scale, causal=causal_flag and not window,  # noqa: E731
                                         window_size=ws, family=fam)
    elif method == "ffpa_attn native":
        from ffpa_attn import ffpa_attn_func

        f = lambda q, k, v: ffpa_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # noqa: E731
                                           is_causal=causal_flag, scale=scale, enable_gqa=hq != hkv, backend="cutedsl")
    elif method == "flash_attn.cute native":
        from flash_attn.cute import flash_attn_func

        f = lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal_flag)[0]  # noqa: E731
    elif method == "torch sdpa":
        f = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal_flag, scale=scale,
            enable_gqa=hq != hkv)
    elif method == "xattn HF ffpa_attention_forward":
        from xattn.torch.ffpa_attention import ffpa_attention_forward

        module = torch.nn.Module()
        module.is_causal = causal_flag
        # what HF hands over: [B, H, N, D] views of [B, N, H, D] projections; returns [B, N, H, D]
        f = lambda q, k, v: ffpa_attention_forward(module, q.transpose(1, 2), k.transpose(1, 2),  # noqa: E731
                                                   v.transpose(1, 2), None, scaling=scale)[0]
    elif method == "torch flex attention":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j < window), None, None, n, n)
        flex = torch.compile(flex_attention)
        f = lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask,  # noqa: E731
                                 scale=scale, enable_gqa=hq != hkv)
    else:
        raise ValueError(method)
    if pass_ == "fwd":
        return lambda: f(q, k, v)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = f(qg, kg, vg)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), dout)


def jax_callable(method, d, hq, hkv, n, causal, pass_):
    import jax
    import jax.numpy as jnp

    import xattn.jax as xj

    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (1, n, hq, d), jnp.dtype(DTYPE))
    k, v = (jax.random.normal(kk, (1, n, hkv, d), jnp.dtype(DTYPE)) for kk in ks[1:])
    scale = 1 / math.sqrt(d)
    if method == "xattn.jax":
        fn = xj.ffpa_attention if d > 256 else xj.flash_attention
        f = lambda q, k, v: fn(q, k, v, scale=scale, causal=causal, backend="kernel")  # noqa: E731
    elif method in ("jax xla", "jax cudnn"):
        impl = method.split()[1]
        f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,  # noqa: E731
                                                         implementation=impl)
    else:
        raise ValueError(method)
    if pass_ == "fwd":
        return jax.jit(f), (q, k, v)
    g = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return g, (q, k, v)


def varlen_callable(method, d, hq, hkv, n, pass_):
    """Packed uneven documents (lengths 1/8, 3/8, 1/16, ... of N), causal per document."""
    lens = [n // f for f in (8, 3, 16, 5)]  # uneven documents: 1/8, 1/3, 1/16, 1/5 and the rest of n
    lens.append(n - sum(lens))
    assert min(lens) > 0 and sum(lens) == n, lens  # cu_seqlens past the buffer would read out of bounds
    scale = 1 / math.sqrt(d)
    fam = "ffpa" if d > 256 else "fa4"
    if method == "xattn.torch varlen":
        import torch

        import xattn.torch as xt

        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        q, k, v = (t[0] for t in _torch_inputs(d, hq, hkv, n))
        f = lambda q, k, v: xt.attention(q, k, v, softmax_scale=scale, causal=True, cu_seqlens_q=cu,  # noqa: E731
                                         cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), family=fam)
        if pass_ == "fwd":
            return "torch", lambda: f(q, k, v), lens
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        dout = torch.randn_like(qg[..., : v.shape[-1]])
        return "torch", lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), dout), lens
    import jax
    import jax.numpy as jnp
    import numpy as np

    import xattn.jax as xj

    cu = jnp.array(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (n, hq, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (n, hkv, d), jnp.bfloat16) for kk in ks[1:])
    f = lambda q, k, v: xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens),  # noqa: E731
                                            family=fam, scale=scale, causal=True, backend="kernel")
    if pass_ == "fwd":
        return "jax", (jax.jit(f), (q, k, v)), lens
    g = jax.jit(jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    return "jax", (g, (q, k, v)), lens


def empty_row(method, d, hq, hkv, n, causal, pass_, device, status):
    """A result row in the core suite's form, not yet timed."""
    return dict(method=method, head_dim=d, causal=causal, batch=1, heads_q=hq, heads_kv=hkv, seqlen=n,
                dtype="bfloat16" if pass_ == "matmul" else DTYPE, varlen="varlen" in method, **{"pass": pass_},
                ms=None, tflops=None, device=device, status=status)


def run_row(method, d, hq, hkv, n, causal, pass_, device):
    row = empty_row(method, d, hq, hkv, n, causal, pass_, device, "ok")
    try:
        if pass_ == "matmul":
            import torch

            a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
            ms = time_torch(lambda: a @ a)
            row.update(ms=round(ms, 4), tflops=round(2 * n ** 3 / ms / 1e9, 1))
            return row
        if "varlen" in method:
            kind, fn, lens = varlen_callable(method, d, hq, hkv, n, pass_)
            ms = time_torch(fn) if kind == "torch" else time_jax(fn[0], *fn[1])
            fl = sum(flops(1, hq, L, L, d, True, pass_) for L in lens)
        elif method.startswith(("xattn.jax", "jax ")):
            fn, args = jax_callable(method, d, hq, hkv, n, causal, pass_)
            ms = time_jax(fn, *args)
            fl = flops(1, hq, n, n, d, causal, pass_)
        else:
            fn = torch_callable(method, d, hq, hkv, n, causal, pass_)
            ms = host_ms(fn) if n <= 128 else time_torch(fn)
            fl = flops(1, hq, n, n, d, causal is True, pass_, window=1024 if causal == "window1024" else None)
        row.update(ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1))
        if n <= 128:  # the host part: wall time per call of an enqueue loop (JAX: dispatch loop)
            row.update(us_per_call=round(ms * 1e3, 1), tflops=None)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded, none hidden
        text = f"{type(exc).__name__}: {exc}"
        low = text.lower()
        row["status"] = "oom" if ("out of memory" in low or "resource_exhausted" in low) else \
            ("refused: " if method == "jax cudnn" else "error: ") + text.splitlines()[0][:200]
    finally:
        _free()
    return row


def _key(r):
    return (r["method"], r["head_dim"], r["heads_q"], r["heads_kv"], r["seqlen"], r["causal"], r["pass"])


def _free():
    import gc

    gc.collect()
    try:
        import torch

        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="d512",
                    choices=["d512", "small", "hf", "sliding", "varlen", "host", "peak", "fp16"])
    ap.add_argument("--out", default="benchmarks/results/full.json")
    ap.add_argument("--append", action="store_true", help="merge into an existing --out file")
    ap.add_argument("--redo", action="store_true", help="with --append: drop this part's earlier rows, measure anew")
    ap.add_argument("--dry-run", action="store_true", help="print the planned rows and exit (no GPU)")
    args = ap.parse_args(argv)
    global DTYPE
    DTYPE = "float16" if args.part == "fp16" else "bfloat16"
    rows = plan(args.part)
    if args.part != "peak":  # the % of peak is against a matmul measured in the same run
        rows = plan("peak") + rows
    if args.dry_run:
        for r in rows:
            print(r)
        print(f"{len(rows)} rows in part {args.part}")
        return
    import torch

    from xattn.core.spec import library_versions

    device = torch.cuda.get_device_name()
    versions = ", ".join(f"{k} {v}" for k, v in library_versions()) + f", torch {torch.__version__}"
    try:
        import jax

        versions += f", jax {jax.__version__}"
    except ImportError:
        pass
    done = []
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            done = json.load(f)
        if args.redo:
            done = [r for r in done if r.get("part") != args.part]
    measured = {_key(r) for r in done
                if r.get("status") == "ok" and r["pass"] != "matmul" and r.get("part") == args.part}
    slow = {}  # series -> ms of its last N; a series past SLOW_MS skips its larger N (4x the work each)
    for i, spec in enumerate(rows, 1):
        method, d, hq, hkv, n, causal, pass_ = spec
        if pass_ != "matmul" and (method, d, hq, hkv, n, causal, pass_) in measured:
            continue  # resumed run: already measured by an earlier call
        series = (method, d, hq, hkv, causal, pass_)
        if slow.get(series, 0) > SLOW_MS:
            row = empty_row(*spec, device, f"skipped: N={n // 2} took {slow[series] / 1e3:.1f} s per call")
        else:
            row = run_row(*spec, device)
            if row["ms"] is not None:
                slow[series] = row["ms"]
        row.update(part=args.part, versions=versions, date=time.strftime("%Y-%m-%d"))
        done.append(row)
        print(f"[{i}/{len(rows)}] {row['method']:28s} d{row['head_dim']} {row['heads_q']}/{row['heads_kv']} "
              f"N{row['seqlen']} causal={row['causal']} {row['pass']:8s} {row['ms']} ms {row['tflops']} TFLOP/s "
              f"{row['status']}", file=sys.stderr, flush=True)
        with open(args.out, "w") as f:  # after every row: a killed run keeps what it measured
            json.dump(done, f, indent=1)


if __name__ == "__main__":
    main()
