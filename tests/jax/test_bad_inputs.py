"""The bad-input battery of xattn.jax on the CPU: ``ffpa_attention`` / ``flash_attention`` (dense),
``varlen_attention`` and the jax.nn drop-in ``dot_product_attention``, on the kernel path.

The launchers are the NumPy stand-in registered through jax-tvm-ffi (``numpy_launcher.py``), so the
real FFI plumbing runs; the stand-in records every launch. Each case is a named error or a correct
result (out and gradients vs the fp64 reference of ``tests/reference.py``), followed by a good call.
Sizes past the kernels' limits are tried shape-only (``jax.eval_shape``): nothing is allocated.
``test_bad_inputs_gpu.py`` runs the same tables on the real kernels."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch

import xattn.jax as xj
from tests.bad_input_table import TABLE, VARLEN_TABLE, Ops, cases
from tests.battery import case, raises, unmarked
from tests.reference import attention as ref_attention, rel_err, varlen_attention as ref_varlen
from xattn.core.spec import canonical_mask
from xattn.jax import _ffi

from . import numpy_launcher

jax = pytest.importorskip("jax")
jnp = jax.numpy

TOL = 2e-2


@pytest.fixture
def standin():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    numpy_launcher.CALLS.clear()
    yield
    _ffi.set_launcher_provider(None)


def half(device):
    """The NumPy stand-in speaks float16 (NumPy has no bfloat16); the GPU kernels are bf16 builds."""
    return jnp.float16 if device == "cpu" else jnp.bfloat16


def randn(shape, dtype, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed + sum(shape)), shape, jnp.float32).astype(dtype)


def _dense(b=2, nq=8, nk=12, hq=4, hkv=1, d=512, dv=None, dtype=None, fn="ffpa", **kw):
    """``[B, N, H, D]`` inputs for ``ffpa_attention`` (FFPA d512 GQA 4) or ``flash_attention``."""
    def make(device):
        dt = dtype or half(device)
        q, k = randn((b, nq, hq, d), dt), randn((b, nk, hkv, d), dt, 1)
        v = randn((b, nk, hkv, dv or d), dt, 2)
        return fn, (q, k, v), dict(kw)
    return make


def _fa4(**kw):
    return _dense(**{"hq": 8, "hkv": 2, "d": 128, "causal": True, "fn": "fa4", **kw})


def _window(**kw):
    return _dense(**{"hq": 4, "hkv": 2, "d": 256, "window_size": (63, 0), "fn": "fa4", **kw})


def _change(make, fn):
    def changed(device):
        name, (q, k, v), kw = make(device)
        return (name, *fn(q, k, v, kw))
    return changed


def _shapes(shape_q, shape_k, fn="ffpa", grad=False, **kw):
    """Shape-only inputs (``jax.eval_shape``, of the gradient with ``grad``): sizes no memory could hold."""
    def make(device):
        sd = [jax.ShapeDtypeStruct(s, half(device)) for s in (shape_q, shape_k, shape_k)]
        return fn, tuple(sd), {"_shape_only": "grad" if grad else "fwd", **kw}
    return make


def _varlen(cu_q=(0, 4, 10), cu_k=(0, 6, 14), max_q=6, max_k=8, tq=None, tk=None, cu_dtype=np.int32, **kw):
    """Packed FA4 d128 GQA 4 causal (the precompiled varlen GPU config)."""
    def make(device):
        dt = half(device)
        q = randn((cu_q[-1] if tq is None else tq, 8, 128), dt)
        nk = cu_k[-1] if tk is None else tk
        k, v = randn((nk, 2, 128), dt, 1), randn((nk, 2, 128), dt, 2)
        extra = dict(cu_seqlens_q=np.asarray(cu_q, cu_dtype), cu_seqlens_k=np.asarray(cu_k, cu_dtype),
                     max_seqlen_q=max_q, max_seqlen_k=max_k, family="fa4", causal=True)
        return "varlen", (q, k, v), {**extra, **kw}
    return make


def _dpa(b=2, t=8, s=12, n=4, kh=1, h=512, **kw):
    """jax.nn layout ``[B, T, N, H]``, non-causal (top-left vs bottom-right does not matter)."""
    return _change(_dense(b, t, s, n, kh, h), lambda q, k, v, _: ((q, k, v), dict(kw)))


def _as(name, make):
    return lambda device: (name, *make(device)[1:])


class _JaxOps(Ops):
    def cast(self, x, dtype):
        return x.astype(getattr(np, dtype)) if isinstance(x, np.ndarray) else x.astype(getattr(jnp, dtype))

    def tile_heads(self, x, n):
        return jnp.tile(x, (1, 1, n, 1))


def _named(make):
    """``make`` taking the table's dtype names (``dtype``: jnp, ``cu_dtype``: NumPy) too."""
    def build(**kw):
        mod = {"dtype": jnp, "cu_dtype": np}
        return make(**{n: getattr(mod[n], x) if n in mod and isinstance(x, str) else x for n, x in kw.items()})
    return build


