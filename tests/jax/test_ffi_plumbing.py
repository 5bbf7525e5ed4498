"""The kernel path of xattn.jax end to end on the CPU: a NumPy stand-in launcher registered with
jax_tvm_ffi (platform "cpu") replaces the CUDA one, so jit / grad / vmap / vmap(grad), the
aliasing of pre-filled outputs and the folding of vmap into the batch run for real in CI."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi

from . import numpy_launcher

F16 = jnp.float16


@pytest.fixture(autouse=True)
def standin():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    numpy_launcher.CALLS.clear()
    yield
    _ffi.set_launcher_provider(None)


def _qkv(seed, shape_q, shape_k, dtype=F16):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, shape_q, dtype), jax.random.normal(k2, shape_k, dtype),
            jax.random.normal(k3, shape_k, dtype))


def _ref(q, k, v, causal, scale):
    return xj.ffpa_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                             scale=scale, causal=causal, backend="reference")


@pytest.mark.parametrize("causal", [False, True], ids=["full-rets", "causal-aliased"])
def test_forward_and_grad_through_ffi(causal):
    """FFPA: non-causal uses XLA-allocated results; causal passes zeros/-inf as aliased inputs
    (the stand-in asserts the fills arrived) and the backward always aliases dq/dk/dv = 0."""
    q, k, v = _qkv(0, (2, 16, 4, 320), (2, 24, 2, 320))
    f = jax.jit(lambda q, k, v: xj.ffpa_attention(q, k, v, scale=0.05, causal=causal, backend="kernel"))
    out = f(q, k, v).block_until_ready()
    np.testing.assert_allclose(out.astype(np.float32), _ref(q, k, v, causal, 0.05), atol=2e-3)
    loss = lambda fn: (lambda q, k, v: (fn(q, k, v).astype(jnp.float32) ** 2).sum())  # noqa: E731
    kern = jax.jit(jax.grad(loss(lambda q, k, v: xj.ffpa_attention(q, k, v, scale=0.05, causal=causal,
                                                                   backend="kernel")), argnums=(0, 1, 2)))
    ref = jax.grad(loss(lambda q, k, v: _ref(q, k, v, causal, 0.05)), argnums=(0, 1, 2))
    for a, b in zip(kern(q, k, v), ref(q, k, v)):
        jax.block_until_ready(a)
        np.testing.assert_allclose(a.astype(np.float32), b, atol=2e-2, rtol=2e-2)
    assert any(c.startswith("bwd") for c in numpy_launcher.CALLS)


def test_vmap_folds_into_one_launch_and_vmap_grad_is_right():
    """vmap size 3 over batch 2: one launch of batch 6; grads per mapped slice match the reference
    (peers fold as (x n) and unfold as (n x) and get this wrong)."""
    q, k, v = _qkv(1, (3, 2, 8, 4, 128), (3, 2, 12, 2, 128))
    f = lambda q, k, v: xj.flash_attention(q, k, v, scale=0.1, causal=True, backend="kernel")  # noqa: E731
    out = jax.jit(jax.vmap(f))(q, k, v).block_until_ready()
    assert [c for c in numpy_launcher.CALLS if c.startswith("fwd")] == ["fwd:(6, 8, 4, 128)"]
    for i in range(3):
        np.testing.assert_allclose(out[i].astype(np.float32), _ref(q[i], k[i], v[i], True, 0.1), atol=2e-3)
    g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2))))
    grads = g(q, k, v)
    for i in range(3):
        ref = jax.grad(lambda q, k, v: (_ref(q, k, v, True, 0.1) ** 2).sum(), argnums=(0, 1, 2))(q[i], k[i], v[i])
        for a, b in zip(grads, ref):
            np.testing.assert_allclose(a[i].astype(np.float32), b, atol=3e-2, rtol=3e-2)


def test_vmap_with_unmapped_kv_broadcasts():
    q, k, v = _qkv(2, (3, 1, 8, 2, 128), (1, 8, 2, 128))
    out = jax.vmap(lambda q: xj.flash_attention(q, k, v, scale=0.1, backend="kernel"))(q)
    for i in range(3):
        np.testing.assert_allclose(out[i].astype(np.float32), _ref(q[i], k, v, False, 0.1), atol=2e-3)


def test_remat_keeps_named_residuals():
    q, k, v = _qkv(3, (1, 8, 2, 128), (1, 8, 2, 128))
    policy = jax.checkpoint_policies.save_only_these_names("xattn_out", "xattn_lse")
    f = jax.checkpoint(lambda q, k,
                       v: xj.flash_attention(q, k, v, scale=0.1, backend="kernel").astype(jnp.float32).sum(),
                       policy=policy)
    g = jax.jit(jax.grad(f))(q, k, v)
    ref = jax.grad(lambda q: _ref(q, k, v, False, 0.1).sum())(q)
    np.testing.assert_allclose(g.astype(np.float32), ref, atol=2e-2)


def test_low_level_fwd_bwd_use_the_supplied_out_lse():
    q, k, v = _qkv(4, (1, 8, 2, 128), (1, 8, 2, 128))
    out, lse = xj.fa4_fwd(q, k, v, scale=0.1, backend="kernel")
    dout = jnp.ones_like(out)
    dq, dk, dv = xj.fa4_bwd(dout, q, k, v, out, lse, scale=0.1, backend="kernel")
    # a different lse must change the gradients: the backward reads what it is given
    dq2, _, _ = xj.fa4_bwd(dout, q, k, v, out, lse + 1.0, scale=0.1, backend="kernel")
    assert not np.allclose(dq, dq2)
    rq, rk, rv = xj.fa4_bwd(dout, q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                            out.astype(jnp.float32), lse, scale=0.1, backend="reference")
    np.testing.assert_allclose(dq.astype(np.float32), rq, atol=2e-2)


def test_unsupported_config_raises_not_falls_back():
    q, k, v = _qkv(5, (1, 8, 2, 128), (1, 8, 2, 128))
    with pytest.raises(NotImplementedError, match="FFPA supports head_dim 320-512"):
        xj.ffpa_attention(q, k, v, backend="kernel")
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        xj.flash_attention(q.astype(jnp.float32), k, v, backend="kernel")


def test_target_names_are_deterministic():
    q, k, v = _qkv(6, (1, 8, 2, 128), (1, 8, 2, 128))
    xj.flash_attention(q, k, v, scale=0.1, backend="kernel")
    names = _ffi.registered_targets()
    assert any(n.startswith("xattn_fa4_fwd_float16_d128x128_g1_full_dense_sm_90a_") and n.endswith("_cpu")
               for n in names), names


def _buffer_makers(jaxpr):
    """``[(primitive, shape)]`` of the eqns (nested jaxprs included) that make arrays from nothing."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("empty", "broadcast_in_dim") and not any(
                hasattr(v, "aval") and getattr(v.aval, "shape", ()) for v in eqn.invars):
            found += [(eqn.primitive.name, tuple(v.aval.shape)) for v in eqn.outvars]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                found += _buffer_makers(inner)
            elif hasattr(p, "eqns"):
                found += _buffer_makers(p)
    return found


