"""#12 item 7, JAX on the GPU: the xattn targets are command-buffer compatible, so XLA may capture them
into CUDA graphs with the ops around them; the results are the bits of the uncaptured run, and the
backward's uninitialised workspace (``lax.empty``) changes nothing."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = r"""
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
import xattn.jax as xj
fn = {"ffpa": xj.ffpa_attention, "fa4": xj.flash_attention}[sys.argv[1]]
d, g = int(sys.argv[2]), int(sys.argv[3])
ks = jax.random.split(jax.random.PRNGKey(0), 4)
q = jax.random.normal(ks[0], (2, 333, 2 * g, d), jnp.bfloat16)
k, v = (jax.random.normal(kk, (2, 397, 2, d), jnp.bfloat16) for kk in ks[1:3])
def step(q, k, v):  # small ops around the kernels, so a command buffer has something to hold
    loss = lambda q, k, v: (fn(q * 1.0, k + 0.0, v, causal=True).astype(jnp.float32) ** 2).sum()
    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
f = jax.jit(step)
text = f.lower(q, k, v).compile().as_text()
res = [f(q, k, v) for _ in range(3)]  # the first run records, later ones replay
leaves = [np.asarray(x, np.float32) for x in jax.tree.leaves(res[-1])]
same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
           for r in res[:-1] for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(res[-1])))
np.save(sys.argv[4], np.concatenate([x.ravel() for x in leaves]))
print("RESULT " + json.dumps(dict(sums=[float(np.abs(x).sum()) for x in leaves],
                                  finite=all(np.isfinite(x).all() for x in leaves),
      repeat_same=same, command_buffer="command_buffer" in text and "xattn" in text,
      hashes=[hashlib.sha256(x.tobytes()).hexdigest() for x in leaves])))
"""


def _run(args, flags, path):
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_FLAGS=flags,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD, *map(str, args), str(path)], capture_output=True, text=True,
                          env=env,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][7:])


@pytest.mark.parametrize("args", [("ffpa", 512, 4), ("fa4", 128, 4)], ids=["ffpa-d512-gqa4", "fa4-d128-gqa4"])
def test_command_buffers_give_the_uncaptured_results(args, tmp_path):
    """FFPA (deterministic end to end): the same bits. FA4: its backward reduce-adds in fp32 in any block
    order (xattn.core.determinism), so loss bits must match and gradients agree to fp32-sum noise."""
    import numpy as np

    captured = _run(args, "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1",
                    tmp_path / "captured.npy")
    plain = _run(args, "--xla_gpu_enable_command_buffer=", tmp_path / "plain.npy")
    print(args, "command buffer seen in the compiled HLO:", captured["command_buffer"], captured["sums"])
    assert captured["finite"] and plain["finite"]
    if args[0] == "ffpa":
        assert captured["repeat_same"] and captured["hashes"] == plain["hashes"], (captured["sums"], plain["sums"])
    else:
        a, b = np.load(tmp_path / "captured.npy"), np.load(tmp_path / "plain.npy")
        assert captured["hashes"][0] == plain["hashes"][0]  # the loss: forward bits
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()
