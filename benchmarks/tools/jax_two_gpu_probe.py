"""Where JAX on 2 GPUs stops (GPU machine): an xattn kernel on arrays committed to GPU 1, then a
batch-sharded shard_map, then the ring; each step prints as it ends, and a stuck step dumps every
thread's stack after --timeout seconds.

    python benchmarks/tools/jax_two_gpu_probe.py [--timeout 60]
"""

import argparse
import faulthandler
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--steps", default="basic", help="basic | bwd-batch | ring-more")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xattn.jax as xj

    def step(name, fn):
        faulthandler.dump_traceback_later(args.timeout, exit=True)
        t0 = time.perf_counter()
        out = fn()
        faulthandler.cancel_dump_traceback_later()
        print(f"probe: {name}: {out} ({time.perf_counter() - t0:.1f} s)", flush=True)

    d0, d1 = jax.devices()[:2]
    mesh = jax.sharding.Mesh([d0, d1], ("x",))
    if args.steps != "basic":
        return more(args.steps, step, mesh)
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(kk, (2, 512, 8, 128), jnp.bfloat16) for kk in ks)
    f = jax.jit(lambda q, k, v: xj.flash_attention(q, k, v, causal=True))
    on = lambda d: [jax.device_put(x, d) for x in (q, k, v)]  # noqa: E731
    step("gpu0", lambda: float(jnp.abs(f(*on(d0)).astype(jnp.float32)).sum()))
    step("gpu1", lambda: (float(jnp.abs(f(*on(d1)).astype(jnp.float32)).sum()), f(*on(d1)).devices()))
    step("gpu1 == gpu0 bits", lambda: bool((jax.device_get(f(*on(d1))) == jax.device_get(f(*on(d0)))).all()))
    put = lambda s: [jax.device_put(x, NamedSharding(mesh, s)) for x in (q, k, v)]  # noqa: E731
    body = lambda q, k, v: xj.flash_attention(q, k, v, causal=True)  # noqa: E731
    g = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    step("shard_map batch", lambda: float(jnp.abs(g(*put(P("x"))).astype(jnp.float32)).sum()))
    perm = jax.jit(jax.shard_map(lambda x: jax.lax.ppermute(x, "x", [(0, 1), (1, 0)]), mesh=mesh,
                                 in_specs=P(None, "x"), out_specs=P(None, "x")))
    step("ppermute", lambda: float(perm(put(P(None, "x"))[0]).astype(jnp.float32).sum()))
    ring = jax.jit(jax.shard_map(lambda q, k, v: xj.ring_attention(q, k, v, axis_name="x", causal=True), mesh=mesh,
                                 in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x")))
    step("ring fwd", lambda: float(jnp.abs(ring(*put(P(None, "x"))).astype(jnp.float32)).sum()))


def more(which, step, mesh):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xattn.jax as xj

    def qkv(d, hq, hkv, n):
        ks = jax.random.split(jax.random.PRNGKey(1), 3)
        return [jax.random.normal(kk, (2, n, h, d), jnp.bfloat16) for kk, h in zip(ks, (hq, hkv, hkv))]

    def run(fn, spec, args, grad):
        sharded = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        f = jax.grad(lambda *a: sharded(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if grad else sharded
        out = jax.jit(f)(*[jax.device_put(a, NamedSharding(mesh, spec)) for a in args])
        return float(sum(jnp.abs(o.astype(jnp.float32)).sum() for o in jax.tree.leaves(out)))

    fa4 = lambda q, k, v: xj.flash_attention(q, k, v, causal=True)  # noqa: E731
    ffpa = lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True)  # noqa: E731
    ring = lambda q, k, v: xj.ring_attention(q, k, v, axis_name="x", causal=True)  # noqa: E731
    if which == "bwd-batch":
        step("batch grad fa4 d128", lambda: run(fa4, P("x"), qkv(128, 8, 2, 512), True))
        step("batch fwd ffpa d512", lambda: run(ffpa, P("x"), qkv(512, 8, 1, 512), False))
        step("batch grad ffpa d512", lambda: run(ffpa, P("x"), qkv(512, 8, 1, 512), True))
    else:
        step("ring grad fa4 d128", lambda: run(ring, P(None, "x"), qkv(128, 8, 2, 512), True))
        step("ring fwd ffpa d512", lambda: run(ring, P(None, "x"), qkv(512, 8, 1, 512), False))
        step("ring grad ffpa d512", lambda: run(ring, P(None, "x"), qkv(512, 8, 1, 512), True))


if __name__ == "__main__":
    main()
