"""A CPU stand-in for the compiled launchers UNDER the real core, so every Python check, the hot path
(``quick_check`` and its memo) and the launcher cache run as they do on the GPU.

``install(monkeypatch)``: the CPU counts as the CUDA device, the launcher cache starts empty and
compiles through :func:`launcher`, whose "launcher" for a spec first emulates the C-side argument
checks of a compiled one (a ``ValueError``, as TVM-FFI raises, which sends the core to its
by-name diagnosis) and then writes the fp64 reference (``tests/reference.py``) into the caller's
buffers, asserting the documented pre-fills. Launches are recorded in ``LAUNCHES``."""

from __future__ import annotations

import torch

from tests.reference import attention as ref_attention, attention_bwd as ref_bwd, varlen_attention as ref_varlen
from xattn.core import cache, checks
from xattn.core.spec import KernelSpec

LAUNCHES: list[tuple] = []


def _names(spec: KernelSpec) -> list[str]:
    cu = ["cu_seqlens_q", "cu_seqlens_k"] if spec.varlen else []
    if spec.direction == "fwd":
        return ["q", "k", "v", *cu, "out", "lse"]
    return ["dout", "q", "k", "v", "out", "lse", *cu, "dq", "dk", "dv"]


def _c_side_checks(spec: KernelSpec, a: dict, workspace) -> None:
    """What the compiled launcher's TVM-FFI entry refuses (dtype, shapes against q/k, strides, device)."""
    bufs = {n: t for n, t in a.items() if not n.startswith("cu_")}
    try:
        got, _, _ = checks.check_attention(spec.family, spec.direction, bufs, spec.causal, a.get("cu_seqlens_q"),
                                           a.get("cu_seqlens_k"), 0 if spec.varlen else None,
                                           0 if spec.varlen else None, (spec.window_left, spec.window_right))
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise ValueError(f"Mismatched argument (C-side check): {exc}") from None
    if got.head_dim != spec.head_dim or got.head_dim_v != spec.head_dim_v or got.dtype != spec.dtype \
            or got.qhead_per_kvhead != spec.qhead_per_kvhead:
        raise ValueError(f"Mismatched argument (C-side check): compiled for {spec.short_name()}")
    if any(w.dtype != torch.float32 for w in workspace):
        raise TypeError("Mismatched type (C-side check): workspace buffers are float32")


def _varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, window):
    grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for s in range(len(cq) - 1):
        a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
        if b > a and d > c:
            part = ref_bwd(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                           lse[None, :, a:b], scale=scale, causal=causal, window=window)
            for g, p, lo, hi in zip(grads, part, (a, c, c), (b, d, d)):
                g[lo:hi] += p[0]
    return grads


def launcher(spec: KernelSpec):
    """A Python "compiled launcher" for ``spec``: the positional signature of the real one."""
    names = _names(spec)
    window = (spec.window_left, spec.window_right)

    def launch(*args):
        *tensors, scale = args
        a = dict(zip(names, tensors))
        workspace = tensors[len(names):]
        _c_side_checks(spec, a, workspace)
        fills = spec.output_fill()
        for name, value in fills.items():
            assert torch.all(a[name] == value), f"{name} was not pre-filled with {value}"
        cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_k")
        if spec.direction == "fwd":
            if spec.varlen:
                o, l_ = ref_varlen(a["q"], a["k"], a["v"], cu_q, cu_k, scale=scale, causal=spec.causal,
                                   window=window)
            else:
                o, l_ = ref_attention(a["q"], a["k"], a["v"], scale=scale, causal=spec.causal, window=window)
            a["out"].copy_(o)
            a["lse"].copy_(l_)
        else:
            inputs = [a[n] for n in ("dout", "q", "k", "v", "out", "lse")]
            if spec.varlen:
                grads = _varlen_bwd(*inputs, cu_q, cu_k, scale, spec.causal, window)
            else:
                grads = ref_bwd(*inputs, scale=scale, causal=spec.causal, window=window)
            for n, g in zip(("dq", "dk", "dv"), grads):
                a[n].copy_(g)
        LAUNCHES.append((spec.family, spec.direction, tuple(a["q"].shape)))

    return launch


def install(monkeypatch, compiler=launcher) -> None:
    """Run the real core on CPU tensors with :func:`launcher` (or ``compiler``) behind its cache."""
    monkeypatch.setattr(checks, "_KDLCUDA", 1)  # kDLCPU: the CPU stands in for the GPU
    monkeypatch.setattr(checks, "_QUICK", checks.Memo())
    monkeypatch.setattr(cache, "_entries", {})
    monkeypatch.setattr(cache, "_key_locks", {})
    monkeypatch.setattr(cache, "_compiler", compiler)
    LAUNCHES.clear()
