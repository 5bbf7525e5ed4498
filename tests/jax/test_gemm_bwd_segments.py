"""The segmented GEMM backward's JAX driver (packed batches under jit) on the CPU: real FFI plumbing with
NumPy stand-ins of the seg_* launchers (tests/numpy_gemm.py), vs the fp64 reference backward."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from tests import numpy_gemm  # noqa: E402
from xattn.core import gemm_bwd_plan as plan_mod  # noqa: E402
from xattn.jax.gemm_bwd_segments import gemm_backward_segments  # noqa: E402
from xattn.jax.reference import attention_reference, attention_reference_bwd, varlen_visible  # noqa: E402


def _reference(q, k, v, dout, cu, scale, causal):
    f = lambda x: x.astype(jnp.float32)[None]  # noqa: E731
    mask = varlen_visible(cu, cu, q.shape[0], k.shape[0], causal, (None, None))
    out, lse = attention_reference(f(q), f(k), f(v), scale=scale, mask=mask)
    grads = attention_reference_bwd(f(dout), f(q), f(k), f(v), out, lse, scale=scale, mask=mask)
    return out[0], lse[0], [g[0] for g in grads]


@pytest.mark.parametrize("lens, hq, hkv, causal, rows, slots", [
    ((0, 1, 17, 100, 45), 4, 2, True, 16, 5),     # zero-length and 1-token documents, several blocks, GQA 2
    ((37, 64, 5), 3, 3, True, 24, 4),             # a spare slot (cu repeats its end), no GQA
    ((70, 33), 8, 1, False, 16, 2),               # not causal, GQA 8
    ((130,), 2, 1, True, 64, 1),                  # one document, blocks past it
])
def test_segments_vs_fp64(gemm_standin, lens, hq, hkv, causal, rows, slots):
    d, total = 32, sum(lens) + 3  # 3 tokens after the last document: zero gradients
    rng = np.random.default_rng(sum(lens))
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    q, k, v, dout = mk(total, hq, d), mk(total, hkv, d), mk(total, hkv, d), mk(total, hq, d)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu = jnp.asarray(np.concatenate([cu, [cu[-1]] * (slots + 1 - len(cu))]).astype(np.int32))
    scale = d ** -0.5
    out, lse, want = _reference(q, k, v, dout, cu, scale, causal)
    fn = jax.jit(lambda *a: gemm_backward_segments(*a, max_seqlen=max(lens), softmax_scale=scale, causal=causal,
                                                   rows=rows))
    got = fn(dout, q, k, v, out.astype(q.dtype), lse, cu)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape and x.dtype == q.dtype, name
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r)))), (name, err)
        assert not np.any(np.asarray(x[sum(lens):], np.float32)), name  # past the last document
    assert set(numpy_gemm.CALLS) == {"seg_probs", "seg_grad_scores", "seg_mm_dq", "seg_acc"}
    p = plan_mod.segment_plan(total, slots, max(lens), hq, hkv, causal, rows=rows)
    assert len(numpy_gemm.CALLS) == 5 * len(p.blocks) * len(p.head_groups)


def test_packed_attention_grads_on_the_segmented_route(gemm_standin, monkeypatch):
    """jax.grad through xattn.jax.packed_attention (segment ids, kernel backend, stand-ins) with
    XATTN_BWD_ROUTE=gemm: documents of mixed lengths take the segmented route, and the gradients match
    FFPA's varlen backward's (XATTN_BWD_ROUTE=ffpa) on the same call."""
    import xattn.jax as xj
    from xattn.jax import gemm_bwd_segments as seg

    calls = []
    real = seg.gemm_backward_segments
    monkeypatch.setattr(seg, "gemm_backward_segments", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    rng = np.random.default_rng(7)
    ids = np.zeros((2, 96), np.int32)
    ids[0, :40], ids[0, 40:41], ids[0, 41:90] = 1, 2, 3  # 6 padding tokens
    ids[1, :96] = 4
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    q, k, v, dout = mk(2, 96, 4, 320), mk(2, 96, 2, 320), mk(2, 96, 2, 320), mk(2, 96, 4, 320)

    def grads():
        def loss(q, k, v):
            out = xj.packed_attention(q, k, v, jnp.asarray(ids), max_segments=6, backend="kernel")
            return (out.astype(jnp.float32) * dout).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    got = grads()
    assert len(calls) == 1 and calls[0]["causal"] and calls[0]["max_seqlen"] == 96
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    want = grads()
    assert len(calls) == 1
    for x, r in zip(got, want):
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r.astype(jnp.float32))))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r.astype(jnp.float32))))), err


@pytest.mark.parametrize("lens, long_enough", [((96, 90, 1), True), ((20, 24, 30, 17), False)])
def test_auto_route_decides_on_the_device(gemm_standin, monkeypatch, lens, long_enough):
    """Under XATTN_BWD_ROUTE=auto a packed call with one cu_seqlens and a loose max_seqlen runs the segmented
    GEMMs only where the keys an average row's document holds reach the route table's count (a lax.cond on
    the traced lengths, one jitted function for both): otherwise FFPA's varlen backward. Both vs fp64."""
    import xattn.jax as xj
    from xattn.core import routes

    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 60),))
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    rng = np.random.default_rng(len(lens))
    t = sum(lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    q, k, v, dout = mk(t, 4, 320), mk(t, 2, 320), mk(t, 2, 320), mk(t, 4, 320)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [t] * 3]).astype(np.int32))  # spare slots: loose
    kw = dict(max_seqlen_q=128, max_seqlen_k=128, scale=320 ** -0.5, causal=True, backend="kernel")
    out, lse = xj.varlen_fwd(q, k, v, cu, cu, **kw)
    numpy_gemm.CALLS.clear()
    bwd = jax.jit(lambda dout, q, k, v, out, lse, cu: xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw))
    got = jax.block_until_ready(bwd(dout, q, k, v, out, lse, cu))  # the lengths are traced
    assert bool(numpy_gemm.CALLS) == long_enough and set(numpy_gemm.CALLS) <= {
        "seg_probs", "seg_grad_scores", "seg_mm_dq", "seg_acc"}
    _, _, want = _reference(q, k, v, dout, cu, 320 ** -0.5, True)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r)))), (name, err)
