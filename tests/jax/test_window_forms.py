"""Every spelling of ``window_size`` through xattn.jax on the reference backend, against NumPy fp64 (issue #22
case 2): ``None`` or ``-1`` is an unbounded side (FlashAttention), under ``causal=True`` the window lives inside
the causal mask, other negative sides raise, and FFPA refuses a window on every backend."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax.varlen import varlen_attention

jax.config.update("jax_enable_x64", False)


def _qkv(seed, nq=11, nk=14, d=16, lead=(2,)):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (*lead, nq, 4, d)), jax.random.normal(k2, (*lead, nk, 2, d)),
            jax.random.normal(k3, (*lead, nk, 2, d)))


def _numpy_attention(q, k, v, scale, causal, window):
    """fp64, bottom-right aligned; rows with no visible key are 0."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    nq, nk = q.shape[1], k.shape[1]
    k, v = np.repeat(k, q.shape[2] // k.shape[2], 2), np.repeat(v, q.shape[2] // v.shape[2], 2)
    rel = np.arange(nk)[None, :] - (np.arange(nq)[:, None] + nk - nq)
    left, right = window
    vis = np.ones((nq, nk), bool)
    if causal:
        vis &= rel <= 0
    if left is not None:
        vis &= rel >= -left
    if right is not None:
        vis &= rel <= right
    s = np.einsum("bnhd,bmhd->bhnm", q, k) * scale
    s = np.where(vis, s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("bhnm,bmhd->bnhd", p, v)


SPELLINGS = [  # (causal, window as given) -> (causal, window) it means
    (True, (-1, -1), True, (None, None)),
    (True, (None, 3), True, (None, None)),
    (True, (5, -1), False, (5, 0)),
    (True, (5, 2), False, (5, 0)),
    (False, (-1, -1), False, (None, None)),
    (False, (-1, 0), True, (None, None)),
    (False, (5, -1), False, (5, None)),
    (False, (-1, 3), False, (None, 3)),
    (False, (0, 0), False, (0, 0)),
]


@pytest.mark.parametrize("causal, window, want_causal, want_window", SPELLINGS, ids=str)
def test_flash_attention_window_spellings(causal, window, want_causal, want_window):
    q, k, v = _qkv(0)
    out = xj.flash_attention(q, k, v, scale=0.3, causal=causal, window_size=window, backend="reference")
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, 0.3, want_causal, want_window), atol=2e-5)
    out, _ = xj.fa4_fwd(q, k, v, scale=0.3, causal=causal, window_size=window, backend="reference")
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, 0.3, want_causal, want_window), atol=2e-5)


@pytest.mark.parametrize("causal, window, want_causal, want_window", SPELLINGS, ids=str)
def test_varlen_window_spellings(causal, window, want_causal, want_window):
    q, k, v = _qkv(1, nq=9, nk=9, lead=())
    q, k, v = (x[None] for x in (q, k, v))
    cu = jnp.array([0, 9], jnp.int32)
    out = varlen_attention(q[0], k[0], v[0], cu, cu, max_seqlen_q=9, max_seqlen_k=9, family="fa4", scale=0.3,
                           causal=causal, window_size=window, backend="reference")
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, 0.3, want_causal, want_window)[0], atol=2e-5)


@pytest.mark.parametrize("window, match", [((-2, 0), "left side"), ((3, -9), "right side")])
def test_negative_windows_other_than_minus_one_raise(window, match):
    q, k, v = _qkv(2)
    for causal in (False, True):
        with pytest.raises(ValueError, match=f"window_size: the {match}"):
            xj.flash_attention(q, k, v, scale=0.3, causal=causal, window_size=window, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_ffpa_varlen_refuses_a_window_on_every_backend(backend):
    q, k, v = _qkv(3, nq=9, nk=9, d=512, lead=())
    cu = jnp.array([0, 9], jnp.int32)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        varlen_attention(q, k, v, cu, cu, max_seqlen_q=9, max_seqlen_k=9, family="ffpa", scale=0.1, causal=True,
                         window_size=(4, -1), backend=backend)
    out = varlen_attention(q, k, v, cu, cu, max_seqlen_q=9, max_seqlen_k=9, family="ffpa", scale=0.1, causal=True,
                           window_size=(-1, -1), backend="reference")  # FA2's unbounded: plain causal
    np.testing.assert_allclose(out, _numpy_attention(q[None], k[None], v[None], 0.1, True, (None, None))[0],
                               atol=2e-5)
