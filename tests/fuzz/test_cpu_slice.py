"""The widened fuzz on the CPU (CI): a few hundred drawn configurations over every front end, pool and
drop-in, with stand-in kernels (tests/torch/stubs.py fp64 reference; tests/jax/numpy_launcher.py behind
XLA FFI), judged against fp64 exactly as the GPU run judges the kernels. JAX configurations on the
stand-in keep to fp16 (NumPy has no bfloat16 for it); ``jax@reference`` / ``jax-nn@reference`` run
xattn.jax's own CPU path (``backend="reference"``, both dtypes), what a laptop runs; ``@packed-ffpa`` draws
only packed FFPA configurations, whose every serving backward route (GEMM ones on tests/numpy_gemm.py) runs
forced; ``@decode`` recasts dense draws as decoding steps on long caches, so the forced split route splits."""

import dataclasses
import random

import pytest

from tests.torch.test_hf_padding_widths import uniform_dead_rows_sdpa
from xattn.torch.hf import fallback, support

from . import harness, space
from .forms import draw_form
from .results import Collector
from .test_standin import standins  # noqa: F401  (the stand-in kernels fixture)

pytestmark = pytest.mark.slow  # ~5 min of CPU together: CI's second step (pytest -m slow)

N = {"core": 40, "core-jax": 30, "torch": 40, "jax": 25, "hf": 60, "fa4-doc": 40, "jax-nn": 30,
     "jax@reference": 12, "jax-nn@reference": 15, "torch@packed-ffpa": 30, "jax@packed-ffpa": 20,
     "torch@decode": 24, "jax@decode": 10}
FP16_POOL = tuple(e for e in space.POOL if e.dtype == "float16")
# "@packed-ffpa": the packed FFPA entries only, the configurations with a choice of backward routes (all run)
PACKED_FFPA = tuple(e for e in space.POOL if e.family == "ffpa" and e.varlen)
# "@decode": dense draws recast as decoding steps (1-16 queries on a cache of a few hundred to ~2000 keys): the CPU
# limits keep every other draw under 40 keys, where the split route's key tile (128) leaves one split; these split
# the keys over several (tails, keys left over, the slot launch of one sequence), as the GPU fuzz's do
DENSE = tuple(e for e in space.POOL if not e.varlen)
DECODE_KEYS = (129, 300, 513, 1000, 1999)  # JAX: its shape buckets (space._JAX_N) where they reach this far
DECODE_QUERIES = (1, 1, 2, 4, 7, 16)


def _decoding(cfg, seed: int):
    """``cfg`` (dense) as a decoding step: a few queries on a long cache, the same entry, heads and layouts."""
    rng = random.Random(seed)
    sizes = (lambda ns: [n for n in ns if n in space._JAX_N]) if cfg.front_end == "jax" else (lambda ns: ns)
    return dataclasses.replace(cfg, seqlen_q=rng.choice(sizes(DECODE_QUERIES)), seqlen_k=rng.choice(sizes(DECODE_KEYS)))


def _configs(name: str) -> list:
    front_end, _, backend = name.partition("@")
    out, i = [], 0
    while len(out) < N[name]:
        seed = space.config_seed(7, name, i)
        i += 1
        if front_end in space.FORM_FRONT_ENDS:
            cfg = draw_form(front_end, seed, space.CPU_LIMITS)
            if front_end == "jax-nn" and cfg.dtype != "float16" and not backend:
                continue
            if backend == "reference":
                cfg = dataclasses.replace(cfg, form=cfg.form + (("backend", backend),))
        else:
            pool = FP16_POOL if front_end == "jax" and backend != "reference" else space.POOL
            if backend == "packed-ffpa":
                pool = tuple(e for e in PACKED_FFPA if e in pool)
            if backend == "decode":
                pool = tuple(e for e in DENSE if e in pool)
            cfg = space.draw(front_end, seed, space.CPU_LIMITS, pool=pool)
            if backend == "decode":
                cfg = _decoding(cfg, seed)
            if backend == "reference":
                cfg = dataclasses.replace(cfg, options=cfg.options + (("backend", backend),))
        out.append(cfg)
    return out


@pytest.mark.parametrize("name", list(N))
def test_cpu_slice_of_the_fuzz(name, standins, monkeypatch):  # noqa: F811
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    # SDPA as CUDA computes it (a nonzero average for rows with every key masked): the CPU's 0 there hid a
    # fallback that differed from the kernels until the H200 run found it
    monkeypatch.setattr(fallback, "get_sdpa", lambda: uniform_dead_rows_sdpa)
    monkeypatch.setattr(fallback, "_SDPA_FN", None)
    collector = Collector(7, N[name], kernels="stand-in")
    failures = []
    for cfg in _configs(name):
        try:
            harness.run_one(cfg, collector, "cpu")
        except AssertionError as exc:
            failures.append(str(exc)[:600])
    (row,) = collector.table("cpu")
    assert not failures, f"{len(failures)} of {row['configs']} failed:\n" + "\n\n".join(failures[:5])
    assert row["passed"] == N[name]