BUILD = {"dense": _named(_dense), "fa4": _named(_fa4), "window": _named(_window), "varlen": _named(_varlen),
         "shapes": lambda q, k: _shapes(q, k)}
_EDIT = lambda make, fn: _change(make, fn)  # noqa: E731  (the table's edits take (q, k, v, kw) as _change does)

DENSE = cases(TABLE, "jax", BUILD, _EDIT, _JaxOps(), "scale") + [  # JAX-only; the shared ones: tests/bad_input_table.py
    case("numpy-inputs", _change(_dense(), lambda q, k, v, kw: (tuple(np.asarray(t) for t in (q, k, v)), kw))),
    case("flash-attention-head-dim-512", _dense(fn="fa4"), NotImplementedError, "FA4", "512/512"),
    case("scale-numpy-float32", _dense(scale=np.float32(0.05))),
    case("huge-fa4-backward-workspace", _shapes((1, 2 ** 23, 2, 256), (1, 64, 1, 256), fn="fa4", grad=True,
                                                window_size=(63, 0)),
         ValueError, "workspace[dq_accum]", "32-bit"),
]

VARLEN = cases(VARLEN_TABLE, "jax", BUILD, _EDIT, _JaxOps(), "scale") + [
    case("varlen-max-seqlen-float", _varlen(max_q=6.0), ValueError, "max_seqlen_q"),
    case("varlen-head-dim-72", _change(_varlen(), lambda q, k, v, kw: ((q[..., :72], k[..., :72], v[..., :72]), kw)),
         NotImplementedError, "72"),
]

DPA = [
    case("dpa-empty-batch", _as("dpa", _dpa(b=0))),
    case("dpa-zero-q-len", _as("dpa", _dpa(t=0))),
    case("dpa-zero-k-len", _as("dpa", _dpa(s=0))),
    case("dpa-no-batch-dim", _change(_as("dpa", _dpa(b=1)), lambda q, k, v, kw: ((q[0], k[0], v[0]), kw))),
    case("dpa-rank-2", _change(_as("dpa", _dpa()), lambda q, k, v, kw: ((q[0, 0], k[0, 0], v[0, 0]), kw)),
         ValueError, "query/key/value", "ranks >= 3"),
    # the cases jax.nn's own XLA call would run (a fallback, with a warning); strict=True refuses them
    case("dpa-head-dim-72-strict", _as("dpa", _dpa(h=72, strict=True)), NotImplementedError, "72/72", "strict"),
    case("dpa-scale-nan", _as("dpa", _dpa(scale=math.nan)), ValueError, "scale"),
    case("dpa-scale-zero", _as("dpa", _dpa(scale=0.0)), ValueError, "scale"),
    case("dpa-fp32-strict", _change(_as("dpa", _dpa(strict=True)), lambda q, k, v, kw: (
        tuple(t.astype(jnp.float32) for t in (q, k, v)), kw)), NotImplementedError, "float32", "strict"),
    case("dpa-mask-on-kernels-strict", _change(_as("dpa", _dpa(strict=True)), lambda q, k, v, kw: (
        (q, k, v), {**kw, "mask": jnp.ones((8, 12), bool)})), ValueError, "mask/bias", "strict"),
    case("dpa-is-causal-string", _as("dpa", _dpa(is_causal="yes")), TypeError, "is_causal"),
    case("dpa-window-string", _as("dpa", _dpa(local_window_size="8")), TypeError, "local_window_size"),
    case("dpa-lengths-float", _as("dpa", _dpa(key_value_seq_lengths=jnp.array([3.0, 4.0]))), TypeError,
         "key_value_seq_lengths"),
    case("dpa-dropout-strict", _as("dpa", _dpa(dropout_rate=0.1, deterministic=False, strict=True)),
         NotImplementedError, "dropout", "strict"),
    case("dpa-gqa-ratio-not-dividing", _as("dpa", _dpa(kh=3)), ValueError, "key", "multiple"),
]


