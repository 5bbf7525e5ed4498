"""The JAX driver of the chunked-GEMM backward on the CPU: the real FFI plumbing with NumPy stand-ins
for the GEMM launchers (tests/numpy_gemm.py), vs the fp64 reference backward."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from tests import numpy_gemm  # noqa: E402
from xattn.jax import gemm_bwd as gb  # noqa: E402
from xattn.jax.reference import attention_reference, attention_reference_bwd  # noqa: E402


def _inputs(b, nq, nk, hq, hkv, d, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    return mk(b, nq, hq, d), mk(b, nk, hkv, d), mk(b, nk, hkv, d), mk(b, nq, hq, d)


@pytest.mark.parametrize("b, nq, nk, hq, hkv, causal, rows", [
    (2, 200, 200, 4, 2, True, 64),    # several blocks, GQA 2
    (1, 130, 190, 6, 2, True, 64),    # Nq < Nk, padded rows and keys
    (1, 190, 130, 3, 3, True, 64),    # Nq > Nk: rows before the first key
    (2, 150, 171, 8, 1, False, 64),   # GQA 8, not causal, Nk not a multiple of 8
    (1, 300, 40, 2, 1, True, 64),     # whole blocks without keys
    (1, 77, 77, 4, 4, True, None),    # one block (mm_kv writes dk/dv)
])
def test_jax_driver_vs_fp64(gemm_standin, b, nq, nk, hq, hkv, causal, rows):
    d = 32
    q, k, v, dout = _inputs(b, nq, nk, hq, hkv, d, seed=nq + nk)
    scale = d ** -0.5
    out, lse = attention_reference(q, k, v, scale=scale, causal=causal)
    want = attention_reference_bwd(dout.astype(jnp.float32), q.astype(jnp.float32), k.astype(jnp.float32),
                                   v.astype(jnp.float32), out.astype(jnp.float32), lse, scale=scale, causal=causal)
    got = jax.jit(lambda *a: gb.gemm_backward(*a, softmax_scale=scale, causal=causal, rows=rows))(
        dout, q, k, v, out.astype(q.dtype), lse)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape and x.dtype == q.dtype, name
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r)))), (name, err)
    kinds = set(numpy_gemm.CALLS)
    assert "probs_causal" in kinds and "grad_scores" in kinds and "mm_dq" in kinds
    # mm_kv writes dk/dv of a single block, or starts the fp32 accumulators that acc adds to
    with_keys = sum(kend > 0 for _, kend in gb.plan_mod.plan(b, nq, nk, hq, causal, rows=rows).blocks)
    assert "mm_kv" in kinds and ("acc" in kinds) == (with_keys > 1)


def test_route_through_ffpa_attention_grad(gemm_standin, monkeypatch):
    """xattn.jax.ffpa_attention's backward takes the GEMM route when XATTN_BWD_ROUTE=gemm."""
    import xattn.jax as xj

    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", "1")
    q, k, v, dout = _inputs(1, 150, 150, 4, 2, 320, seed=1)

    def loss(q, k, v):
        return jnp.sum(xj.ffpa_attention(q, k, v, causal=True, backend="kernel").astype(jnp.float32)
                       * dout.astype(jnp.float32))

    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert "probs_causal" in numpy_gemm.CALLS
    scale = 320 ** -0.5
    out, lse = attention_reference(q, k, v, scale=scale, causal=True)
    want = attention_reference_bwd(dout.astype(jnp.float32), q.astype(jnp.float32), k.astype(jnp.float32),
                                   v.astype(jnp.float32), out.astype(jnp.float32), lse, scale=scale, causal=True)
    for x, r in zip(got, want):
        assert float(jnp.max(jnp.abs(x.astype(jnp.float32) - r))) < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r))))


@pytest.mark.parametrize("bad", ["dout", "out", "lse"])
def test_bad_buffers_are_named_before_any_launch(gemm_standin, bad):
    q, k, v, dout = _inputs(1, 64, 64, 2, 1, 16, seed=0)
    out, lse = q, jnp.zeros((1, 2, 64), jnp.float32)
    args = dict(dout=dout, out=out, lse=lse)
    args[bad] = args[bad][..., :-1] if bad != "lse" else args[bad].astype(jnp.float16)
    with pytest.raises(ValueError, match=bad):
        gb.gemm_backward(args["dout"], q, k, v, args["out"], args["lse"], softmax_scale=0.25, causal=True)
    assert numpy_gemm.CALLS == []


