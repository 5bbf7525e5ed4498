"""JAX FA4 helpers keep the torch semantics: the on-device segment layout equals torch's
_varlen_segments, and document-causal attention equals an explicitly masked reference (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import xattn.jax as xj
from xattn.jax import _ffi
from xattn.jax.fa4 import varlen_segments
from xattn.torch.fa4 import _varlen_segments

from . import numpy_launcher

CASES = [([[1, 1, 1, 2, 2, 2, 2, 0]], 2, 4), ([[1, 1, 1, 2, 2, 2, 2, 0]], 8, 0),
         ([[5, 5, 5, 5], [1, 2, 2, 0]], 2, 2), ([[1, 1, 2, 2, 2, 3], [4, 4, 4, 4, 0, 0]], 3, 1)]


@pytest.mark.parametrize("ids, q_len, start", CASES)
def test_segments_match_torch(ids, q_len, start):
    q_lens, k_lens = _varlen_segments(torch.tensor(ids), q_len, start)
    cu_q, cu_k, overflow = jax.jit(varlen_segments, static_argnums=(1, 2, 3))(jnp.array(ids), q_len, start, 10)
    n = len(k_lens)
    assert np.diff(np.asarray(cu_k))[:n].tolist() == k_lens and np.diff(np.asarray(cu_q))[:n].tolist() == q_lens
    assert (np.diff(np.asarray(cu_k))[n:] == 0).all() and not bool(overflow)
    assert bool(varlen_segments(jnp.array(ids), q_len, start, n - 1)[2])


def _masked(q, k, v, q_ids, kv_ids, start, scale):
    nq, nk = q.shape[1], k.shape[1]
    pos_q, pos_k = jnp.arange(nq) + start, jnp.arange(nk)
    mask = (q_ids[:, :, None] == kv_ids[:, None, :]) & (pos_k[None, None] <= pos_q[None, :, None])
    out, _ = xj.attention_reference(q, k, v, scale=scale, mask=mask)
    return out * (q_ids != 0)[:, :, None, None]


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_document_causal_matches_masked_reference(backend):
    kv_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 4, 4, 0, 0]])
    start, nq = 4, 4
    q_ids = kv_ids[:, start:start + nq]
    dtype = jnp.float16 if backend == "kernel" else jnp.float32
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(k1, (2, nq, 4, 128), dtype)
    k, v = jax.random.normal(k2, (2, 8, 2, 128), dtype), jax.random.normal(k3, (2, 8, 2, 128), dtype)
    if backend == "kernel":
        _ffi.set_launcher_provider(numpy_launcher.provider)
    try:
        out = xj.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, 0.1, max_segments=8, backend=backend)
    finally:
        _ffi.set_launcher_provider(None)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    np.testing.assert_allclose(np.asarray(out, np.float32), _masked(*f32, q_ids, kv_ids, start, 0.1), atol=2e-3)


def test_causal_helper():
    q = jax.random.normal(jax.random.PRNGKey(1), (1, 6, 2, 64))
    out = xj.causal_fa4_attention(q, q, q, 0.125, backend="reference")
    ref = jax.nn.dot_product_attention(q, q, q, scale=0.125, is_causal=True)
    np.testing.assert_allclose(out, ref, atol=2e-5)
