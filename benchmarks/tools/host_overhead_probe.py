"""Where the host time of one core call goes (GPU machine): per-step microbenchmarks."""
import time

import torch
import tvm_ffi

import xattn.core as xc
from xattn.core import checks


def per_call_us(fn, n=5000):
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


q = torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16)
k, v, o = q.clone(), q.clone(), q.clone()
lse = torch.empty(1, 8, 128, device="cuda")
t = tvm_ffi.from_dlpack(q)
launcher = xc.get_launcher(xc.KernelSpec("fa4", "fwd", "bfloat16", 128, 128))
steps = {
    "from_dlpack(torch cuda) x1": lambda: tvm_ffi.from_dlpack(q),
    "t.dtype": lambda: t.dtype,
    "t.shape": lambda: t.shape,
    "t.strides": lambda: t.strides,
    "t.device": lambda: t.device,
    "t.data_ptr()": lambda: t.data_ptr(),
    "check_attention fwd": lambda: checks.check_attention("fa4", "fwd", dict(q=q, k=k, v=v, out=o, lse=lse), causal=False),
    "quick_check fwd": lambda: checks.quick_check("fa4", "fwd", dict(q=q, k=k, v=v, out=o, lse=lse), False, None, None, None, None, (None, None)),
    "launcher(torch x5)": lambda: launcher.function(q, k, v, o, lse, 0.1),
    "launcher(tvm x5)": lambda: launcher.function(t, t, t, t, tvm_ffi.from_dlpack(lse), 0.1),
    "fa4_fwd full": lambda: xc.fa4_fwd(q, k, v, o, lse, softmax_scale=0.1),
}
for name, fn in steps.items():
    print(f"{name:32s} {per_call_us(fn):7.2f} us", flush=True)
torch.cuda.synchronize()