def test_blocks_pass_whole_keys_and_accumulators(gemm_standin):
    """The launchers read the first rows of whole K/V and accumulators in place: the traced backward
    slices no key prefix out for a GEMM and writes no accumulator prefix back (each would be an XLA copy
    of B·Hkv·k8·D elements per block), and never zeroes an accumulator (the first block starts it)."""
    q, k, v, dout = _inputs(1, 256, 256, 4, 2, 32, seed=3)
    out, lse = attention_reference(q, k, v, scale=0.2, causal=True)
    jaxpr = jax.make_jaxpr(lambda *a: gb.gemm_backward(*a, softmax_scale=0.2, causal=True, rows=64))(
        dout, q, k, v, out.astype(q.dtype), lse)
    prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
    assert "dynamic_update_slice" not in prims and "scatter" not in prims, sorted(set(prims))
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "ffi_call"]
    keyed = [e for e in calls if any(str(e.params.get("target_name", "")).find(kind) >= 0
                                     for kind in ("probs_causal", "grad_scores", "mm_dq", "_acc_"))]
    # 4 blocks x (probs, grad_scores, mm_dq); 2 accs in each block after the first, whose mm_kv starts them
    assert len(keyed) == 4 * 3 + 3 * 2
    nk8 = 256
    for e in keyed:
        shapes = [tuple(x.aval.shape) for x in e.invars]
        assert any(s[1] == nk8 for s in shapes if len(s) == 3 and s[-1] == 32), (e.params["target_name"], shapes)
    starts = [e for e in calls if "mm_kv_float16_d32" in str(e.params.get("target_name", ""))]
    assert len(starts) == 2 and all(tuple(e.outvars[0].aval.shape) == (2, nk8, 32) for e in starts)
    # and no zeroed accumulator: the only fp32 arrays of that shape come from the launchers
    made = [e.primitive.name for e in jaxpr.jaxpr.eqns for o in e.outvars
            if tuple(o.aval.shape) == (2, nk8, 32) and o.aval.dtype == jnp.float32]
    assert set(made) == {"ffi_call"}, made


def _packed(lens, hq, hkv, d, seed):
    rng = np.random.default_rng(seed)
    t = sum(lens)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return mk(t, hq, d), mk(t, hkv, d), mk(t, hkv, d), mk(t, hq, d), cu


@pytest.mark.parametrize("lens, max_len, causal", [
    ([64, 64, 64], 64, True),            # equal documents: the packed tensors are the dense batch
    ([48, 48], 48, False),               # the same, not causal
    ([70, 0, 17, 1, 70], 70, True),      # empty, 1-token and short documents padded to max_seqlen
    ([50, 33, 64], 64, False),           # not causal: padded keys masked by position
])
def test_padded_packed_driver_vs_fp64(gemm_standin, lens, max_len, causal):
    """The static-shape packed route (documents padded to max_seqlen, traced lengths) under jit vs fp64."""
    from xattn.jax.reference import varlen_visible

    d, hq, hkv = 32, 4, 2
    q, k, v, dout, cu = _packed(lens, hq, hkv, d, seed=sum(lens))
    scale = d ** -0.5
    t = q.shape[0]
    mask = varlen_visible(cu, cu, t, t, causal, (None, None))
    f32 = lambda x: x.astype(jnp.float32)[None]  # noqa: E731
    out, lse = attention_reference(f32(q), f32(k), f32(v), scale=scale, mask=mask)
    want = attention_reference_bwd(f32(dout), f32(q), f32(k), f32(v), out, lse, scale=scale, mask=mask)
    run = lambda *a: gb.gemm_backward_padded(*a, max_seqlen_q=max_len, max_seqlen_k=max_len,  # noqa: E731
                                             softmax_scale=scale, causal=causal)
    args = (dout, q, k, v, out[0].astype(q.dtype), lse[0], cu, cu)
    got = jax.jit(run)(*args)
    jaxpr = jax.make_jaxpr(run)(*args).jaxpr
    conds = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
    # B x max_seqlen == T: a device-side choice between the packed tensors in place (no gather) and the
    # gathered batch (cu[-1] < T: rows after the last document, issue #42); else the gathered batch alone
    assert bool(conds) == (len(lens) * max_len == t)
    if conds:
        branches = [str(b) for b in conds[0].params["branches"]]
        assert sum("gather" not in b for b in branches) == 1
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape[1:] and x.dtype == q.dtype, name
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r[0])))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r)))), (name, err)


