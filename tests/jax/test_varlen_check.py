"""Checked varlen inputs in xattn.jax (CPU): the cu_seqlens rules as checkify user checks, reported
eagerly, under ``jit(checkify(...))``, under vmap and grad; plain jit refuses to stage them; the
unchecked path never builds them; env var / keyword precedence; the kernel path via the NumPy stand-in."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from xattn.core import varlen_check as vc
from xattn.jax import _ffi, varlen
from xattn.jax.fa4 import document_causal_fa4_attention
from xattn.jax.varlen import packed_attention, varlen_attention, varlen_bwd, varlen_fwd

from . import numpy_launcher

TQ, TK = 12, 14
GOOD_Q, GOOD_K = [0, 5, 5, 12], [0, 4, 10, 14]
KW = dict(max_seqlen_q=7, max_seqlen_k=6, family="fa4", scale=0.3, causal=True, backend="reference")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    monkeypatch.delenv(vc.ENV_VAR, raising=False)


def _qkv():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k1, (TQ, 2, 16)), jax.random.normal(k2, (TK, 1, 16)),
            jax.random.normal(k3, (TK, 1, 16)))


def cu(values):
    return jnp.asarray(values, jnp.int32)


def _fn(**kw):
    q, k, v = _qkv()
    return lambda cu_q, cu_k: varlen_attention(q, k, v, cu_q, cu_k, **{**KW, **kw})


VIOLATIONS = [
    pytest.param([1, 5, 5, 12], GOOD_K, "cu_seqlens_q[0] = 1: must be 0", id="not-starting-at-0"),
    pytest.param([0, 5, 9, 8], GOOD_K, "cu_seqlens_q[3] = 8 < cu_seqlens_q[2] = 9: must be non-decreasing",
                 id="decreasing"),
    pytest.param([0, 6, 4, 2], GOOD_K, "cu_seqlens_q[2] = 4 < cu_seqlens_q[1] = 6", id="decreasing-names-first"),
    pytest.param([0, 5, 5, 13], GOOD_K, "cu_seqlens_q[3] = 13 > Tq = 12", id="end-beyond-T"),
    pytest.param([0, 1, 9, 12], GOOD_K, "cu_seqlens_q[2] - cu_seqlens_q[1] = 8 > max_seqlen_q = 7: segment 1",
                 id="segment-beyond-max"),
    pytest.param(GOOD_Q, [0, 4, 3, 14], "cu_seqlens_k[2] = 3 < cu_seqlens_k[1] = 4", id="k-decreasing"),
    pytest.param(GOOD_Q, [0, 4, 11, 14], "cu_seqlens_k[2] - cu_seqlens_k[1] = 7 > max_seqlen_k = 6",
                 id="k-segment-beyond-max"),
]


@pytest.mark.parametrize("cu_q, cu_k, fragment", VIOLATIONS)
def test_eager_checked_mode_raises_naming_the_first_bad_index(cu_q, cu_k, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        _fn(check_inputs=True)(cu(cu_q), cu(cu_k))


@pytest.fixture(scope="module")
def checked():
    """One jitted, checkified, checked-mode function for every case (compiled once)."""
    return jax.jit(checkify.checkify(_fn(check_inputs=True), errors=checkify.user_checks))


@pytest.mark.parametrize("cu_q, cu_k, fragment", VIOLATIONS)
def test_checkify_reports_under_jit(cu_q, cu_k, fragment, checked):
    err, _ = checked(cu(cu_q), cu(cu_k))
    assert fragment in err.get()
    err, out = checked(cu(GOOD_Q), cu(GOOD_K))
    assert err.get() is None
    np.testing.assert_allclose(out, _fn()(cu(GOOD_Q), cu(GOOD_K)), atol=1e-6)


def test_checkify_eager_vmap_and_grad():
    f = _fn(check_inputs=True)
    bad = cu([0, 5, 9, 8])
    err, _ = checkify.checkify(f, errors=checkify.user_checks)(bad, cu(GOOD_K))
    assert "cu_seqlens_q[3] = 8 < cu_seqlens_q[2] = 9" in err.get()
    batched = jax.jit(checkify.checkify(jax.vmap(f, in_axes=(0, None)), errors=checkify.user_checks))
    err, _ = batched(jnp.stack([cu(GOOD_Q), bad]), cu(GOOD_K))
    assert "cu_seqlens_q[3] = 8" in err.get()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 8")):
        jax.grad(lambda q: varlen_attention(q, k, v, bad, cu(GOOD_K), check_inputs=True, **KW).sum())(q)


def test_plain_jit_cannot_stage_the_checks():
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(_fn(check_inputs=True))(cu(GOOD_Q), cu(GOOD_K))
    jax.jit(_fn(check_inputs=False))(cu([0, 5, 9, 8]), cu(GOOD_K))  # unchecked: runs (undefined on the GPU)


def test_static_rules_always_checked():
    f = _fn()
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype int32, got int64") as info:
        f(np.asarray(GOOD_Q, np.int64), cu(GOOD_K))
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k: expected shape (4,) like cu_seqlens_q")):
        f(cu(GOOD_Q), cu([0, 14]))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected a 1-D tensor"):
        f(cu([GOOD_Q]), cu(GOOD_K))


def test_unchecked_path_never_builds_the_checks(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("_check_values called")
    monkeypatch.setattr(varlen, "_check_values", forbidden)
    bad = cu([0, 5, 9, 8])
    _fn()(bad, cu(GOOD_K))
    _fn(check_inputs=False)(bad, cu(GOOD_K))
    monkeypatch.setenv(vc.ENV_VAR, "1")
    _fn(check_inputs=False)(bad, cu(GOOD_K))  # the keyword beats the env var
    with pytest.raises(AssertionError, match="_check_values called"):
        _fn()(bad, cu(GOOD_K))


def test_env_var_turns_checking_on_for_every_varlen_entry(monkeypatch):
    q, k, v = _qkv()
    bad, good_k = cu([0, 5, 9, 8]), cu(GOOD_K)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 8")):
        varlen_attention(q, k, v, bad, good_k, **KW)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 8")):
        varlen_fwd(q, k, v, bad, good_k, **KW)
    out, lse = varlen_fwd(q, k, v, cu(GOOD_Q), good_k, **KW)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 8")):
        varlen_bwd(out, q, k, v, out, lse, bad, good_k, **KW)
    grads = varlen_bwd(out, q, k, v, out, lse, cu(GOOD_Q), good_k, **KW)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_layouts_built_by_xattn_skip_the_check_under_plain_jit(monkeypatch):
    """packed_attention and document_causal_fa4_attention build cu_seqlens themselves (an overflow turns
    into NaN); XATTN_CHECK_INPUTS=1 must not break them under jit."""
    monkeypatch.setenv(vc.ENV_VAR, "1")
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 2, 16))
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0, 0], [3, 3, 3, 3, 3, 3, 4, 4]])
    out = jax.jit(lambda x: packed_attention(x, x, x, seg, max_segments=6, scale=0.3, backend="reference"))(x)
    assert jnp.isfinite(out).all()
    doc = jax.jit(lambda x: document_causal_fa4_attention(x, x, x, seg, seg, 0, 0.3, backend="reference"))(x)
    assert doc.shape == x.shape


def test_kernel_path_checked_under_jit_checkify():
    """Through the FFI plumbing (NumPy stand-in): checked good inputs give the unchecked result."""
    _ffi.set_launcher_provider(numpy_launcher.provider)
    try:
        k1, k2, k3 = jax.random.split(jax.random.PRNGKey(2), 3)
        q = jax.random.normal(k1, (TQ, 2, 128), jnp.float16)
        k, v = (jax.random.normal(kk, (TK, 1, 128), jnp.float16) for kk in (k2, k3))
        kw = {**KW, "backend": "kernel"}
        f = lambda cu_q, check: varlen_attention(q, k, v, cu_q, cu(GOOD_K), check_inputs=check, **kw)  # noqa: E731
        err, checked = jax.jit(checkify.checkify(lambda c: f(c, True), errors=checkify.user_checks))(cu(GOOD_Q))
        assert err.get() is None
        np.testing.assert_array_equal(checked, jax.jit(lambda c: f(c, False))(cu(GOOD_Q)))
        err, _ = jax.jit(checkify.checkify(lambda c: f(c, True), errors=checkify.user_checks))(cu([0, 5, 5, 13]))
        assert "cu_seqlens_q[3] = 13 > Tq = 12" in err.get()
    finally:
        _ffi.set_launcher_provider(None)


def test_failed_check_under_checkify_launches_only_empty_segments():
    """checkify does not stop the computation after a failed check: no bad offset may reach a kernel."""
    f = jax.jit(checkify.checkify(lambda c: varlen._check_values(c, cu(GOOD_K), TQ, TK, 7, 6),
                                  errors=checkify.user_checks))
    err, (cq, ck) = f(cu([0, 5, 5, 13]))
    assert "Tq = 12" in err.get() and cq.tolist() == [0, 0, 0, 0] and ck.tolist() == [0, 0, 0, 0]
    err, (cq, ck) = f(cu(GOOD_Q))
    assert err.get() is None and cq.tolist() == GOOD_Q and ck.tolist() == GOOD_K
    err, (cq, _) = checkify.checkify(lambda c: varlen._check_values(c, cu(GOOD_K), TQ, TK, 7, 6),
                                     errors=checkify.user_checks)(cu([0, 5, 5, 13]))  # eager checkify
    assert err.get() and cq.tolist() == [0, 0, 0, 0]
