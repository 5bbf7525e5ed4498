"""The chunked-GEMM d512 backward through xattn.jax on the GPU (the core's quack GEMM launchers as
XLA FFI custom calls) vs fp64 and vs FFPA's backward on the same inputs (issue #14)."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

pytestmark = pytest.mark.gpu


def _inputs(b, nq, nk, hq, hkv, dtype, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dtype)  # noqa: E731
    return mk(b, nq, hq, 512), mk(b, nk, hkv, 512), mk(b, nk, hkv, 512), mk(b, nq, hq, 512)


def _ref_bwd(dout, q, k, v, out, lse, scale, causal):
    import torch

    from tests.reference import attention_bwd
    t = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32)))  # noqa: E731
    return attention_bwd(t(dout), t(q), t(k), t(v), t(out), t(lse), scale=scale, causal=causal)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("g, causal", [(1, True), (1, False), (4, True), (8, True), (8, False)])
@pytest.mark.parametrize("budget_mib", ["1", "2048"], ids=["many-blocks", "one-block"])
def test_jax_gemm_backward_vs_fp64_and_ffpa(monkeypatch, dtype, g, causal, budget_mib):
    import xattn.jax as xj

    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", budget_mib)
    hkv = 2
    q, k, v, dout = _inputs(2, 389, 517, g * hkv, hkv, dtype, seed=g * 10 + causal)
    scale = 512 ** -0.5
    out, lse = xj.ffpa_fwd(q, k, v, scale=scale, causal=causal, backend="kernel")
    want = _ref_bwd(dout, q, k, v, out, lse, scale, causal)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = xj.ffpa_bwd(dout, q, k, v, out, lse, scale=scale, causal=causal, backend="kernel")
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    got = xj.ffpa_bwd(dout, q, k, v, out, lse, scale=scale, causal=causal, backend="kernel")
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert x.shape == f.shape and x.dtype == dtype, name
        r = r.double().numpy()
        err = np.abs(np.asarray(x.astype(jnp.float32), np.float64) - r).max()
        err_ffpa = np.abs(np.asarray(f.astype(jnp.float32), np.float64) - r).max()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)


def test_jax_auto_route_under_jit_grad(monkeypatch):
    """Gemma 4 global-layer shape past the table's threshold: jit(grad) takes the GEMM route by default."""
    import xattn.jax as xj
    from xattn.jax import _ffi

    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    q, k, v, dout = _inputs(1, 2100, 2100, 8, 1, jnp.bfloat16, seed=3)
    f = lambda q, k, v: jnp.sum(xj.ffpa_attention(q, k, v, causal=True).astype(jnp.float32)  # noqa: E731
                                * dout.astype(jnp.float32))
    got = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    assert any("gemm_probs_causal" in t for t in _ffi.registered_targets())
    out, lse = xj.ffpa_fwd(q, k, v, scale=512 ** -0.5, causal=True)
    want = _ref_bwd(dout, q, k, v, out, lse, 512 ** -0.5, True)
    for x, r in zip(got, want):
        x = np.asarray(x.astype(jnp.float32), np.float64)
        r = r.double().numpy()
        assert np.linalg.norm(x - r) / np.linalg.norm(r) < 1e-2


@pytest.mark.parametrize("lens, max_len, causal, g", [
    ([1000, 1000, 977], 1000, True, 8),   # documents about max_seqlen long, one cu_seqlens: the GEMM route
    ([800, 800, 800], 800, True, 8),      # documents filling B x max_seqlen: the dense batch in place
    ([600, 555, 600, 590], 600, False, 1),
    ([700, 0, 700, 1, 699], 700, True, 4),  # empty and 1-token documents (the padded batch still exact)
])
def test_jax_packed_gemm_backward_vs_fp64_and_ffpa(monkeypatch, lens, max_len, causal, g):
    """xattn.jax.varlen_bwd with the GEMM route forced (documents padded to max_seqlen) vs FFPA's varlen
    backward on the same out/lse, both vs fp64 per document."""
    import torch

    import xattn.jax as xj
    from tests.reference import attention_bwd

    hkv = 2
    rng = np.random.default_rng(sum(lens))
    t = sum(lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), jnp.bfloat16)  # noqa: E731
    q, k, v, dout = mk(t, g * hkv, 512), mk(t, hkv, 512), mk(t, hkv, 512), mk(t, g * hkv, 512)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    kw = dict(max_seqlen_q=max_len, max_seqlen_k=max_len, scale=512 ** -0.5, causal=causal, backend="kernel")
    out, lse = xj.varlen_fwd(q, k, v, cu, cu, **kw)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    got = xj.varlen_bwd(dout, q, k, v, out, lse, cu, cu, **kw)
    tt = lambda x: torch.from_numpy(np.asarray(x.astype(jnp.float32)))  # noqa: E731
    want = [torch.zeros(x.shape, dtype=torch.float64) for x in (q, k, v)]
    s = 0
    for n in lens:
        if n:
            r = slice(s, s + n)
            parts = attention_bwd(tt(dout)[None, r], tt(q)[None, r], tt(k)[None, r], tt(v)[None, r], tt(out)[None, r],
                                  tt(lse)[None, :, r], scale=512 ** -0.5, causal=causal)
            for w, p in zip(want, parts):
                w[r] = p[0]
        s += n
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert x.shape == f.shape and x.dtype == jnp.bfloat16, name
        r = r.numpy()
        err = np.abs(np.asarray(x.astype(jnp.float32), np.float64) - r).max()
        err_ffpa = np.abs(np.asarray(f.astype(jnp.float32), np.float64) - r).max()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)
