"""Where the host time of one call goes (GPU machine): per-step microbenchmarks, core and torch layer.

Each step runs 5000 times back to back (no sync inside the loop), then once more with a sync per
call; ``gpu`` is the CUDA-event time of the kernel alone, so a loop bound by the GPU shows up."""
import time

import torch
import tvm_ffi
from host_cost import gpu_us  # this folder is on sys.path when the probe runs as a script

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
    "check_attention fwd": lambda: checks.check_attention("fa4", "fwd", dict(q=q, k=k, v=v, out=o, lse=lse),
                                                          causal=False),
    "quick_check fwd": lambda: checks.quick_check("fa4", "fwd", dict(q=q, k=k, v=v, out=o, lse=lse), False, None, None,
                                                  None, None, (None, None)),
    "launcher(torch x5)": lambda: launcher.function(q, k, v, o, lse, 0.1),
    "launcher(tvm x5)": lambda: launcher.function(t, t, t, t, tvm_ffi.from_dlpack(lse), 0.1),
    "fa4_fwd full": lambda: xc.fa4_fwd(q, k, v, o, lse, softmax_scale=0.1),
}
import xattn.torch as xt  # noqa: E402
from xattn.torch import ops  # noqa: E402

q5 = torch.randn(1, 128, 8, 512, device="cuda", dtype=torch.bfloat16)
o5, lse5 = q5.clone(), torch.empty(1, 8, 128, device="cuda")
steps.update({
    "torch.empty out+lse": lambda: (torch.empty_like(q), torch.empty(1, 8, 128, device="cuda")),
    "torch.full lse -inf": lambda: torch.full((1, 8, 128), float("-inf"), device="cuda"),
    "ops._checked (cached)": lambda: ops._checked("fwd", "fa4", q, k, v, False, -1, -1),
    "xt.attention d128 (eager)": lambda: xt.attention(q, k, v, softmax_scale=0.1),
    "torch.ops.xattn.fwd d128": lambda: torch.ops.xattn.fwd(q, k, v, "fa4", 0.1, False, -1, -1, None, None, 0, 0),
    "ffpa_fwd full d512": lambda: xc.ffpa_fwd(q5, q5, q5, o5, lse5, softmax_scale=0.1),
    "xt.attention d512 (eager)": lambda: xt.attention(q5, q5, q5, softmax_scale=0.1),
})


def synced_us(fn, n=500):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


print(f"{'step':32s} {'loop':>9s} {'synced':>9s}", flush=True)
for name, fn in steps.items():
    print(f"{name:32s} {per_call_us(fn):7.2f} us {synced_us(fn):7.2f} us", flush=True)
print(f"kernel stream time fa4 d128: {gpu_us(lambda: launcher.function(q, k, v, o, lse, 0.1)):.2f} us; "
      f"ffpa d512: {gpu_us(lambda: xc.ffpa_fwd(q5, q5, q5, o5, lse5, softmax_scale=0.1)):.2f} us")