def test_backward_fills_only_the_buffers_that_need_it():
    """FA4 GQA backward: dk_accum/dv_accum (atomic targets) are zero-filled; dq_accum, dpsum and
    lse_log2 (written by the kernel's preprocess) and dq/dk/dv come from ``lax.empty``."""
    from xattn.core.spec import KernelSpec
    from xattn.core.workspace import bwd_workspace_shapes

    q, k, v = _qkv(5, (2, 40, 8, 128), (2, 56, 2, 128))
    out, lse = xj.fa4_fwd(q, k, v, scale=0.1, causal=True, backend="kernel")
    jaxpr = jax.make_jaxpr(lambda *a: xj.fa4_bwd(*a, scale=0.1, causal=True, backend="kernel"))(out, q, k, v, out, lse)
    makers = _buffer_makers(jaxpr.jaxpr)
    spec = KernelSpec("fa4", "bwd", "float16", 128, 128, 4, True, False)
    layout = {name: (tuple(shape), fill) for name, shape, _,
              fill in bwd_workspace_shapes(spec, 2, 40, 56, 80, 112, 8, 2)}
    filled = {shape for shape, fill in layout.values() if fill is not None}
    assert filled == {layout["dk_accum"][0], layout["dv_accum"][0]}
    assert {shape for prim, shape in makers if prim == "broadcast_in_dim"} == filled
    assert {layout["dq_accum"][0], layout["dpsum"][0], q.shape, k.shape} <= {shape for prim,
                                                                             shape in makers if prim == "empty"}
    dq, dk, dv = jax.jit(lambda *a: xj.fa4_bwd(*a, scale=0.1, causal=True, backend="kernel"))(out, q, k, v, out, lse)
    ref = xj.fa4_bwd(*(x.astype(jnp.float32) for x in (out, q, k, v, out)), lse, scale=0.1, causal=True,
                     backend="reference")
    for a, b in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(a.astype(np.float32), b, atol=2e-2, rtol=2e-2)


