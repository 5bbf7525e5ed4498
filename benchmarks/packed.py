"""Packed (varlen) d512 training vs the same documents unpacked (issue #23).

    python benchmarks/packed.py [--frameworks torch,jax] [--docs 2048,4096,8192,16384,mix16k,mix64k]
        [--out benchmarks/results/packed_h200.json]

Gemma 4 global-layer dims (Hq32/Hkv4, D512, causal, bf16). A row is a set of documents:
``2048`` = 16k tokens cut into 2k documents, ``mixNk`` = N·1024 tokens of lengths drawn
log-uniformly from 64..8192 (seeded; the last one cut to fit). Per row:

- ``varlen_tflops``: fwd+bwd of the packed batch (torch: ``xattn.torch.attention(..., cu_seqlens_*)``
  with ``backward()``; JAX: ``xattn.jax.varlen_attention`` under ``jit(grad)``), default routes;
  ``varlen_ffpa_tflops``: the same with ``XATTN_BWD_ROUTE=ffpa`` (FFPA's fused varlen backward);
  JAX also ``varlen_gemm_tflops``: ``XATTN_BWD_ROUTE=gemm``, the GEMM route taken without the
  device-side ``lax.cond`` that picks it under ``auto`` (the difference is that choice's cost);
- ``dense_tflops``: the same documents unpacked: equal documents as one dense ``[B, n, H, D]`` batch,
  a mix as one dense call per document (all of them in one timed function);
- ``ratio = varlen_tflops / dense_tflops``.

TFLOP/s count each document's causal FLOPs (FlashAttention's convention: ``4·Hq·n²·D/2`` forward,
3.5x for fwd+bwd). Timing: ``triton.testing.do_bench`` medians (torch), the wall loop of
benchmarks/full.py (JAX).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HQ, HKV, D = 32, 4, 512
DEFAULT_DOCS = "2048,4096,8192,16384,mix16k,mix64k"


def log(msg: str) -> None:
    print(f"[packed {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def documents(spec: str, total: int = 16384, seed: int = 0) -> list[int]:
    """The document lengths of one row: ``"2048"`` -> 2048-token documents filling ``total``;
    ``"mix64k"`` -> 65536 tokens of log-uniform lengths in 64..8192."""
    if spec.startswith("mix"):
        total = int(spec[3:].rstrip("k")) * 1024
        rng, lens = random.Random(seed), []
        while sum(lens) < total:
            lens.append(min(int(math.exp(rng.uniform(math.log(64), math.log(8192)))), total - sum(lens)))
        return lens
    n = int(spec)
    if n <= 0 or total % n:
        raise ValueError(f"--docs {spec}: a document length must divide {total}")
    return [n] * (total // n)


def causal_flops(lens) -> float:
    return sum(4 * HQ * n * n * D * 0.5 for n in lens) * 3.5


def torch_row(spec: str) -> dict:
    import torch

    import xattn.torch as xt
    from benchmarks.bench import bench_ms

    lens = documents(spec)
    t = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    q, k, v, dout = (mk(t, h, D).requires_grad_(h != HQ or i == 0) for i, h in enumerate((HQ, HKV, HKV, HQ)))
    dout = dout.detach()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")

    def varlen():
        q.grad = k.grad = v.grad = None
        xt.attention(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                     max_seqlen_k=max(lens)).backward(dout)

    if len(set(lens)) == 1:
        n, b = lens[0], len(lens)
        qd, kd, vd = (x.detach().view(b, n, *x.shape[1:]).clone().requires_grad_() for x in (q, k, v))
        dd = dout.view(b, n, HQ, D)
        calls = [(qd, kd, vd, dd)]
    else:
        calls, s = [], 0
        for n in lens:
            doc = (x.detach()[None, s:s + n].clone() for x in (q, k, v, dout))
            calls.append(tuple(x.requires_grad_(i < 3) for i, x in enumerate(doc)))
            s += n

    def dense():
        for qd, kd, vd, dd in calls:
            qd.grad = kd.grad = vd.grad = None
            xt.attention(qd, kd, vd, causal=True).backward(dd)

    f = causal_flops(lens)
    os.environ.pop("XATTN_BWD_ROUTE", None)
    t_var, t_dense = bench_ms(varlen), bench_ms(dense)
    os.environ["XATTN_BWD_ROUTE"] = "ffpa"
    t_ffpa = bench_ms(varlen)
    os.environ.pop("XATTN_BWD_ROUTE")
    return row("torch", spec, lens, f, t_var, t_ffpa, t_dense, torch.cuda.get_device_name())


def jax_row(spec: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import xattn.jax as xj
    from benchmarks.full import time_jax

    lens = documents(spec)
    t, mx = sum(lens), max(lens)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (t, HQ, D), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (t, HKV, D), jnp.bfloat16) for kk in ks[1:])
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    loss = lambda f: lambda *a: f(*a).astype(jnp.float32).sum()  # noqa: E731

    def packed(q, k, v, cu):
        return xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=mx, max_seqlen_k=mx, causal=True)

    grad_packed = lambda: jax.jit(jax.grad(loss(packed), argnums=(0, 1, 2)))  # noqa: E731

    def unpacked(q, k, v):
        outs, s = [], 0
        if len(set(lens)) == 1:
            shape = lambda x: x.reshape(len(lens), lens[0], *x.shape[1:])  # noqa: E731
            return xj.ffpa_attention(shape(q), shape(k), shape(v), causal=True)
        for n in lens:
            outs.append(xj.ffpa_attention(q[None, s:s + n], k[None, s:s + n], v[None, s:s + n], causal=True))
            s += n
        return jnp.concatenate([o[0] for o in outs])

    f = causal_flops(lens)
    os.environ.pop("XATTN_BWD_ROUTE", None)
    t_var = time_jax(grad_packed(), q, k, v, cu)
    t_dense = time_jax(jax.jit(jax.grad(loss(unpacked), argnums=(0, 1, 2))), q, k, v)
    os.environ["XATTN_BWD_ROUTE"] = "ffpa"
    t_ffpa = time_jax(grad_packed(), q, k, v, cu)
    os.environ["XATTN_BWD_ROUTE"] = "gemm"
    t_gemm = time_jax(grad_packed(), q, k, v, cu)
    os.environ.pop("XATTN_BWD_ROUTE")
    jax.clear_caches()
    out = row("jax", spec, lens, f, t_var, t_ffpa, t_dense, jax.devices()[0].device_kind)
    return {**out, "varlen_gemm_tflops": round(f / t_gemm / 1e9, 1)}


def row(framework, spec, lens, f, t_var, t_ffpa, t_dense, device) -> dict:
    tf = lambda ms: round(f / ms / 1e9, 1)  # noqa: E731
    return dict(framework=framework, doc_len="mix" if spec.startswith("mix") else int(spec), docs=spec,
                num_docs=len(lens), total_tokens=sum(lens), heads_q=HQ, heads_kv=HKV, head_dim=D, causal=True,
                dtype="bfloat16", varlen_ms=round(t_var, 3), varlen_tflops=tf(t_var), varlen_ffpa_tflops=tf(t_ffpa),
                dense_ms=round(t_dense, 3), dense_tflops=tf(t_dense), ratio=round(t_dense / t_var, 3), device=device)


def markdown(rows) -> str:
    lines = ["| framework | documents | tokens | varlen fwd+bwd | varlen, FFPA bwd | dense fwd+bwd | ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        docs = f"{r['num_docs']} × {r['doc_len']}" if r["doc_len"] != "mix" else f"mix of {r['num_docs']}"
        lines.append(f"| {r['framework']} | {docs} | {r['total_tokens']} | **{r['varlen_tflops']}** | "
                     f"{r['varlen_ffpa_tflops']} | {r['dense_tflops']} | {r['ratio']:.2f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frameworks", default="torch,jax")
    ap.add_argument("--docs", default=DEFAULT_DOCS, help="comma list: document lengths or mixNk")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for spec in args.docs.split(","):
        documents(spec)  # a bad spec fails before anything runs
    rows = json.load(open(args.out))["rows"] if args.out and os.path.exists(args.out) else []
    for framework in args.frameworks.split(","):
        if framework not in ("torch", "jax"):
            ap.error(f"--frameworks: expected torch and/or jax, got {framework!r}")
        for spec in args.docs.split(","):
            log(f"{framework} {spec}")
            r = (torch_row if framework == "torch" else jax_row)(spec)
            log(json.dumps(r))
            rows = [x for x in rows if (x["framework"], x["docs"]) != (framework, spec)] + [r]
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(benchmark="packed", rows=rows), f, indent=1)
    print(markdown(rows))


if __name__ == "__main__":
    main()
