"""The widened fuzz on the CPU (CI): a few hundred drawn configurations over every front end, pool and
drop-in, with stand-in kernels (tests/torch/stubs.py fp64 reference; tests/jax/numpy_launcher.py behind
XLA FFI), judged against fp64 exactly as the GPU run judges the kernels. JAX configurations keep to fp16
(NumPy has no bfloat16 for the stand-in launcher)."""

import pytest

from xattn.torch import ffpa_attention as fa

from . import harness, space
from .forms import draw_form
from .results import Collector
from .test_standin import standins  # noqa: F401  (the stand-in kernels fixture)

N = {"core": 40, "core-jax": 30, "torch": 40, "jax": 25, "hf": 60, "fa4-doc": 40, "jax-nn": 30}
FP16_POOL = tuple(e for e in space.POOL if e.dtype == "float16")


def _configs(front_end: str) -> list:
    out, i = [], 0
    while len(out) < N[front_end]:
        seed = space.config_seed(7, front_end, i)
        i += 1
        if front_end in space.FORM_FRONT_ENDS:
            cfg = draw_form(front_end, seed, space.CPU_LIMITS)
            if front_end == "jax-nn" and cfg.dtype != "float16":
                continue
        else:
            pool = FP16_POOL if front_end == "jax" else space.POOL
            cfg = space.draw(front_end, seed, space.CPU_LIMITS, pool=pool)
        out.append(cfg)
    return out


@pytest.mark.parametrize("front_end", space.ALL_FRONT_ENDS)
def test_cpu_slice_of_the_fuzz(front_end, standins, monkeypatch):  # noqa: F811
    monkeypatch.setattr(fa, "kernels_available", lambda: None)
    collector = Collector(7, N[front_end], kernels="stand-in")
    failures = []
    for cfg in _configs(front_end):
        try:
            harness.run_one(cfg, collector, "cpu")
        except AssertionError as exc:
            failures.append(str(exc)[:600])
    (row,) = collector.table("cpu")
    assert not failures, f"{len(failures)} of {row['configs']} failed:\n" + "\n\n".join(failures[:5])
    assert row["passed"] == N[front_end]
