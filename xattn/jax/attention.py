"""Dense attention for JAX: ``custom_vjp`` functions over the core's launchers (XLA FFI).

Glossary: B batch, Nq/Nk lengths, Hq/Hkv heads (Hq % Hkv == 0), D q/k head dim, Dv v head
dim. Layout ``[B, N, H, D]`` like ``jax.nn.dot_product_attention``; lse fp32 ``[B, Hq, Nq]``.
Causal and sliding windows are **bottom-right aligned** when Nq != Nk (FlashAttention's
convention; ``jax.nn`` is top-left): query i sees key j iff j <= i + Nk - Nq.

``backend``: ``"kernel"`` (the CuTeDSL kernels through XLA FFI; GPU), ``"reference"``
(:mod:`xattn.jax.reference`, pure jnp, any device), ``"auto"`` (kernel on GPU, reference on
other platforms). ``"kernel"`` and ``"auto"`` check every call against the kernels on every
platform: what the GPU would refuse (dtype other than fp16/bf16, head dims outside the family,
Hkv not dividing Hq, sizes past the kernels' limits) raises the same named error on a laptop, so
code tested off-GPU runs on one; nothing falls back silently. ``"reference"`` asked for by name is a
yardstick, not a twin: it computes any head dim and float32 too.

Determinism: forwards and the FFPA backward are bitwise reproducible; the FA4 backward is not (fp32
reduce-add of dQ / GQA dK/dV partials). ``XATTN_DETERMINISTIC=1`` (or XLA's
``--xla_gpu_deterministic_ops=true`` in ``XLA_FLAGS``) makes tracing an FA4 backward on the kernels
raise, ``=warn`` warn; see :mod:`xattn.jax.determinism`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_batching import custom_vmap

from xattn.core import gemm_bwd_plan, routes
from xattn.core.checks import Memo, Meta, Problem, check_layout_sizes, check_scale, check_window, validate
from xattn.core.spec import KernelSpec, canonical_mask
from xattn.core.workspace import bwd_workspace_shapes

from . import _ffi
from .determinism import check_backward, deterministic_mode
from .reference import attention_reference, attention_reference_bwd

_log = logging.getLogger("xattn")

__all__ = ["ffpa_attention", "flash_attention", "ffpa_fwd", "ffpa_bwd", "fa4_fwd", "fa4_bwd"]

_DTYPES = {jnp.dtype(jnp.bfloat16): "bfloat16", jnp.dtype(jnp.float16): "float16"}
RESIDUAL_NAMES = ("xattn_q", "xattn_k", "xattn_v", "xattn_out", "xattn_lse")


def static_scale(scale, head_dim: int) -> float:
    """``scale`` as a static float (``None``: ``1/sqrt(head_dim)``): the core's one scale check
    (:func:`xattn.core.checks.check_scale`) under jax.nn's name; a traced array is refused by name."""
    return check_scale(scale, name="scale", head_dim=head_dim)


