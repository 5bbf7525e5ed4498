"""Cold vs warm start (GPU machine): the same d512 fwd+bwd in two fresh processes sharing one
empty disk cache. The first compiles (cold), the second loads (warm); both report their
kernel-preparation time and time to first result, and their outputs must be bit-identical.

    python benchmarks/cold_start.py [--out benchmarks/results/cold_start_h200.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t_start = time.perf_counter()
import torch
import xattn.core as xc
from xattn.core import cache
B, N, HQ, HKV, D = 1, 2048, 16, 4, 512
g = torch.Generator(device="cuda").manual_seed(1234)
q = torch.randn(B, N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
dout = torch.randn(B, N, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
torch.cuda.synchronize()
t0 = time.perf_counter()
out = torch.zeros_like(q); lse = torch.full((B, HQ, N), float("-inf"), device="cuda")
xc.ffpa_fwd(q, k, v, out, lse, softmax_scale=D ** -0.5, causal=True)
dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
ws = [torch.empty(s, device="cuda") for _, s, _, _ in xc.bwd_workspace("ffpa", q.shape, k.shape, causal=True)]
xc.ffpa_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=D ** -0.5, causal=True, workspace=ws)
torch.cuda.synchronize()
first = time.perf_counter() - t0
entries = [e for e in (cache._entries[s] for s in cache.cached_specs())]
torch.save(dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), sys.argv[1])
print(json.dumps(dict(prep_seconds=sum(e.seconds for e in entries), first_result_seconds=first,
                      process_seconds=time.perf_counter() - t_start, sources=[e.source for e in entries])))
"""


def run_child(cache_dir: str, out_path: str) -> dict:
    env = dict(os.environ, XATTN_CACHE_DIR=cache_dir)
    res = subprocess.run([sys.executable, "-c", CHILD, out_path], capture_output=True, text=True, env=env,
                         timeout=900)
    if res.returncode:
        raise RuntimeError(res.stderr[-4000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure() -> dict:
    """Cold then warm process on one fresh cache dir; returns both reports and the bit comparison."""
    import torch

    with tempfile.TemporaryDirectory(prefix="xattn-cold-") as tmp:
        cold = run_child(os.path.join(tmp, "cache"), os.path.join(tmp, "cold.pt"))
        warm = run_child(os.path.join(tmp, "cache"), os.path.join(tmp, "warm.pt"))
        a, b = torch.load(os.path.join(tmp, "cold.pt")), torch.load(os.path.join(tmp, "warm.pt"))
        same = {n: bool(torch.equal(a[n], b[n])) for n in a}
    return dict(cold=cold, warm=warm, bit_identical=same)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/cold_start.json")
    args = ap.parse_args(argv)
    import torch

    device = torch.cuda.get_device_name()
    r = measure()
    print(json.dumps(r, indent=1))
    rows = []
    for phase, label in (("cold", "xattn cold start (compile + export)"), ("warm", "xattn warm start (disk cache)")):
        rep = r[phase]
        rows.append(dict(method=label, head_dim=512, causal=True, batch=1, heads_q=16, heads_kv=4, seqlen=2048,
                         dtype="bfloat16", varlen=False, **{"pass": "fwd+bwd"},
                         ms=round(rep["first_result_seconds"] * 1e3, 1), tflops=None,
                         prep_seconds=round(rep["prep_seconds"], 3), sources=rep["sources"],
                         bit_identical_to_cold=all(r["bit_identical"].values()), device=device,
                         date=time.strftime("%Y-%m-%d")))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
