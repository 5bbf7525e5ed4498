"""``python -m xattn warmup``: fill the disk cache ahead of time, on a GPU node or a CPU login node.

Each requested configuration becomes a :class:`KernelSpec`; unsupported combinations are
reported and skipped (never silently dropped). An FFPA backward also brings the launchers of the
chunked-GEMM backward (:mod:`xattn.core.gemm_sm90`) of its dtype, which the route table picks for
long sequences (unless ``XATTN_BWD_ROUTE=ffpa``). Specs already on disk are loaded, not
recompiled. Progress goes to stderr, one line per launcher.
"""

from __future__ import annotations

import itertools
import sys
import time

from . import disk_cache
from .cache import get_launcher
from .spec import KernelSpec, supports

__all__ = ["PRESETS", "plan", "run", "gemm_backward_launchers"]

# Gemma 4 31B: global layers head_dim 512 with Hq 32 / Hkv 4, sliding layers head_dim 256
# with Hq 32 / Hkv 16 and a 1024-token window (HF sliding_window=1024 -> FA window (1023, 0)).
PRESETS = {
    "gemma4": [
        dict(family="ffpa", head_dim=512, head_dim_v=512, qhead_per_kvhead=8, causal=True),
        dict(family="fa4", head_dim=256, head_dim_v=256, qhead_per_kvhead=2, window_left=1023, window_right=0),
    ],
}


def plan(families=("ffpa", "fa4"), head_dims=(512, 128), dtypes=("bfloat16",), gqa=(1,),
         causal=(False, True), varlen=(False,), directions=("fwd", "bwd"), model: str | None = None,
         arch: str = "sm_90a") -> tuple[list[KernelSpec], list[tuple[KernelSpec, str]]]:
    """``(specs to build, [(spec, reason) skipped])`` for a cross product of options or a preset.

    ``head_dims`` entries are ints (D == Dv) or ``(D, Dv)`` pairs; a head dim goes to the
    families that support it. An FFPA backward the GEMM route covers adds that route's launchers
    (:func:`gemm_backward_launchers`, ``GemmSpec``s) for its dtype.
    """
    bases = []
    if model is not None:
        if model not in PRESETS:
            raise ValueError(f"--model: unknown preset {model!r}; known: {', '.join(PRESETS)}")
        bases = PRESETS[model]
    else:
        for fam, hd, g, c in itertools.product(families, head_dims, gqa, causal):
            d, dv = (hd, hd) if isinstance(hd, int) else hd
            bases.append(dict(family=fam, head_dim=d, head_dim_v=dv, qhead_per_kvhead=g, causal=c))
    specs, skipped, seen = [], [], set()
    for base, dt, vl, direction in itertools.product(bases, dtypes, varlen, directions):
        spec = KernelSpec(direction=direction, dtype=dt, varlen=vl, arch=arch, **base)
        if spec in seen:
            continue
        seen.add(spec)
        reason = supports(spec)
        if reason is None:
            specs.append(spec)
        elif model is not None or not reason.startswith(("FFPA supports head_dim", "FA4 on sm90 supports")):
            skipped.append((spec, reason))  # head dims outside a family are routed, not skipped
    from . import routes

    gemm_dtypes = sorted({s.dtype for s in specs if s.direction == "bwd" and routes.may_take_gemm(
        s.family, s.head_dim, s.head_dim_v, (s.window_left, s.window_right))})
    for dt in gemm_dtypes:
        specs += [g for g in gemm_backward_launchers(dt, arch) if g not in specs]
    return specs, skipped


def gemm_backward_launchers(dtype: str, arch: str = "sm_90a") -> list:
    """Every launcher of the chunked-GEMM backward for ``dtype`` (``GemmSpec``s with their default
    tiles and P copy): what a d512 backward on that route loads, through either front end."""
    from .gemm_sm90 import D32_KINDS, KINDS, GemmSpec

    return [GemmSpec(kind, dtype, d32, arch=arch) for kind in KINDS
            for d32 in ((False, True) if kind in D32_KINDS else (False,))]


def run(specs, out=sys.stderr) -> list[dict]:
    """Build every spec (disk hit or compile + store), printing progress; returns one record each."""
    records = []
    tty = hasattr(out, "isatty") and out.isatty()
    t_all = time.perf_counter()
    for i, spec in enumerate(specs, 1):
        bar = "#" * (20 * (i - 1) // len(specs))
        if tty:
            print(f"\r[{bar:<20}] {i}/{len(specs)} {spec.short_name()} ...", end="", file=out, flush=True)
        entry = get_launcher(spec)
        rec = dict(spec=spec.short_name(), source=entry.source, seconds=round(entry.seconds, 2))
        records.append(rec)
        line = f"[{i}/{len(specs)}] {spec.short_name():58s} {entry.source:8s} {entry.seconds:6.2f} s"
        print(("\r" if tty else "") + line + " " * 10, file=out, flush=True)
    print(f"warmup: {len(specs)} launchers ready in {time.perf_counter() - t_all:.1f} s; "
          f"cache {disk_cache.cache_dir() if disk_cache.enabled() else '(disabled: XATTN_CACHE=0)'}",
          file=out, flush=True)
    return records