def test_packed_route_is_static(gemm_standin, caplog, monkeypatch):
    """Through xattn.jax.varlen_attention's route (xattn.core.routes, kind "traced"): documents about
    max_seqlen long take the padded GEMM route; a causal call with two cu_seqlens objects keeps FFPA's under
    auto (no causal block skipping there) but the padded route serves it when forced; a loose max_seqlen with
    one object takes the segments, decided on the device."""
    import dataclasses
    import logging

    from xattn.core import routes
    from xattn.jax import varlen as jv

    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    q, k, v, dout, cu = (x.astype(jnp.float16) for x in _packed([64, 64], 2, 1, 512, seed=1))
    cfg = jv._config("ffpa", q, None, True, (None, None), "kernel", 64, 64)
    spec = cfg.base.spec("bwd", q, k, v, cu.astype(jnp.int32), cu.astype(jnp.int32), 64, 64)
    same = dataclasses.replace(cfg, same_segments=True)
    with caplog.at_level(logging.DEBUG, logger="xattn"):
        assert jv.packed_route(same, spec, q, k, cu).name == "gemm-padded"
        two = jv.packed_route(cfg, spec, q, k, cu)  # causal, cu_seqlens_q is not cu_seqlens_k
        assert two.name == "fused" and "one cu_seqlens object" in two.reason
        loose = dataclasses.replace(same, max_seqlen_q=128, max_seqlen_k=128)
        assert jv.packed_route(loose, spec, q, k, cu).name == "gemm-segments|fused"
        full = jv._config("ffpa", q, None, False, (None, None), "kernel", 128, 128)
        assert "would cost more" in jv.packed_route(full, spec, q, k, cu).reason  # loose, two objects
    monkeypatch.setattr(routes, "SEGMENTS_BY_DEFAULT", False)
    assert "SEGMENTS_BY_DEFAULT" in jv.packed_route(loose, spec, q, k, cu).reason
    monkeypatch.setattr(routes, "PADDED_BY_DEFAULT", False)  # the switch that leaves it to a forced route
    assert jv.packed_route(same, spec, q, k, cu).name == "fused"
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    forced = jv._config("ffpa", q, None, True, (None, None), "kernel", 64, 64)
    assert jv.packed_route(forced, spec, q, k, cu).name == "gemm-padded"
    assert jv.packed_route(dataclasses.replace(forced, same_segments=True, max_seqlen_q=128, max_seqlen_k=128),
                           spec, q, k, cu).name == "gemm-segments"
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm-segments")
    with pytest.raises(ValueError, match="XATTN_BWD_ROUTE=gemm-segments: segments need self-attention"):
        jv.packed_route(jv._config("ffpa", q, None, True, (None, None), "kernel", 64, 64), spec, q, k, cu)


def test_varlen_attention_grads_on_the_padded_route(gemm_standin, monkeypatch):
    """jax.grad through xattn.jax.varlen_attention (kernel backend, stand-ins): the padded GEMM route is
    taken and its gradients match FFPA's varlen backward route's."""
    import xattn.jax as xj
    from xattn.core import routes

    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))
    calls = []
    real = gb.gemm_backward_padded
    monkeypatch.setattr(gb, "gemm_backward_padded", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, dout, cu = _packed([64, 61, 64], 2, 1, 512, seed=4)

    def grads():
        loss = lambda q, k, v: (xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=64, max_seqlen_k=64, causal=True,  # noqa: E731
                                                    backend="kernel").astype(jnp.float32) * dout).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    got = grads()
    assert calls == [1]
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    want = grads()
    assert calls == [1]
    for x, r in zip(got, want):
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r.astype(jnp.float32))))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r.astype(jnp.float32))))), err