def test_gpu_targets_are_registered_command_buffer_compatible(monkeypatch):
    seen = {}

    def fake_register(name, function, **kwargs):
        seen[name] = kwargs

    monkeypatch.setattr(_ffi, "_jax_tvm_ffi",
                        lambda: type("M", (), {"register_ffi_target": staticmethod(fake_register)}))
    monkeypatch.setattr(_ffi, "_registered", {})
    _ffi.set_launcher_provider(lambda spec: (object(), "gpu"))
    q, k, v = _qkv(6, (1, 8, 2, 128), (1, 8, 2, 128))
    jax.make_jaxpr(lambda q, k, v: xj.flash_attention(q, k, v, causal=True, backend="kernel"))(q, k, v)
    assert seen and all(kw["allow_cuda_graph"] and kw["platform"] == "gpu" for kw in seen.values())


@pytest.mark.parametrize("gpus, allowed", [(0, True), (1, True), (2, False), (8, False)])
def test_command_buffer_capture_only_with_one_visible_gpu(monkeypatch, gpus, allowed):
    """With 2+ GPUs a launcher's first call loads onto every GPU under one lock; inside command-buffer
    captures on two GPUs that deadlocked (2xH200), so the targets are registered capture-free there."""
    from xattn.core import device

    seen = {}
    monkeypatch.setattr(device, "cuda_gpus", lambda: tuple(range(gpus)))
    monkeypatch.setattr(_ffi, "_jax_tvm_ffi", lambda: type("M", (), {"register_ffi_target": staticmethod(
        lambda name, function, **kw: seen.setdefault(name, kw))}))
    monkeypatch.setattr(_ffi, "_registered", {})
    _ffi.set_launcher_provider(lambda spec: (object(), "gpu"))
    q, k, v = _qkv(6, (1, 8, 2, 128), (1, 8, 2, 128))
    jax.make_jaxpr(jax.grad(lambda q, k, v: xj.flash_attention(q, k, v, causal=True, backend="kernel").sum()))(q, k, v)
    assert len(seen) == 2 and all(kw["allow_cuda_graph"] is allowed for kw in seen.values())
    assert _ffi.capture_allowed("cpu") is False


def test_equivalent_mask_spellings_run_one_launcher():
    """causal + (4, None) is the window (4, 0), and the window (None, 0) is causal: the same kernel as torch and
    the core use (before: NotImplementedError, resp. a separate local-window launcher)."""
    q, k, v = _qkv(7, (1, 12, 2, 128), (1, 12, 2, 128))
    pairs = [(dict(causal=True, window_size=(4, None)), dict(causal=False, window_size=(4, 0))),
             (dict(causal=False, window_size=(None, 0)), dict(causal=True))]
    for a, b in pairs:
        numpy_launcher.CALLS.clear()
        out_a = xj.flash_attention(q, k, v, scale=0.1, backend="kernel", **a)
        calls_a = list(numpy_launcher.CALLS)
        numpy_launcher.CALLS.clear()
        out_b = xj.flash_attention(q, k, v, scale=0.1, backend="kernel", **b)
        assert calls_a == numpy_launcher.CALLS and np.array_equal(np.asarray(out_a), np.asarray(out_b))
    names = {n for n in _ffi.registered_targets() if "w4_0" in n or "causal" in n}
    assert not any("wNone_0" in n for n in _ffi.registered_targets()), names
