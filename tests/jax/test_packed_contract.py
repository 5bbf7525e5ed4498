"""JAX packed backwards on inputs inside the documented varlen contract that the routes were not written
for (issue #42, cases 1-3): rows after the last document, ``max_seqlen_q > max_seqlen_k`` with one
cu_seqlens object, ``Tq != Tk`` with one cu_seqlens object. Through ``xattn.jax.varlen_attention`` +
``jax.grad`` on the kernel backend (NumPy stand-ins: tests/numpy_gemm.py), the default ``auto`` route
with the table lowered so that these small problems take the GEMM routes as large ones do on the H200,
and every route that serves the problem forced; judged against the fp32 reference of the same call."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from tests import numpy_gemm  # noqa: E402
from xattn.core import routes  # noqa: E402
from xattn.jax import varlen as jv  # noqa: E402
from xattn.jax.reference import attention_reference, attention_reference_bwd, varlen_visible  # noqa: E402

D = 512


def _case(lens, total_q, total_k, hq, hkv, seed):
    rng = np.random.default_rng(seed)
    mk = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float16)  # noqa: E731
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    return mk(total_q, hq, D), mk(total_k, hkv, D), mk(total_k, hkv, D), mk(total_q, hq, D), cu


def _want(q, k, v, dout, cu, causal, scale):
    f = lambda x: x.astype(jnp.float32)[None]  # noqa: E731
    mask = varlen_visible(cu, cu, q.shape[0], k.shape[0], causal)
    out, lse = attention_reference(f(q), f(k), f(v), scale=scale, mask=mask)
    return [g[0] for g in attention_reference_bwd(f(dout), f(q), f(k), f(v), out, lse, scale=scale, mask=mask)]


def _grads(q, k, v, dout, cu, max_q, max_k, causal, jit):
    def loss(q, k, v):
        out = jv.varlen_attention(q, k, v, cu, cu, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
                                  backend="kernel", check_inputs=not jit)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32))

    fn = jax.grad(loss, argnums=(0, 1, 2))
    return jax.block_until_ready((jax.jit(fn) if jit else fn)(q, k, v))


def _assert_close(got, want, what):
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape, (what, name)
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - r)))
        assert err < 2e-2 * max(1.0, float(jnp.max(jnp.abs(r)))), (what, name, err)


CASES = [
    # 1: documents padded to max_seqlen fill B x max_seqlen == T, but cu[-1] < T (trailing rows):
    #    the padded route used the packed tensors as the dense batch in place
    pytest.param(([60, 60], 128, 128, 64, 64, True), id="case1-trailing-rows-causal"),
    pytest.param(([60, 60], 128, 128, 64, 64, False), id="case1-trailing-rows"),
    # 2: one document, max_seqlen_q > max_seqlen_k: the block plan's shift Nk - Nq went negative
    pytest.param(([130], 150, 150, 150, 130, True), id="case2-max-q-above-max-k"),
    # 3: one cu_seqlens object with Tk > Tq (and Tq > Tk): the segmented driver's reshape failed at trace time
    pytest.param(([48, 30, 20], 98, 110, 48, 48, True), id="case3-tk-above-tq"),
    pytest.param(([48, 30, 20], 110, 98, 48, 48, True), id="case3-tq-above-tk"),
]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES)
def test_default_route_is_exact(gemm_standin, monkeypatch, case, jit):
    lens, tq, tk, max_q, max_k, causal = case
    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))  # the GEMM routes, as at H200 sizes
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", "1")  # several row blocks at these sizes
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    q, k, v, dout, cu = _case(lens, tq, tk, 8, 1, seed=tq + tk)
    got = _grads(q, k, v, dout, cu, max_q, max_k, causal, jit)
    assert numpy_gemm.CALLS, "the GEMM routes ran"
    _assert_close(got, _want(q, k, v, dout, cu, causal, D ** -0.5), "auto")


@pytest.mark.parametrize("case", CASES)
def test_every_serving_route_is_exact(gemm_standin, monkeypatch, case):
    """Each route that accepts the problem, forced through the test hook, gives the reference's gradients."""
    lens, tq, tk, max_q, max_k, causal = case
    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", "1")
    q, k, v, dout, cu = _case(lens, tq, tk, 8, 1, seed=tq + tk)
    want = _want(q, k, v, dout, cu, causal, D ** -0.5)
    problem = routes.BwdProblem("ffpa", D, D, 8, causal, kind="traced", total_q=tq, total_k=tk, slots=len(lens),
                                max_seqlen_q=max_q, max_seqlen_k=max_k, same_segments=True, heads_q=8)
    names = routes.serving_routes(problem)
    assert set(names) == {"fused", "gemm-padded", "gemm-segments", "gemm-segments|fused"}
    for name in names:
        with routes.forced(name):
            got = _grads(q, k, v, dout, cu, max_q, max_k, causal, jit=False)
        _assert_close(got, want, name)
