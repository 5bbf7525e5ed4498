"""The segmented GEMM backward (packed batches of any document lengths under jit; issue #23) on the GPU:
the seg_* quack launchers as XLA FFI custom calls, vs fp64 per document and vs FFPA's varlen backward on
the same out/lse."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

pytestmark = pytest.mark.gpu


def _fp64_per_document(dout, q, k, v, out, lse, lens, causal):
    """dq, dk, dv in fp64 (torch on the GPU), zero outside every document."""
    import torch

    from tests.reference import attention_bwd

    tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda()  # noqa: E731
    dout, q, k, v, out, lse = map(tt, (dout, q, k, v, out, lse))
    want = [torch.zeros(x.shape, dtype=torch.float64, device="cuda") for x in (q, k, v)]
    s = 0
    for n in lens:
        if n:
            r = slice(s, s + n)
            parts = attention_bwd(dout[None, r], q[None, r], k[None, r], v[None, r], out[None, r], lse[None, :, r],
                                  scale=512 ** -0.5, causal=causal)
            for w, p in zip(want, parts):
                w[r] = p[0]
        s += n
    return [w.cpu().numpy() for w in want]


@pytest.mark.parametrize("lens, slack, causal, g, hkv", [
    ((0, 1, 17, 1000, 8192), 0, True, 2, 1),        # the lengths in one batch, a 16k-row view
    ((2100, 1, 300, 17, 1000, 0), 1.5, True, 8, 2),  # GQA 8, a loose max_seqlen, 1-token documents
    ((640, 77, 1500), 1.25, True, 4, 2),
    ((300, 1500, 17, 700), 1.0, False, 1, 2),       # not causal: keys past each document masked
])
def test_segmented_backward_vs_fp64_and_ffpa(monkeypatch, lens, slack, causal, g, hkv):
    import xattn.jax as xj

    rng = np.random.default_rng(sum(lens) + g)
    t = sum(lens) + 5  # 5 tokens after the last document
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    q, k, v, dout = mk(t, g * hkv, 512), mk(t, hkv, 512), mk(t, hkv, 512), mk(t, g * hkv, 512)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [sum(lens)]]).astype(np.int32))  # a spare slot
    max_len = int(max(lens) * slack) if slack else t
    kw = dict(max_seqlen_q=max_len, max_seqlen_k=max_len, scale=512 ** -0.5, causal=causal, backend="kernel")
    out, lse = xj.varlen_fwd(q, k, v, cu, cu, **kw)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    from xattn.jax import gemm_bwd_segments as seg

    calls = []
    real = seg.gemm_backward_segments
    monkeypatch.setattr(seg, "gemm_backward_segments", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw)
    assert calls == [1]  # the segmented route ran (not the padded one)
    want = _fp64_per_document(dout, q, k, v, out, lse, lens, causal)
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert x.shape == f.shape and x.dtype == jnp.bfloat16, name
        x = np.asarray(x.astype(jnp.float32), np.float64)
        assert not x[sum(lens):].any(), name  # past the last document
        err = np.abs(x - r).max()
        err_ffpa = np.abs(np.asarray(f.astype(jnp.float32), np.float64) - r).max()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)


@pytest.mark.parametrize("rows", [64, 256])
def test_segmented_backward_many_blocks_and_head_groups(rows):
    """gemm_backward_segments directly with small row blocks and a budget that splits the KV heads into
    launches, vs fp64."""
    import xattn.jax as xj
    from xattn.core import gemm_bwd_plan as plan_mod
    from xattn.jax.gemm_bwd_segments import gemm_backward_segments

    lens = (333, 0, 1024, 129, 64)
    rng = np.random.default_rng(rows)
    t = sum(lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    q, k, v, dout = mk(t, 8, 512), mk(t, 4, 512), mk(t, 4, 512), mk(t, 8, 512)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    kw = dict(max_seqlen_q=1024, max_seqlen_k=1024, scale=512 ** -0.5, causal=True, backend="kernel")
    out, lse = xj.varlen_fwd(q, k, v, cu, cu, **kw)
    blocks = plan_mod.segment_plan(t, len(lens), 1024, 8, 4, True, budget=1 << 40, rows=rows).blocks
    budget = 2 * max(plan_mod.BYTES_PER_SCORE * 2 * m * kend for kend, m in blocks)  # two KV heads per launch
    plan = plan_mod.segment_plan(t, len(lens), 1024, 8, 4, True, budget=budget, rows=rows)
    assert plan.head_groups == ((0, 2), (2, 2))
    got = jax.jit(lambda *a: gemm_backward_segments(*a, max_seqlen=1024, softmax_scale=512 ** -0.5, causal=True,
                                                    budget=budget, rows=rows))(dout, q, k, v, out, lse, cu)
    want = _fp64_per_document(dout, q, k, v, out, lse, lens, True)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        x = np.asarray(x.astype(jnp.float32), np.float64)
        assert np.linalg.norm(x - r) / np.linalg.norm(r) < 1e-2, name


@pytest.mark.parametrize("lens", [(3000, 17, 2500, 1), (300, 500, 17)], ids=["long: segmented", "short: ffpa"])
def test_auto_route_vs_fp64(monkeypatch, lens):
    """XATTN_BWD_ROUTE=auto, one cu_seqlens, a loose max_seqlen: the lax.cond on the device picks the
    segmented GEMMs (keys per row's document >= 2048 at GQA 8) or FFPA's varlen backward; both vs fp64."""
    import xattn.jax as xj

    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    rng = np.random.default_rng(len(lens))
    t = sum(lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    q, k, v, dout = mk(t, 16, 512), mk(t, 2, 512), mk(t, 2, 512), mk(t, 16, 512)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [t, t]]).astype(np.int32))
    kw = dict(max_seqlen_q=4096, max_seqlen_k=4096, scale=512 ** -0.5, causal=True, backend="kernel")
    out, lse = xj.varlen_fwd(q, k, v, cu, cu, **kw)
    bwd = jax.jit(lambda dout, q, k, v, out, lse, cu: xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw))
    got = bwd(dout, q, k, v, out, lse, cu)
    want = _fp64_per_document(dout, q, k, v, out, lse, lens, True)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        x = np.asarray(x.astype(jnp.float32), np.float64)
        assert np.linalg.norm(x - r) / np.linalg.norm(r) < 1e-2, name
