"""Where JAX on 2 GPUs of one process stops (GPU machine). Each case runs in its own process with a
timeout; a case that hangs gets every thread's Python stack (faulthandler) and, where py-spy is
available (``--py-spy PATH``), its native stacks, then the next case runs.

    python benchmarks/tools/jax_two_gpu_probe.py [--timeout 60] [--py-spy PATH] [--repeat N] [CASE ...]

Cases (default: all, in this order): see ``CASES``. A case name ending in ``-captured`` runs the case
with the xattn targets command-buffer compatible on 2 GPUs (as before the fix in
``xattn.jax._ffi.capture_allowed``); ``-nocmdbuf`` runs it with that too, but XLA's command buffers
off (``--xla_gpu_enable_command_buffer=``). Where gdb is on the machine, a hung case also gets every
native thread's stack.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CASES = {
    "dev1-bwd": "grad of flash_attention d128 GQA 4 on arrays committed to GPU 1 (one device)",
    "dev1-fwd-ffpa-causal": "FFPA causal forward (aliased pre-filled outputs) on GPU 1 (one device)",
    "batch-fwd-ffpa-causal": "batch-sharded shard_map of the FFPA causal forward (aliased) on 2 GPUs",
    "batch-bwd-g1": "batch-sharded grad of flash_attention d128 GQA 1 (backward not aliased) on 2 GPUs",
    "batch-bwd": "batch-sharded grad of flash_attention d128 GQA 4 (backward aliased) on 2 GPUs",
    "batch-alias-noop": "batch-sharded aliased ffi_call of a Python no-op TVM-FFI function on 2 GPUs",
    "batch-bwd-eager": "batch-bwd with CUDA_MODULE_LOADING=EAGER",
    "batch-bwd-prewarm": "batch-bwd after running the backward once on each GPU alone",
    "batch-bwd-g1-captured": "batch-bwd-g1 with the targets command-buffer compatible (as before the fix)",
    "batch-bwd-g1-nocmdbuf": "batch-bwd-g1-captured with XLA's command buffers off",
    "batch-bwd-captured": "batch-bwd with the targets command-buffer compatible (as before the fix)",
}


def case(name: str) -> None:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xattn.jax as xj

    if name.endswith(("-captured", "-nocmdbuf")):
        from xattn.jax import _ffi

        _ffi.capture_allowed = lambda platform="gpu": platform == "gpu"  # the behaviour before the fix
        name = name.rsplit("-", 1)[0]
    d0, d1 = jax.devices()[:2]
    mesh = jax.sharding.Mesh(np.array([d0, d1]), ("x",))

    def qkv(d, hq, hkv, n=512):
        ks = jax.random.split(jax.random.PRNGKey(1), 3)
        return [jax.random.normal(kk, (2, n, h, d), jnp.bfloat16) for kk, h in zip(ks, (hq, hkv, hkv))]

    def total(tree):
        return float(sum(jnp.abs(o.astype(jnp.float32)).sum() for o in jax.tree.leaves(tree)))

    def grad_of(fn):
        return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))

    fa4 = lambda q, k, v: xj.flash_attention(q, k, v, causal=True)  # noqa: E731
    ffpa = lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True)  # noqa: E731

    def single(fn, device, args):
        return total(jax.jit(fn)(*[jax.device_put(a, device) for a in args]))

    def batch(fn, args):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x"))
        return total(jax.jit(sharded)(*[jax.device_put(a, NamedSharding(mesh, P("x"))) for a in args]))

    def report(label, value):
        print(f"probe: {name}: {label} = {value}", flush=True)

    if name == "dev1-bwd":
        report("gpu0", single(grad_of(fa4), d0, qkv(128, 8, 2)))
        report("gpu1", single(grad_of(fa4), d1, qkv(128, 8, 2)))
    elif name == "dev1-fwd-ffpa-causal":
        report("gpu0", single(ffpa, d0, qkv(512, 8, 1)))
        report("gpu1", single(ffpa, d1, qkv(512, 8, 1)))
    elif name == "batch-fwd-ffpa-causal":
        report("1 gpu", single(ffpa, d0, qkv(512, 8, 1)))
        report("2 gpus", batch(ffpa, qkv(512, 8, 1)))
    elif name == "batch-bwd-g1":
        report("2 gpus", batch(grad_of(fa4), qkv(128, 8, 8)))
    elif name in ("batch-bwd", "batch-bwd-eager"):
        report("2 gpus", batch(grad_of(fa4), qkv(128, 8, 2)))
    elif name == "batch-bwd-prewarm":
        report("gpu0", single(grad_of(fa4), d0, qkv(128, 8, 2)))
        report("gpu1", single(grad_of(fa4), d1, qkv(128, 8, 2)))
        report("2 gpus", batch(grad_of(fa4), qkv(128, 8, 2)))
    elif name == "batch-alias-noop":
        import jax_tvm_ffi
        import tvm_ffi

        calls = []
        jax_tvm_ffi.register_ffi_target("xattn_probe_noop", tvm_ffi.convert(lambda *a: calls.append(len(a))),
                                        arg_spec=["args"], platform="gpu", pass_owned_tensor=True)

        def noop(x):
            buf = jnp.zeros_like(x)
            return jax.ffi.ffi_call("xattn_probe_noop", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    input_output_aliases={1: 0})(x, buf)
        sharded = jax.shard_map(noop, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
        x = jax.device_put(qkv(128, 8, 8)[0], NamedSharding(mesh, P("x")))
        report("2 gpus", (total(jax.jit(sharded)(x)), calls))
    else:
        raise SystemExit(f"unknown case {name}")


def _dump(cmd: list[str], timeout: float) -> None:
    """Run a stack dumper; one that hangs itself is cut off, and the probe goes on."""
    try:
        subprocess.run(cmd, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError) as exc:
        print(f"probe: {cmd[0]} gave no dump ({type(exc).__name__})", flush=True)


def run_case(name: str, timeout: float, py_spy: str | None) -> str:
    env = dict(os.environ)
    if name == "batch-bwd-eager":
        env["CUDA_MODULE_LOADING"] = "EAGER"
    if name.endswith("-nocmdbuf"):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--case", name, "--timeout", str(timeout)], env=env)
    try:
        rc = proc.wait(timeout=timeout)
        status = "ok" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
        status = "HANG"
        if py_spy:
            _dump([py_spy, "dump", "--native", "--pid", str(proc.pid)], 60)
        if shutil.which("gdb"):  # the XLA threads run no Python: only gdb shows where they wait
            _dump(["gdb", "-p", str(proc.pid), "-batch", "-ex", "thread apply all bt 25"], 45)
        proc.kill()
        proc.wait()
    line = f"probe-case {name}: {status} in {time.perf_counter() - t0:.1f} s ({CASES[name]})"
    print(line, flush=True)
    return line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="*", default=list(CASES))
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--py-spy", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="run every case this many times (fresh processes)")
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        # A little before the parent gives up, print every Python thread's stack (stays in the log).
        faulthandler.dump_traceback_later(max(args.timeout - 10, 5), exit=False)
        return case(args.case)
    lines = [run_case(name, args.timeout, args.py_spy) for name in args.cases for _ in range(args.repeat)]
    print("\n".join(["=== probe summary ===", *lines]), flush=True)


if __name__ == "__main__":
    main()