@dataclass(frozen=True)
class Config:
    """Static (hashable) options of one attention call."""

    family: str
    scale: float
    causal: bool = False
    window: tuple = (None, None)
    backend: str = "kernel"
    # XATTN_DETERMINISTIC / XLA_FLAGS as read when the call was made; part of the key of every trace
    # cache, so changing the mode retraces instead of reusing a backward traced under the old one
    deterministic: str = field(default_factory=deterministic_mode)
    # XATTN_BWD_ROUTE (or routes.forced) and the block budget as set when the call was made, unread until a
    # backward is traced (a bad value never breaks a forward): a change retraces instead of reusing a backward
    # traced with the old route
    bwd_route: tuple = field(default_factory=lambda: (routes.requested(), gemm_bwd_plan.budget_setting()))
    # XATTN_FWD_ROUTE (or routes.forced_forward) as set when the call was made; num_splits: FlashAttention's
    # (0 auto, 1 off, n > 1 splits) for the split-KV forward route (xattn.core.split_kv)
    fwd_route: str = field(default_factory=routes.requested_forward)
    num_splits: int = 0
    # the kernels' rules (dtype, head dims, sizes) apply whatever the backend; False only for
    # backend="reference" asked for by name (the pure-jnp yardstick: any head dim, float32 too)
    kernel_rules: bool = True

    def __post_init__(self):
        object.__setattr__(self, "scale", static_scale(self.scale, 0))  # every route (nn, varlen, ring) too

    def checked(self, direction: str, q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
             max_seqlen_k=None) -> tuple[KernelSpec, Problem]:
        """``(spec, problem)`` of this call from the core's one validator (:func:`xattn.core.checks.validate`:
        TypeError for dtypes, ValueError for shapes and sizes, NotImplementedError for configurations no
        kernel runs), memoised by the arrays' metadata; varlen calls pass cu_seqlens and max_seqlen. Without
        ``kernel_rules`` (the reference by name) only the shape rules apply. On the kernel backend, the
        backward also applies the deterministic mode (:mod:`xattn.jax.determinism`)."""
        cu = None if cu_seqlens_q is None else (_meta(cu_seqlens_q), _meta(cu_seqlens_k), max_seqlen_q, max_seqlen_k)
        checked = _validated(self.family, direction, _meta(q), _meta(k), _meta(v), self.causal, self.window, cu,
                          self.kernel_rules)
        if direction == "bwd" and self.backend == "kernel":
            check_backward(checked[0], self.deterministic)  # XATTN_DETERMINISTIC: raise/warn if nondeterministic
        return checked

    def spec(self, direction: str, q, k, v, *varlen_args) -> KernelSpec:
        """The launcher spec of :meth:`checked`."""
        return self.checked(direction, q, k, v, *varlen_args)[0]

    def budget(self) -> int:
        """The GEMM backward's block budget in bytes (validated here, when a backward is traced)."""
        return gemm_bwd_plan.budget_bytes(self.bwd_route[1])


def _meta(x) -> Meta:
    return Meta(tuple(x.shape), jnp.dtype(x.dtype).name)


_VALIDATED = Memo()  # the call's metadata -> (spec, problem) from the core's validator


def _validated(family, direction, q, k, v, causal, window, varlen, kernel_rules):
    key = (family, direction, q, k, v, causal, window, varlen, kernel_rules)
    hit = _VALIDATED.get(key)
    if hit is None:
        cu = {}
        if varlen is not None:
            cu = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), varlen))
        hit = _VALIDATED.put(key, validate(family, direction, q, k, v, causal=causal, window=window,
                                           allow_no_keys=True, kernel_rules=kernel_rules, **cu))
    return hit


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"kernel"`` on GPU, ``"reference"`` elsewhere; validates the name."""
    if backend not in ("auto", "kernel", "reference"):
        raise ValueError(f"backend: expected 'auto', 'kernel' or 'reference', got {backend!r}")
    if backend == "auto":
        return "kernel" if jax.default_backend() == "gpu" else "reference"
    return backend


def check_dense(q, k, v) -> None:
    """q, k, v are arrays (JAX or NumPy); their ranks, shapes and dtypes are the core validator's
    (:meth:`Config.checked`), which every public function runs on them."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name}: expected a JAX or NumPy array, got {type(x).__name__}")


# --- kernels through XLA FFI, with vmap folded into the batch dim (one launch) -------------

def _no_launch(q, k) -> bool:
    """No query row (nothing to compute) or no key at all (every row sees none): no kernel launches,
    which also keeps empty grids off the GPU. Shapes are static, so this is decided at trace time."""
    return q.shape[0] * q.shape[1] == 0 or k.shape[1] == 0


def _fwd_call(cfg: Config, q, k, v):
    spec = cfg.spec("fwd", q, k, v)
    b, nq, hq, _ = q.shape
    if _no_launch(q, k):  # rows that see no key: out 0, lse -inf
        return jnp.zeros((b, nq, hq, v.shape[-1]), q.dtype), jnp.full((b, hq, nq), -jnp.inf, jnp.float32)
    route = _fwd_route(cfg, spec, q, k)
    if route.name == "split-kv":
        from .split_kv import split_forward

        return split_forward(cfg, route.plan, q, k, v)
    outs = [("out", (b, nq, hq, v.shape[-1]), q.dtype), ("lse", (b, hq, nq), "float32")]
    out, lse = _ffi.call(spec, [q, k, v], outs, [], cfg.scale)
    return out, lse


