"""The layouts of torch's packed d512 GEMM backward, A/B on the same out/lse (H200): documents grouped into
dense batches (``gemm_backward_varlen``) vs row blocks across documents (``gemm_backward_segments``), and
for documents of one length views of one dense batch (``gemm_backward_equal_documents``); the backward
alone, with the host time of one call. The rule of
:func:`xattn.core.routes.packed_layout` comes from these rows.

    python benchmarks/tools/packed_layouts.py [--docs 2048,4096,8192,16384,mix16k,mix64k] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_and_host_ms  # noqa: E402
from benchmarks.packed import D, DEFAULT_DOCS, HKV, HQ, causal_flops, documents  # noqa: E402


def main(argv=None):
    import xattn.torch.ops as ops
    from xattn.core import routes
    from xattn.torch.gemm_bwd import gemm_backward_equal_documents, gemm_backward_varlen
    from xattn.torch.gemm_bwd_segments import gemm_backward_segments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default=DEFAULT_DOCS)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows, scale = [], D ** -0.5
    for spec in args.docs.split(","):
        lens = documents(spec)
        t, mx = sum(lens), max(lens)
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(t, HQ, D), mk(t, HKV, D), mk(t, HKV, D), mk(t, HQ, D)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out, lse = ops.fwd(q, k, v, "ffpa", scale, True, -1, -1, cu, cu, mx, mx)
        runs = {
            "groups": lambda: gemm_backward_varlen(dout, q, k, v, out, lse, lens, lens, softmax_scale=scale,
                                                   causal=True),
            "segments": lambda: gemm_backward_segments(dout, q, k, v, out, lse, lens, softmax_scale=scale,
                                                       causal=True),
        }
        equal = routes.equal_documents(lens, lens)
        if equal is not None:  # the "dense" layout: views of one dense batch
            runs["dense"] = lambda: gemm_backward_equal_documents(dout, q, k, v, out, lse, *equal, softmax_scale=scale,
                                                                  causal=True)
        bwd_flops = causal_flops(lens) / 3.5 * 2.5
        row = dict(docs=spec, num_docs=len(lens), total_tokens=t, heads_q=HQ, heads_kv=HKV, head_dim=D,
                   causal=True, dtype="bfloat16", rule=routes.packed_layout(lens, lens, HQ),
                   device=torch.cuda.get_device_name())
        grads = {}
        for name, run in runs.items():
            grads[name] = run()
            ms, host = bench_and_host_ms(run)
            row[f"{name}_bwd_ms"] = round(ms, 3)
            row[f"{name}_bwd_tflops"] = round(bwd_flops / ms / 1e9, 1)
            row[f"{name}_host_ms"] = round(host, 2)
        row["max_abs_diff"] = max((a.float() - b.float()).abs().max().item()
                                  for name in grads for a, b in zip(grads["groups"], grads[name]))
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("| documents | dense views bwd TFLOP/s | groups | segments | host ms (dense / groups / segments) | rule |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['docs']} ({r['num_docs']}) | {r.get('dense_bwd_tflops', '-')} | {r['groups_bwd_tflops']} | "
              f"{r['segments_bwd_tflops']} | {r.get('dense_host_ms', '-')} / {r['groups_host_ms']} / "
              f"{r['segments_host_ms']} | {r['rule']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(benchmark="packed_layouts", rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
