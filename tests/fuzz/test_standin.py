"""The whole fuzz harness on the CPU, before any GPU time: every front end runs drawn configurations
end to end with stand-in kernels (``tests/torch/stubs.py``: fp64 reference behind the core's
destination-passing signature; ``tests/jax/numpy_launcher.py``: NumPy launchers behind XLA FFI), and
kernels broken in the ways attention kernels break are caught by the verdict."""

import dataclasses
import math

import pytest
import torch

from tests import numpy_gemm
from tests.jax import numpy_launcher
from tests.reference import attention as ref_attention
from tests.torch import stubs
from xattn.jax import _ffi

from . import harness, space
from .results import Collector

# fp16 entries for JAX: NumPy has no bfloat16 for the stand-in launcher to read.
PICKS = {
    "core": ["ffpa-d512x512-g8-causal-varlen-fp16", "fa4-d128x128-g2-wNone_128-dense-bf16",
             "fa4-d96x96-g1-w100_37-varlen-bf16"],
    "core-jax": ["ffpa-d336x336-g2-causal-dense-bf16", "fa4-d64x64-g8-w64_0-dense-bf16",
                 "fa4-d192x128-g1-full-varlen-fp16"],
    "torch": ["fa4-d64x64-g4-causal-varlen-fp16", "fa4-d192x128-g1-w64_0-dense-bf16",
              "ffpa-d448x448-g4-full-varlen-fp16"],  # the first gets FORCED's FA4-only options
    "jax": ["ffpa-d512x512-g8-causal-varlen-fp16", "fa4-d96x96-g2-causal-dense-fp16",
            "fa4-d256x256-g6-full-varlen-fp16"],
}
# Make each front end's rarer paths run here at least once.
FORCED = {
    "core": [("stream", "explicit")],
    "core-jax": [("stream", "explicit"), ("outputs", "tvm_ffi")],
    "torch": [("entry", "flash_attn_func"), ("spelling", (False, (None, 0))), ("family", "explicit"),
              ("max_seqlen", "loose")],
    "jax": [("jit", True)],
}
ENTRIES = {e.name: e for e in space.POOL}


def _dlpack_inputs(fn):
    """Stand-ins compute with torch: view JAX arrays / tvm_ffi tensors as torch tensors (no copy)."""
    def run(*args, **kw):
        def conv(x):
            return torch.from_dlpack(x) if hasattr(x, "__dlpack__") and not isinstance(x, torch.Tensor) else x
        kw = {n: ([conv(w) for w in x] if n == "workspace" else conv(x)) for n, x in kw.items()}
        return fn(*map(conv, args), **kw)
    return run


def _gemm_standin(spec):
    """tests/numpy_gemm.py's launcher for the torch GEMM drivers: NumPy reads no bfloat16, so bf16 buffers go
    through fp32 copies, written back after the call."""
    run = numpy_gemm.make(spec)

    def wide(a):  # the same element strides (alignment checks see what the bf16 view has)
        if not (isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16):
            return a
        return torch.empty_strided(a.shape, a.stride(), dtype=torch.float32).copy_(a)

    def launch(*args):
        wide_args = [wide(a) for a in args]
        run(*wide_args)
        for a, w in zip(args, wide_args):
            if w is not a:
                a.copy_(w)
    return launch


@pytest.fixture
def standins(monkeypatch):
    """Stand-ins of every launcher both front ends reach, the GEMM backwards' too (their routes run forced)."""
    from xattn.torch import gemm_bwd, gemm_bwd_segments

    stubs.install(monkeypatch)
    for fam in ("ffpa", "fa4"):
        monkeypatch.setitem(harness.CORE, f"{fam}_fwd", _dlpack_inputs(stubs.core_fwd(fam)))
        monkeypatch.setitem(harness.CORE, f"{fam}_bwd", _dlpack_inputs(stubs.core_bwd(fam)))
    def gemms_on_standins(gemms, q):
        return gemms or gemm_bwd.CoreGemms(q.dtype, num_sms=132, launcher=_gemm_standin)

    monkeypatch.setattr(gemm_bwd, "default_gemms", gemms_on_standins)
    monkeypatch.setattr(gemm_bwd_segments, "default_gemms", gemms_on_standins)
    _ffi.set_launcher_provider(numpy_gemm.provider(numpy_launcher.provider))
    numpy_launcher.CALLS.clear()
    numpy_gemm.CALLS.clear()
    yield
    _ffi.set_launcher_provider(None)


