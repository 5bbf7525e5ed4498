"""Varlen and segment_ids packing in xattn.jax (CPU): reference semantics, the FFI plumbing through
the NumPy stand-in (cu_seqlens argument order, zero-length segments), and the conversion."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi
from xattn.jax.reference import attention_reference
from xattn.jax.varlen import packed_attention, segment_ids_to_cu_seqlens, varlen_attention

from . import numpy_launcher

LQ, LK = [5, 0, 9, 3], [4, 6, 9, 1]  # uneven, an empty-query segment, fewer keys than queries


def _packed(seed, d=128, hq=4, hkv=2, dtype=jnp.float16):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(k1, (sum(LQ), hq, d), dtype)
    k = jax.random.normal(k2, (sum(LK), hkv, d), dtype)
    v = jax.random.normal(k3, (sum(LK), hkv, d), dtype)
    cu = lambda ls: jnp.array(np.concatenate([[0], np.cumsum(ls)]), jnp.int32)  # noqa: E731
    return q, k, v, cu(LQ), cu(LK)


def _per_segment(q, k, v, causal, scale):
    outs, pos_q, pos_k = [], 0, 0
    for lq, lk in zip(LQ, LK):
        o, _ = attention_reference(q[None, pos_q:pos_q + lq], k[None, pos_k:pos_k + lk], v[None, pos_k:pos_k + lk],
                                   scale=scale, causal=causal)
        outs.append(o[0])
        pos_q, pos_k = pos_q + lq, pos_k + lk
    return jnp.concatenate(outs)


@pytest.mark.parametrize("causal", [False, True])
def test_reference_varlen_equals_per_segment(causal):
    q, k, v, cu_q, cu_k = _packed(0, dtype=jnp.float32)
    out = varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=9, family="fa4", scale=0.1,
                           causal=causal, backend="reference")
    np.testing.assert_allclose(out, _per_segment(q, k, v, causal, 0.1), atol=1e-5)


@pytest.mark.parametrize("family, d", [("fa4", 128), ("ffpa", 384)])
def test_kernel_path_through_ffi_matches_reference(family, d):
    _ffi.set_launcher_provider(numpy_launcher.provider)
    try:
        q, k, v, cu_q, cu_k = _packed(1, d=d)
        kw = dict(max_seqlen_q=9, max_seqlen_k=9, family=family, scale=0.1, causal=True)
        f = lambda q, k, v: (varlen_attention(q, k, v, cu_q, cu_k, backend="kernel",  # noqa: E731
                                              **kw).astype(jnp.float32) ** 2).sum()
        r = lambda q, k, v: (varlen_attention(q, k, v, cu_q, cu_k, backend="reference", **kw) ** 2).sum()  # noqa: E731
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        np.testing.assert_allclose(jax.jit(f)(q, k, v), r(*f32), rtol=2e-3)
        for a, b in zip(jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v), jax.grad(r, argnums=(0, 1, 2))(*f32)):
            np.testing.assert_allclose(a.astype(np.float32), b, atol=3e-2, rtol=3e-2)
    finally:
        _ffi.set_launcher_provider(None)


def test_segment_ids_to_cu_seqlens():
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 4, 4]])
    cu, num, overflow = segment_ids_to_cu_seqlens(seg, max_segments=8)
    assert cu.tolist() == [0, 3, 5, 8, 14, 16, 16, 16, 16] and int(num) == 5 and not bool(overflow)
    cu, num, overflow = jax.jit(segment_ids_to_cu_seqlens, static_argnums=1)(seg, 4)
    assert bool(overflow) and int(num) == 5


def test_packed_attention_equals_each_document_alone():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 4, 4]])
    q, k, v = (jax.random.normal(kk, (2, 8, 2, 16)) for kk in (k1, k2, k3))
    out = packed_attention(q, k, v, seg, max_segments=6, scale=0.3, backend="reference")
    for row, a, b in ((0, 0, 3), (0, 3, 5), (1, 0, 6), (1, 6, 8)):
        alone, _ = attention_reference(q[row:row + 1, a:b], k[row:row + 1, a:b], v[row:row + 1, a:b], scale=0.3,
                                       causal=True)
        np.testing.assert_allclose(out[row, a:b], alone[0], atol=1e-5)
    assert (out[0, 5:] == 0).all()  # padding
    g = jax.grad(lambda q: packed_attention(q, k, v, seg, max_segments=6, scale=0.3, backend="reference").sum())(q)
    assert jnp.isfinite(g).all() and (g[0, 5:] == 0).all()
    assert jnp.isnan(packed_attention(q, k, v, seg, max_segments=3, scale=0.3, backend="reference")).all()


def test_varlen_input_checks():
    q, k, v, cu_q, cu_k = _packed(4)
    with pytest.raises(TypeError, match="int32"):
        varlen_attention(q, k, v, cu_q.astype(jnp.int64) if jax.config.jax_enable_x64 else cu_q.astype(jnp.int16), cu_k,
                         max_seqlen_q=9, max_seqlen_k=9, family="fa4")
    with pytest.raises(ValueError, match="max_seqlen_q"):
        varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=None, max_seqlen_k=9, family="fa4")
    with pytest.raises(ValueError, match="rank 3"):
        varlen_attention(q[None], k, v, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=9)
    assert xj is not None


@pytest.mark.parametrize("tq, tk", [(10, 0), (0, 14)], ids=["no-keys", "no-queries"])
def test_kernel_path_launches_nothing_without_tokens(tq, tk):
    """Tk = 0 (or Tq = 0): out 0 / lse -inf and zero gradients with no launch; on the H200 a varlen launch
    with zero keys hit an illegal instruction that poisoned the process's CUDA context."""
    _ffi.set_launcher_provider(numpy_launcher.provider)
    numpy_launcher.CALLS.clear()
    try:
        ks = jax.random.split(jax.random.PRNGKey(3), 3)
        q = jax.random.normal(ks[0], (tq, 8, 128), jnp.float16)
        k, v = (jax.random.normal(kk, (tk, 2, 128), jnp.float16) for kk in ks[1:])
        cu_q, cu_k = jnp.array([0, tq // 2, tq], jnp.int32), jnp.array([0, tk // 2, tk], jnp.int32)
        f = lambda q, k, v: varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=tq, max_seqlen_k=tk,  # noqa: E731
                                             family="fa4", causal=True, backend="kernel")
        out, lse = xj.varlen_fwd(q, k, v, cu_q, cu_k, max_seqlen_q=tq, max_seqlen_k=tk, family="fa4", scale=0.1,
                                 causal=True, backend="kernel")
        grads = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
        assert numpy_launcher.CALLS == []
        assert out.shape == (tq, 8, 128) and not np.asarray(out, np.float32).any()
        assert np.all(np.asarray(lse) == -np.inf)
        assert all(not np.asarray(g, np.float32).any() for g in grads)
    finally:
        _ffi.set_launcher_provider(None)


def test_cu_seqlens_on_another_device_is_named(monkeypatch):
    """On the H200, host-committed cu_seqlens moved the whole call to the CPU platform ("No FFI handler ...
    Host"); now the argument is named. (One host device here: the placement is faked.)"""
    from xattn.jax import varlen as vl

    q = jnp.zeros((6, 2, 128), jnp.float16)
    cu = jax.device_put(jnp.array([0, 6], jnp.int32), jax.devices()[0])  # committed, as device_put makes it
    monkeypatch.setattr(vl, "_devices", lambda x: {"cuda:0"} if x is q else ({"cpu:0"} if x is cu else None))
    with pytest.raises(ValueError, match=r"cu_seqlens_q: on \['cpu:0'\] but q is on \['cuda:0'\]"):
        varlen_attention(q, q, q, cu, jnp.array([0, 6], jnp.int32), max_seqlen_q=6, max_seqlen_k=6, family="fa4",
                         backend="reference")


def test_string_scale_is_named():
    q = jnp.zeros((6, 2, 128), jnp.float16)
    cu = jnp.array([0, 6], jnp.int32)
    with pytest.raises(TypeError, match="scale"):
        varlen_attention(q, q, q, cu, cu, max_seqlen_q=6, max_seqlen_k=6, family="fa4", scale="0.1",
                         backend="reference")
