"""Where a packed d512 call's time goes vs the same documents as a dense batch (H200): CUDA time per
kernel and wall time per call of the backward alone (``--passes bwd``, the custom op ``xattn::bwd``), the
forward alone (``fwd``, ``xattn::fwd``) or forward + backward through autograd (``fwd+bwd``,
``xattn.torch.attention(...).backward``, as ``benchmarks/packed.py`` times it).

    python benchmarks/tools/packed_profile.py [--docs 2048,mix16k] [--passes bwd,fwd,fwd+bwd]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.bench import bench_and_host_ms, cuda_profile  # noqa: E402
from benchmarks.packed import D, HKV, HQ, causal_flops, documents  # noqa: E402


def train_step(attention, leaves, dout, kwargs) -> None:
    """One causal forward + backward into fresh ``.grad`` of ``leaves`` (q, k, v), as benchmarks/packed.py."""
    for x in leaves:
        x.grad = None
    attention(*leaves, causal=True, **kwargs).backward(dout)


def main(argv=None):
    import xattn.torch as xt
    import xattn.torch.ops as ops

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default="2048,mix16k")
    ap.add_argument("--passes", default="bwd", help="comma list of bwd, fwd, fwd+bwd")
    args = ap.parse_args(argv)
    for spec, pass_ in ((s, p) for s in args.docs.split(",") for p in args.passes.split(",")):
        lens = documents(spec)
        t, mx = sum(lens), max(lens)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
        q, k, v, dout = mk(t, HQ, D), mk(t, HKV, D), mk(t, HKV, D), mk(t, HQ, D)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        out, lse = ops.fwd(q, k, v, "ffpa", D ** -0.5, True, -1, -1, cu, cu, mx, mx)
        scale, packed = D ** -0.5, (cu, cu, mx, mx)
        pieces = {"varlen": ((dout, q, k, v, out, lse), packed)}
        if len(set(lens)) == 1:
            b, n = len(lens), lens[0]
            lse_d = lse.view(HQ, b, n).transpose(0, 1).contiguous()
            pieces["dense"] = ([x.view(b, n, *x.shape[1:]) for x in (dout, q, k, v, out)] + [lse_d],
                               (None, None, 0, 0))
        runs = {}
        for name, ((do, q_, k_, v_, o_, l_), lens_args) in pieces.items():
            if pass_ == "bwd":
                runs[name] = lambda a=(do, q_, k_, v_, o_, l_), c=lens_args: ops.bwd(
                    *a, "ffpa", scale, True, -1, -1, *c)
            elif pass_ == "fwd":
                runs[name] = lambda a=(q_, k_, v_), c=lens_args: ops.fwd(*a, "ffpa", scale, True, -1, -1, *c)
            elif pass_ == "fwd+bwd":
                leaves = [x.detach().clone().requires_grad_() for x in (q_, k_, v_)]
                kw = {} if name == "dense" else dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx,
                                                     max_seqlen_k=mx)
                runs[name] = lambda a=leaves, d_=do, kw=kw: train_step(xt.attention, a, d_, kw)
            else:
                ap.error(f"--passes: {pass_!r} is not bwd, fwd or fwd+bwd")
        f = causal_flops(lens) * {"bwd": 2.5, "fwd": 1.0, "fwd+bwd": 3.5}[pass_] / 3.5
        for name, run in runs.items():
            prof = cuda_profile(run, 3)
            print(f"=== {spec} {name} ({len(lens)} documents): CUDA time of 3 calls, {pass_} ===")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=16, max_name_column_width=60))
            ms, host = bench_and_host_ms(run)
            print(f"{spec} {name}: {pass_} {ms:.3f} ms ({f / ms / 1e9:.0f} TFLOP/s), host {host:.2f} ms per call",
                  flush=True)


if __name__ == "__main__":
    main()
