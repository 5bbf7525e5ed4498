"""List the launchers the GPU fuzz of the drop-in front ends will ask for, on the CPU, for the prefill.

The drop-ins choose their kernels themselves (HF masks become windows and varlen segments, jax.nn's
top-left masks become shifted windows), so the launchers cannot be read off a pool. This runs the
GPU run's configurations through each front end with the stand-in kernels (fp64 torch reference,
NumPy behind XLA FFI; JAX configurations as fp16, since NumPy has no bfloat16) and records every
``KernelSpec`` built, both dtypes of each (the stand-ins compute what the kernel would). The FFPA
backward route is forced (``XATTN_BWD_ROUTE=ffpa``) so that its launchers are listed too; the
chunked-GEMM launchers are in ``scripts/prefill_gpu_cache.py``'s own list.

    .venv/bin/python -m tests.fuzz.record_specs --out .gpu/fuzz_specs.json [--n 1000]
    .venv312/bin/python scripts/prefill_gpu_cache.py --fuzz --recorded .gpu/fuzz_specs.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ["XATTN_BWD_ROUTE"] = "ffpa"

FIELDS = ("family", "direction", "dtype", "head_dim", "head_dim_v", "qhead_per_kvhead", "causal", "varlen",
          "window_left", "window_right")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=None, help="configurations per front end (default: XATTN_FUZZ_N)")
    args = ap.parse_args()

    import torch

    from tests.jax import numpy_launcher
    from tests.torch import stubs
    from xattn.core.spec import KernelSpec, supports
    from xattn.jax import _ffi
    from xattn.torch.hf import support

    from . import space
    from .forms_harness import RUNNERS, _inputs

    seen: set = set()
    post_init = KernelSpec.__post_init__

    def recording(self):
        post_init(self)
        seen.add(self)
    KernelSpec.__post_init__ = recording
    stubs.install_for_process()
    support.kernels_available = lambda: None
    _ffi.set_launcher_provider(numpy_launcher.provider)
    for front_end in space.FORM_FRONT_ENDS:
        t0, errors = time.perf_counter(), 0
        cfgs = space.configs(front_end, n=args.n, only=[])
        for i, cfg in enumerate(cfgs):
            if front_end == "jax-nn":
                cfg = dataclasses.replace(cfg, dtype="float16")
            try:
                res = RUNNERS[front_end](cfg, _inputs(cfg, "cpu"), "cpu")
                if front_end != "jax-nn":
                    out, leaves = res[0], res[1]
                    torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
            except NotImplementedError:
                errors += 1  # a documented refusal: no launcher
            if (i + 1) % 200 == 0:
                print(f"record_specs: {front_end} {i + 1}/{len(cfgs)} ({len(seen)} specs)", file=sys.stderr)
        print(f"record_specs: {front_end}: {len(cfgs)} configurations in {time.perf_counter() - t0:.0f} s "
              f"({errors} refused)", file=sys.stderr)
    KernelSpec.__post_init__ = post_init
    rows = set()
    for s in list(seen):
        for dtype in ("bfloat16", "float16"):
            spec = dataclasses.replace(s, dtype=dtype)
            if supports(spec) is None:
                rows.add(tuple(getattr(spec, f) for f in FIELDS))
    with open(args.out, "w") as f:
        json.dump([dict(zip(FIELDS, r)) for r in sorted(rows, key=repr)], f, indent=0)
    print(f"record_specs: {len(rows)} launchers -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