def _config(front_end, name, i):
    cfg = space.draw(front_end, space.config_seed(1, front_end, i), space.CPU_LIMITS, pool=(ENTRIES[name],))
    if i == 0:
        cfg = dataclasses.replace(cfg, options=tuple({**dict(cfg.options), **dict(FORCED[front_end])}.items()))
    return cfg


@pytest.mark.parametrize("front_end", space.FRONT_ENDS)
def test_every_front_end_runs_end_to_end_with_stand_in_kernels(front_end, standins, tmp_path):
    collector = Collector(1, 3, kernels="stand-in")
    for i, name in enumerate(PICKS[front_end]):
        cfg = _config(front_end, name, i)
        checks = harness.run_one(cfg, collector, "cpu")
        names = [c.name for c in checks if c.name != "refusal"]
        routes = harness.routes_of(cfg)
        assert names == (list(harness.QUANTITIES) if len(routes) == 1 else
                         [f"{n}@{r}" for r in routes for n in harness.quantities_of(r, front_end)])
        assert all(c.ok and c.ratio < 0.7 for c in checks), (cfg.describe(), checks)
    calls = numpy_launcher.CALLS if front_end == "jax" else stubs.CALLS
    assert len(calls) >= 6  # a forward and a backward per configuration reached the stand-in
    (row,) = collector.write(tmp_path / "fuzz.json", device="cpu")["rows"]
    assert (row["front_end"], row["configs"], row["passed"], row["failed"]) == (front_end, 3, 3, 0)


def _broken_fwd(kind):
    good = stubs.core_fwd("fa4")

    def run(q, k, v, out, lse, *, softmax_scale, causal, window_size=(None, None), **kw):
        if kind == "scale":
            softmax_scale *= 1.1
        if kind == "top_left":  # causal aligned to the top-left corner instead of the bottom-right
            o, l_ = ref_attention(q, k, v, scale=softmax_scale, window=(None, q.shape[1] - k.shape[1]))
            out.copy_(o)
            lse.copy_(l_)
            return
        if kind == "gqa":  # q head h paired with the wrong kv head
            k, v = k.roll(1, dims=2), v.roll(1, dims=2)
        good(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal, window_size=window_size, **kw)
        if kind == "unwritten":
            out[:, -1] = float("nan")  # the last query row never stored
        if kind == "log2":
            lse.mul_(1 / math.log(2))
    return run


@pytest.mark.parametrize("kind, quantity", [("scale", "lse"), ("top_left", "out"), ("gqa", "out"),
                                            ("unwritten", "out"), ("log2", "lse")])
def test_broken_kernels_are_caught(kind, quantity, standins, monkeypatch):
    monkeypatch.setitem(harness.CORE, "fa4_fwd", _broken_fwd(kind))
    cfg = space.draw("core", 3, space.CPU_LIMITS, pool=(ENTRIES["fa4-d128x128-g4-causal-dense-bf16"],))
    cfg = dataclasses.replace(cfg, batch=1, seqlen_q=24, seqlen_k=40, heads_kv=2, scale=0.125, layouts=())
    collector = Collector(1, 1, kernels="stand-in")
    with pytest.raises(AssertionError, match=rf"(?s){quantity}: err .*XATTN_FUZZ_ONLY={cfg.seed}"):
        harness.run_one(cfg, collector, "cpu")
    (row,) = collector.table("cpu")
    assert row["failed"] == 1 and row["failing_seeds"] == [cfg.seed] and row["worst_err_over_tol"] != 0
