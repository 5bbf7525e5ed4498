"""The cases of JAX's own tests of ``jax.nn.dot_product_attention`` (``tests/nn_test.py``:
``testDotProductAttention`` and ``testDotProductAttentionMask``), rewritten for xattn: the same grid,
shapes, masks and tolerances, run at head dims 32 and 128, with jax.nn's XLA implementation as the
reference. Shared by the CPU twin (``test_nn_upstream.py``) and the GPU run (``test_nn_upstream_gpu.py``).

Upstream, per case: B=2, T=S=128, N=4 query heads, H=32. ``testDotProductAttention``: dtype bf16/fp16 x
GQA groups 1/2/4 x vmap over the batch or not (12 cases), output, residual (logsumexp) and the
gradients of q/k/v against jax.nn at atol = rtol = 0.01. ``testDotProductAttentionMask``: bf16, MHA, one
mask mode each (8 cases): bias ``[1, N, T, S]``; causal; padding (query lengths [T/2, T/4], key lengths
[S/4, S/2]: rows past a short key length); a custom causal mask array; causal + padding; custom +
padding; bias + causal; causal + sliding window (3, 2). Tolerances: out 0.01, dq 0.02, dk 0.02, dv 0.01,
dbias 0.02. Padded query rows are compared too (jax.nn returns 0 there, so must we).
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

B, T, S, N = 2, 128, 128, 4
HEAD_DIMS = (32, 128)
MASK_MODES = ("bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "sliding_window"))


@dataclass(frozen=True)
class Case:
    name: str
    head_dim: int
    dtype: object
    groups: int = 1
    vmap: bool = False
    modes: tuple = ()

    @property
    def kind(self) -> str:
        return "mask" if self.modes else "attention"


def cases() -> list[Case]:
    """The 40 cases: (12 attention + 8 mask) x head dims 32 and 128."""
    out = []
    for d in HEAD_DIMS:
        for dtype in (jnp.bfloat16, jnp.float16):
            for groups in (1, 2, 4):
                for vmap in (False, True):
                    out.append(Case(f"attention-{jnp.dtype(dtype).name}-g{groups}{'-vmap' if vmap else ''}-d{d}",
                                    d, dtype, groups, vmap))
        for mode in MASK_MODES:
            modes = mode if isinstance(mode, tuple) else (mode,)
            out.append(Case(f"mask-{'+'.join(modes)}-d{d}", d, jnp.bfloat16, modes=modes))
    return out


def inputs(case: Case, seed: int = 0) -> dict:
    """Fresh normal inputs and the jax.nn keywords of one case."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    d, kh = case.head_dim, N // case.groups
    q = jax.random.normal(keys[0], (B, T, N, d), case.dtype)
    k = jax.random.normal(keys[1], (B, S, kh, d), case.dtype)
    v = jax.random.normal(keys[2], (B, S, kh, d), case.dtype)
    grad = jax.random.normal(keys[3], (B, T, N, d), case.dtype)
    kw = dict(bias=None, mask=None, query_seq_lengths=None, key_value_seq_lengths=None)
    modes = case.modes
    if "bias" in modes:
        kw["bias"] = jax.random.normal(keys[4], (1, N, T, S), case.dtype)
    if "padding" in modes:
        kw["query_seq_lengths"] = jnp.array([T // 2, T // 4], jnp.int32)
        kw["key_value_seq_lengths"] = jnp.array([S // 4, S // 2], jnp.int32)
    if "custom" in modes:
        kw["mask"] = jnp.tril(jnp.ones((T, S), bool))[None, None]
    static = dict(is_causal="causal" in modes,
                  local_window_size=(3, 2) if "sliding_window" in modes else None)
    return dict(q=q, k=k, v=v, grad=grad, lse_grad=jax.random.normal(keys[5], (B, T, N), case.dtype),
                arrays=kw, static=static)


TOL_ATTENTION = dict(out=0.01, lse=0.01, dq=0.01, dk=0.01, dv=0.01)
TOL_MASK = dict(out=0.01, dq=0.02, dk=0.02, dv=0.01, dbias=0.02)


def _outputs(fn, case: Case, x: dict, jit: bool) -> dict:
    """Output (and residual) and the vjp gradients of ``fn`` as jax.nn's tests take them."""
    arrays, static = x["arrays"], x["static"]
    if case.kind == "attention":
        def run(q, k, v):
            ans = fn
            if case.vmap:
                ans = jax.vmap(fn, in_axes=(0, 0, 0))
            return ans(q, k, v)

        def run_lse(q, k, v):
            return fn(q, k, v, return_residual=True)
        run, run_lse = (jax.jit(f) if jit else f for f in (run, run_lse))
        out, vjp = jax.vjp(run, x["q"], x["k"], x["v"])
        dq, dk, dv = vjp(x["grad"])
        (out2, lse), vjp2 = jax.vjp(run_lse, x["q"], x["k"], x["v"])
        grads2 = vjp2((x["grad"], x["lse_grad"]))
        return dict(out=out, dq=dq, dk=dk, dv=dv, lse=lse, out_lse=out2, dq_lse=grads2[0], dk_lse=grads2[1],
                    dv_lse=grads2[2])

    def run_mask(q, k, v, bias):
        return fn(q, k, v, bias, arrays["mask"], query_seq_lengths=arrays["query_seq_lengths"],
                  key_value_seq_lengths=arrays["key_value_seq_lengths"], **static)
    run_mask = jax.jit(run_mask) if jit else run_mask
    out, vjp = jax.vjp(run_mask, x["q"], x["k"], x["v"], arrays["bias"])
    dq, dk, dv, dbias = vjp(x["grad"])
    return dict(out=out, dq=dq, dk=dk, dv=dv, dbias=dbias)


def _close(name: str, got, want, tol: float) -> str | None:
    if got is None or want is None:
        return None if got is None and want is None else f"{name}: one side is None"
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if got.shape != want.shape:
        return f"{name}: shape {got.shape} != {want.shape}"
    if not np.isfinite(got).all():
        return f"{name}: {int((~np.isfinite(got)).sum())} non-finite values"
    bad = np.abs(got - want) > tol + tol * np.abs(want)
    if bad.any():
        return (f"{name}: {int(bad.sum())} of {bad.size} outside atol=rtol={tol} "
                f"(max |diff| {np.abs(got - want).max():.3g})")
    return None


@dataclass
class Result:
    case: Case
    route: str  # "kernel", or "fallback: <warning>" (the kernels cannot run it exactly)
    errors: list

    @property
    def verdict(self) -> str:
        return "agree" if not self.errors else "differ"


def _as_f32(x: dict) -> dict:
    cast = lambda a: None if a is None else a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a  # noqa: E731
    return {**{n: cast(x[n]) for n in ("q", "k", "v", "grad", "lse_grad")},
            "arrays": {n: cast(a) for n, a in x["arrays"].items()}, "static": x["static"]}


def run_case(ours, case: Case, jit: bool = True, seed: int = 0, reference_f32: bool = False) -> Result:
    """``ours`` (a jax.nn-signature function) against jax.nn's XLA implementation on one case, under
    ``jax.jit`` unless ``jit=False``; ``reference_f32``: jax.nn runs on the float32 of the same inputs (XLA:CPU
    has no fp16 x fp16 -> fp32 dot under jit). The route is read from xattn's fallback warning (cleared
    first, so each case warns afresh)."""
    from xattn.jax import nn as xnn

    x = inputs(case, seed)
    theirs = functools.partial(jax.nn.dot_product_attention, implementation="xla")
    want = _outputs(theirs, case, _as_f32(x) if reference_f32 else x, jit)
    xnn._FALLBACK_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _outputs(ours, case, x, jit)
    fallbacks = [str(w.message) for w in caught if "xattn.jax.dot_product_attention" in str(w.message)]
    tol = TOL_ATTENTION if case.kind == "attention" else TOL_MASK
    errors = []
    for name, value in got.items():
        if value is not None and jnp.dtype(value.dtype) != jnp.dtype(x["q"].dtype) and name != "dbias":
            errors.append(f"{name}: dtype {value.dtype}, expected {x['q'].dtype}")
        base = name.split("_")[0]
        err = _close(name, value, want[name], tol.get(base, 0.01))
        if err:
            errors.append(err)
    route = "kernel" if not fallbacks else "fallback: " + fallbacks[0].split(": ", 1)[1].split(";")[0]
    return Result(case, route, errors)