def _fwd_route(cfg: Config, spec: KernelSpec, q, k) -> routes.Route:
    """The forward route of a dense call (:func:`xattn.core.routes.forward_route`; static shapes: trace time)."""
    from .split_kv import num_sms

    b, nq, hq, _ = q.shape
    problem = routes.FwdProblem(spec.family, b, k.shape[2], spec.qhead_per_kvhead, nq, k.shape[1], causal=spec.causal,
                                local=spec.is_local, num_sms=num_sms(), num_splits=cfg.num_splits)
    route = routes.forward_route(problem, cfg.fwd_route)
    _log.debug("xattn forward route %s: %s", route.name, route.reason)
    return route


def _bwd_setup(cfg: Config, q, k, v):
    """``(spec, route, workspace)`` of a dense backward (:func:`xattn.core.routes.backward_route`), or the
    kernels' named error (the spec's rules, and a workspace past 32-bit indexing); the reference backend runs it
    too, for its errors."""
    spec = cfg.spec("bwd", q, k, v)
    b, nq, hq, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    problem = routes.BwdProblem(spec.family, spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead, spec.causal,
                                (spec.window_left, spec.window_right), "dense", seqlen_k=nk)
    route = routes.backward_route(problem, cfg.bwd_route[0])
    ws = [] if route.name != "fused" else bwd_workspace_shapes(spec, b, nq, nk, b * nq, b * nk, hq, hkv)
    check_layout_sizes(ws)
    return spec, route, ws


def _bwd_call(cfg: Config, dout, q, k, v, out, lse):
    if _no_launch(q, k):  # no row or no key: every gradient is 0
        cfg.spec("bwd", q, k, v)
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
    spec, route, ws = _bwd_setup(cfg, q, k, v)
    _log.debug("xattn backward route %s: %s", route.name, route.reason)
    if route.name == "gemm":
        from .gemm_bwd import gemm_backward

        return gemm_backward(dout, q, k, v, out, lse, softmax_scale=cfg.scale, causal=cfg.causal,
                             budget=cfg.budget())
    outs = [("dq", q.shape, q.dtype), ("dk", k.shape, k.dtype), ("dv", v.shape, v.dtype)]
    dq, dk, dv = _ffi.call(spec, [dout, q, k, v, out, lse], outs, ws, cfg.scale)
    return dq, dk, dv


def _fold_batch(fn):
    """custom_vmap: fold the mapped axis into B (mapped-axis major), launch once, unfold."""
    wrapped = custom_vmap(fn)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        full = [a if bat else jnp.broadcast_to(a, (axis_size, *a.shape)) for a, bat in zip(args, in_batched)]
        folded = [a.reshape(axis_size * a.shape[1], *a.shape[2:]) for a in full]
        outs = wrapped(*folded)
        return tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs), (True,) * len(outs)

    return wrapped


@functools.lru_cache(maxsize=None)
def _kernels(cfg: Config):
    return (_fold_batch(functools.partial(_fwd_call, cfg)), _fold_batch(functools.partial(_bwd_call, cfg)))


def forward_call(cfg: Config, q, k, v):
    """``(out [B, Nq, Hq, Dv], lse fp32 [B, Hq, Nq])`` of one dense call on ``cfg``'s backend (inputs
    already checked); the building block of the custom_vjp functions, :mod:`.nn` and :mod:`.ring`."""
    if cfg.backend == "reference":
        cfg.checked("fwd", q, k, v)  # the one validator; under kernel_rules, what the kernels would refuse too
        return attention_reference(q, k, v, scale=cfg.scale, causal=cfg.causal, window=cfg.window)
    out, lse = _kernels(cfg)[0](q, k, v)
    return out, lse


def backward_call(cfg: Config, dout, q, k, v, out, lse):
    """``(dq, dk, dv)`` of one dense call from the given out/lse (dk/dv per KV head), on ``cfg``'s
    backend and backward route; inputs already checked, as :func:`forward_call`."""
    if cfg.backend == "reference":
        if cfg.kernel_rules:
            _bwd_setup(cfg, q, k, v)  # the validator, and the kernels' workspace limits
        else:
            cfg.checked("bwd", q, k, v)
        return attention_reference_bwd(dout, q, k, v, out, lse, scale=cfg.scale, causal=cfg.causal,
                                       window=cfg.window)
    dq, dk, dv = _kernels(cfg)[1](dout, q, k, v, out, lse)
    return dq, dk, dv