# --- running a case -----------------------------------------------------------------------------

def _call(name, q, k, v, kw):
    kw = {n: x for n, x in kw.items() if n != "_shape_only"}
    backend = kw.pop("_backend", "kernel")
    if name == "ffpa":
        return xj.ffpa_attention(q, k, v, backend=backend, **kw)
    if name == "fa4":
        return xj.flash_attention(q, k, v, backend=backend, **kw)
    if name == "dpa":
        return xj.dot_product_attention(q, k, v, backend=backend, **kw)
    cu_q, cu_k = kw.pop("cu_seqlens_q"), kw.pop("cu_seqlens_k")
    return xj.varlen_attention(q, k, v, cu_q, cu_k, backend=backend, **kw)


def _torch(x):
    return torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32), np.float64)).requires_grad_()


def _reference(name, q, k, v, kw):
    """fp64 out of the call (bottom-right masks; the dpa cases are non-causal)."""
    d = q.shape[-1]
    scale = kw.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    causal, left, right = canonical_mask(bool(kw.get("causal", False)), *kw.get("window_size", (None, None)))
    if name == "varlen":
        return ref_varlen(q, k, v, torch.tensor(np.asarray(kw["cu_seqlens_q"])),
                          torch.tensor(np.asarray(kw["cu_seqlens_k"])), scale=scale, causal=causal,
                          window=(left, right))[0]
    if q.dim() == 3:  # dpa without a batch dim
        return ref_attention(q[None], k[None], v[None], scale=scale)[0][0]
    return ref_attention(q, k, v, scale=scale, causal=causal, window=(left, right))[0]


def close(got, want, what):
    got = torch.from_numpy(np.asarray(jnp.asarray(got, jnp.float32), np.float64))
    assert tuple(got.shape) == tuple(want.shape), (what, got.shape, want.shape)
    if want.numel():
        err = rel_err(got, want.detach())
        assert err < TOL, f"{what}: rel. err {err:.2e} >= {TOL}"


def check_result(name, args, kw, bwd_error=None):
    out = _call(name, *args, dict(kw))  # as given (NumPy arrays too), eagerly
    q, k, v = (jnp.asarray(t) for t in args)
    ref_in = [_torch(t) for t in (q, k, v)]
    ref = _reference(name, *ref_in, kw)
    close(out, ref, "out")
    dout = randn(out.shape, jnp.float32, 7)
    loss = lambda q, k, v: (_call(name, q, k, v, dict(kw)).astype(jnp.float32) * dout).sum()  # noqa: E731
    if bwd_error is not None:
        with pytest.raises(bwd_error):
            jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = torch.autograd.grad(ref, ref_in, _torch(dout).detach(), allow_unused=True) if ref.requires_grad \
        else (None, None, None)
    for what, g, w, t in zip(("dq", "dk", "dv"), grads, want, ref_in):
        close(g, torch.zeros_like(t) if w is None else w, what)


@functools.cache
def _good_fns():
    f = lambda q, k, v: xj.ffpa_attention(q, k, v, backend="kernel")  # noqa: E731
    grad = jax.grad(lambda q, k, v, dout: (f(q, k, v).astype(jnp.float32) * dout).sum(), argnums=(0, 1, 2))
    return jax.jit(f), jax.jit(grad)


