"""Which piece of the split-KV route fails or is wrong on the GPU: the combine launcher alone on synthetic
partials, the split launch alone (partials vs fp64 per slot), then the whole route. Each step runs in its own
process (an illegal address ends a CUDA context) with CUDA_LAUNCH_BLOCKING=1.

    python benchmarks/tools/split_kv_probe.py [STEP]   # STEP: combine | splits | route (default: all three)
    python benchmarks/tools/split_kv_probe.py kernels  # CUDA time per kernel of one call (SPLIT_PROBE_SHAPES)

``kernels`` profiles the decode shapes ``SPLIT_PROBE_SHAPES`` (``d,hq,hkv,b,nq,nk,num_splits;...``, default the
d512 B1 32k q_len 1 and 4 rows and d128 B1 8k) with torch.profiler: 20 eager calls after a warm-up, the L2 cache
flushed before each (a 256 MiB write, left out of the table), the CUDA time of every kernel per call, to see where a
split call's time goes beside the split launch; ``SPLIT_PROBE_SDPA=1`` profiles torch SDPA's call of the same shape
too (HF's ``[B, H, N, D]`` layout, ``enable_gqa``; at q_len 1 no mask), kernel by kernel.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def combine(d=512, p=5, b=2, nq=3, hq=8):
    import torch

    from xattn.core.api import launch_combine
    from xattn.core.split_kv import CombineSpec
    out_p = torch.randn(p, b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    lse_p = torch.randn(p, b, hq, nq, device="cuda").permute(0, 1, 3, 2)
    lse_p[1] = float("-inf")
    out = torch.empty(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(b, hq, nq, device="cuda")
    launch_combine(CombineSpec("ffpa", "bfloat16", d), out_p, lse_p, out, lse.permute(0, 2, 1))
    torch.cuda.synchronize()
    total = torch.logsumexp(lse_p.double(), 0)
    ref = (torch.exp(lse_p.double() - total)[..., None] * out_p.double()).sum(0)
    print("combine: out err", (out.double() - ref).abs().max().item(), "lse err",
          (lse.permute(0, 2, 1).double() - total).abs().max().item(), flush=True)


def splits(d=512, b=1, nq=1, hq=32, hkv=4, nk=9000, s=4):
    import torch

    from xattn.core import split_kv
    from xattn.torch import ops, split_kv as tsk
    from tests.reference import varlen_attention
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    plan = split_kv.plan_splits(s, False, nq, nk)
    p = plan.partials
    kf, vf = tsk.flat_keys(k, nk * b), tsk.flat_keys(v, nk * b)
    q_split = q.unsqueeze(1).expand(b, p, nq, hq, d).reshape(b * p * nq, hq, d)
    setup = tsk._setup(plan, "ffpa", q_split, q, kf, vf, nk, nk)
    cu_q, cu_k = setup.cu_q, setup.cu_k
    print("cu_q", cu_q.tolist(), "cu_k", cu_k.tolist(), "max_k", setup.max_k, flush=True)
    out_p = torch.zeros((b * p * nq, hq, d), dtype=q.dtype, device=q.device)
    lse_p = torch.full((hq, b * p * nq), float("-inf"), device=q.device)
    ops.LAUNCH["fwd"](setup.checked, q_split, kf, vf, out_p, lse_p, softmax_scale=d ** -0.5, cu_seqlens_q=cu_q,
                      cu_seqlens_k=cu_k, max_seqlen_q=nq, max_seqlen_k=setup.max_k)
    torch.cuda.synchronize()
    ref_o, ref_l = varlen_attention(q_split, kf, vf, cu_q, cu_k, scale=d ** -0.5)
    print("splits: out err", (out_p.double() - ref_o).abs().max().item(), flush=True)


def route():
    import torch

    import xattn.torch as xt
    from tests.reference import attention
    q = torch.randn(1, 1, 32, 512, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 9000, 4, 512, device="cuda", dtype=torch.bfloat16)
    out = xt.attention(q, k, k, causal=True, num_splits=4)
    torch.cuda.synchronize()
    print("route: out err", (out.double() - attention(q, k, k, scale=512 ** -0.5)[0]).abs().max().item(), flush=True)


def kernels():
    import torch
    from torch.profiler import ProfilerActivity, profile

    import xattn.torch as xt
    import torch.nn.functional as F

    shapes = os.environ.get("SPLIT_PROBE_SHAPES", "512,32,4,1,1,32768,0;512,32,4,1,4,32768,0;128,32,8,1,1,8192,0")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for shape in shapes.split(";"):
        d, hq, hkv, b, nq, nk, splits = map(int, shape.split(","))
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        impls = {"xattn": lambda: xt.attention(q, k, v, causal=True, num_splits=splits)}
        if os.environ.get("SPLIT_PROBE_SDPA") == "1" and nq == 1:
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            impls["sdpa"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        for impl, call in impls.items():
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            calls = 20
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    flush.zero_()
                    call()
                torch.cuda.synchronize()
            rows = [(e.device_time_total / calls, e.count // calls, e.key) for e in prof.key_averages()
                    if e.device_time_total > 0 and e.count >= calls and "fill" not in e.key.lower()
                    and "memset" not in e.key.lower()]
            print(f"== {impl} d{d} Hq{hq}/Hkv{hkv} B{b} Nq{nq} Nk{nk} num_splits={splits}: "
                  f"{sum(r[0] for r in rows):.1f} us of kernels per call", flush=True)
            for us, n, name in sorted(rows, reverse=True):
                print(f"  {us:8.1f} us  x{n}  {name[:110]}", flush=True)

if __name__ == "__main__":
    steps = sys.argv[1:] or ["combine", "splits", "route"]
    if len(steps) == 1:
        globals()[steps[0]]()
    else:
        for step in steps:
            rc = subprocess.call([sys.executable, __file__, step], env=dict(os.environ, CUDA_LAUNCH_BLOCKING="1"))
            print(f"== {step}: rc {rc}", flush=True)