# --- the differentiable function --------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg: Config, q, k, v):
    return forward_call(cfg, q, k, v)[0]


def _attention_fwd(cfg: Config, q, k, v):
    out, lse = forward_call(cfg, q, k, v)
    res = tuple(checkpoint_name(x, n) for x, n in zip((q, k, v, out, lse), RESIDUAL_NAMES))
    return out, res


def _attention_bwd(cfg: Config, res, dout):
    q, k, v, out, lse = res
    return backward_call(cfg, dout, q, k, v, out, lse)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _config(family, q, scale, causal, window, backend) -> Config:
    scale = static_scale(scale, q.shape[-1] if q.ndim else 0)
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")
    causal, left, right = canonical_mask(causal, *check_window(window))  # one spelling per mask, as torch and the core
    return Config(family, scale, causal, (left, right), resolve_backend(backend), kernel_rules=backend != "reference")


def ffpa_attention(q, k, v, *, scale: float | None = None, causal: bool = False, backend: str = "auto"):
    """FFPA attention (head_dim 320-512), differentiable: returns out ``[B, Nq, Hq, D]``.

    q ``[B, Nq, Hq, D]``, k/v ``[B, Nk, Hkv, D]``, fp16/bf16. ``scale`` defaults to 1/sqrt(D)
    (Gemma 4 passes 1.0). Residuals (q, k, v, out, lse) are tagged ``xattn_*`` for remat
    policies; the backward runs the kernel on exactly those out/lse. Works under jit, grad,
    vmap (folded into B: one launch), remat and shard_map.

    Edge cases: ``scale`` must be finite and > 0 (ValueError); B = 0 or Nq = 0 gives an empty result,
    Nk = 0 rows of 0 (lse -inf), all with zero gradients and no kernel launch; sizes past the kernels'
    32-bit indexing or the CUDA grid raise ValueError at trace time.
    """
    check_dense(q, k, v)
    return _attention(_config("ffpa", q, scale, causal, (None, None), backend), q, k, v)


def flash_attention(q, k, v, *, scale: float | None = None, causal: bool = False,
                    window_size: tuple = (None, None), backend: str = "auto"):
    """FlashAttention-4 attention (head_dim <= 256, e.g. 128 or 192/128), differentiable.

    Same conventions as :func:`ffpa_attention`; ``window_size=(left, right)`` selects
    sliding-window attention (bottom-right aligned; ``None`` or ``-1`` = unbounded side, under ``causal=True``
    inside the causal mask; other negative sides raise ValueError).
    """
    check_dense(q, k, v)
    return _attention(_config("fa4", q, scale, causal, window_size, backend), q, k, v)


# --- low level: the building blocks of ring attention ------------------------------------

def ffpa_fwd(q, k, v, *, scale: float, causal: bool = False, backend: str = "auto"):
    """``(out [B, Nq, Hq, D], lse [B, Hq, Nq] fp32)``; not differentiable (see :func:`ffpa_bwd`)."""
    check_dense(q, k, v)
    return forward_call(_config("ffpa", q, scale, causal, (None, None), backend), q, k, v)


def ffpa_bwd(dout, q, k, v, out, lse, *, scale: float, causal: bool = False, backend: str = "auto"):
    """``(dq, dk, dv)`` using exactly the supplied ``out``/``lse`` (e.g. ring-merged ones)."""
    check_dense(q, k, v)
    return backward_call(_config("ffpa", q, scale, causal, (None, None), backend), dout, q, k, v, out, lse)


def fa4_fwd(q, k, v, *, scale: float, causal: bool = False, window_size=(None, None), backend: str = "auto"):
    """FA4 ``(out, lse)``; see :func:`ffpa_fwd`."""
    check_dense(q, k, v)
    return forward_call(_config("fa4", q, scale, causal, window_size, backend), q, k, v)


def fa4_bwd(dout, q, k, v, out, lse, *, scale: float, causal: bool = False, window_size=(None, None),
            backend: str = "auto"):
    """FA4 ``(dq, dk, dv)`` from the supplied out/lse; see :func:`ffpa_bwd`."""
    check_dense(q, k, v)
    return backward_call(_config("fa4", q, scale, causal, window_size, backend), dout, q, k, v, out, lse)