def good_call(device="cpu"):
    """The same process must still compute right after any refused or failed call (one compile)."""
    _, (q, k, v), _ = _dense(b=1, nq=16, nk=20)(device)
    fwd, grad = _good_fns()
    out = fwd(q, k, v)
    ref_in = [_torch(t) for t in (q, k, v)]
    ref = _reference("ffpa", *ref_in, {})
    close(out, ref, "out")
    dout = randn(out.shape, jnp.float32, 7)
    want = torch.autograd.grad(ref, ref_in, _torch(dout).detach())
    for what, g, w in zip(("dq", "dk", "dv"), grad(q, k, v, dout), want):
        close(g, w, what)


def run(c, device):
    name, args, kw = c.make(device)
    fn = lambda *a: _call(name, *a, dict(kw))  # noqa: E731
    if kw.get("_shape_only") == "grad":
        fn = jax.grad(lambda *a: _call(name, *a, dict(kw)).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    call = (lambda: jax.eval_shape(fn, *args)) if kw.get("_shape_only") else (lambda: fn(*args))
    if c.error is not None:
        with raises(c.error, *c.words):
            call()
    else:
        check_result(name, args, kw, c.bwd_error)
    good_call(device)


@pytest.mark.parametrize("c", DENSE + VARLEN + DPA)
def test_jax(c, standin):
    run(c, "cpu")


@pytest.mark.parametrize("c", unmarked([p for p in DENSE + DPA if p.values[0].error is None
                                        and ("zero" in p.id or "empty" in p.id)]))
def test_empty_or_keyless_calls_launch_nothing(c, standin):
    """No kernel launch for B = 0, Nq = 0 or Nk = 0 (an empty CUDA grid is a launch error; FA4's
    dk/dv of a launch without query rows would stay unwritten): the front end writes 0 / -inf."""
    name, args, kw = c.make("cpu")
    loss = lambda q, k, v: _call(name, q, k, v, dict(kw)).astype(jnp.float32).sum()  # noqa: E731
    jax.block_until_ready(jax.grad(loss, argnums=(0, 1, 2))(*args))
    assert numpy_launcher.CALLS == []


@pytest.mark.parametrize("c", unmarked(DENSE + VARLEN))
def test_auto_off_the_gpu_refuses_what_the_kernels_refuse(c, standin):
    """backend="auto" on a machine without a GPU runs the reference, under the kernels' rules: every
    case the kernels refuse is refused with the same named error, every other one is right (a laptop
    run passes exactly where the GPU run will)."""
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present: auto runs the kernels (test_jax)")
    run(dataclasses.replace(c, make=_change(c.make, lambda q, k, v, kw: ((q, k, v), {**kw, "_backend": "auto"}))),
        "cpu")


def test_reference_by_name_takes_what_the_kernels_do_not():
    """backend="reference" asked for by name is the yardstick: float32 and head dims no kernel has run."""
    q = randn((1, 6, 4, 128), jnp.float32)
    out = xj.ffpa_attention(q, q, q, backend="reference")
    close(out, _reference("ffpa", *(_torch(q),) * 3, {}), "out")
    with raises(NotImplementedError, "320-512", "128"):
        xj.ffpa_attention(q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), q.astype(jnp.bfloat16), backend="auto")


def test_kernel_backend_without_a_gpu_says_so_before_compiling(monkeypatch):
    """On a machine without a GPU, backend='kernel' names the problem at once (it used to compile for
    seconds, then fail with XLA's NOT_FOUND for a handler on the Host platform)."""
    from xattn.jax import _ffi

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present")
    compiled = []
    monkeypatch.setattr("xattn.core.get_launcher", lambda spec: compiled.append(spec))
    _ffi.set_launcher_provider(None)
    z = jnp.zeros((1, 8, 4, 512), jnp.bfloat16)
    with pytest.raises(RuntimeError, match="backend='kernel' needs a CUDA GPU"):
        xj.ffpa_attention(z, z, z, backend="kernel")
    assert compiled == []


@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_gqa_groups_are_checked_on_every_backend(backend):
    q, kv = jnp.zeros((1, 8, 4, 512), jnp.bfloat16), jnp.zeros((1, 8, 3, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="Hkv=3 must divide Hq=4"):
        xj.ffpa_attention(q, kv, kv, backend=backend)
