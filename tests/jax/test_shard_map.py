"""shard_map: the kernel path (NumPy stand-in on 2 virtual CPU devices) works in forward and grad
with batch and head sharding; results equal the unsharded reference. Runs in a subprocess
because the device count must be set before JAX starts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CODE = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import xattn.jax as xj
from xattn.jax import _ffi
from tests.jax import numpy_launcher
_ffi.set_launcher_provider(numpy_launcher.provider)
mesh = jax.make_mesh((2,), ("x",))
k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
q = jax.random.normal(k1, (4, 8, 4, 128), jnp.float16)
k = jax.random.normal(k2, (4, 8, 2, 128), jnp.float16)
v = jax.random.normal(k3, (4, 8, 2, 128), jnp.float16)
res = {}
for name, spec in (("batch", P("x")), ("heads", P(None, None, "x"))):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, spec))
    body = lambda q, k, v: xj.flash_attention(q, k, v, scale=0.1, causal=True, backend="kernel")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
    loss = lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(put(q), put(k), put(v))
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    ref_loss = lambda q, k, v: (xj.flash_attention(q, k, v, scale=0.1, causal=True, backend="reference") ** 2).sum()
    ref = jax.grad(ref_loss, argnums=(0, 1, 2))(*f32)
    want = xj.flash_attention(*f32, scale=0.1, causal=True, backend="reference")
    out_err = float(jnp.abs(f(put(q), put(k), put(v)).astype(jnp.float32) - want).max())
    grad_err = max(float(jnp.abs(a.astype(jnp.float32) - b).max() / (jnp.abs(b).max() + 1e-6))
                   for a, b in zip(grads, ref))
    res[name] = dict(out_err=out_err, grad_err=grad_err)
print(json.dumps(res))
"""


@pytest.mark.slow  # a 2-device subprocess: CI's second step
def test_shard_map_forward_and_grad():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")  # keeps tests/conftest.py's XLA -O0
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(CODE)], capture_output=True, text=True, env=env,
                       cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    for name, errs in res.items():
        assert errs["out_err"] < 5e-3 and errs["grad_err"] < 2e-2, (name, errs)
