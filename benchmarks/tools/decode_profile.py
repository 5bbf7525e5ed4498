"""Where the host time of one greedy decode step goes (issue #25), HF Gemma 4 with the 31B layer dims.

Greedy ``generate()`` of :class:`benchmarks.decode.Decoder` (B 1, ``--prompt`` tokens; ``--mode eager``:
``DynamicCache``, ``graphs``: the compiled static-cache step). Every number is the ``--tokens``-token
call minus the 1-token call (the prefill), per decode step, in three passes after a warm-up:

1. plain: ms per token, and the GPU's busy time per token (CUDA time of all kernels, torch.profiler),
   so a step bound by the host shows up as ``host_bound = 1 - gpu / step``;
2. under cProfile: host ms per step by module (self time, with the C calls a module makes counted to
   it: torch ops, kernel launches) and the cumulative time of the functions on the attention path
   (mask factory, plan, routing, checks, launch), per step and per call;
3. with ``torch.cuda.set_sync_debug_mode("warn")``: every host-device synchronisation in a step, by
   the Python call site (the innermost xattn / transformers frame) and its stack.

cProfile slows Python down (roughly 2x here), so read its numbers as shares, and pass 1 for the time.

    python benchmarks/tools/decode_profile.py [--impl ffpa] [--mode eager] [--prompt 8192] [--tokens 33]
                                             [--out FILE.json]
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# (label, file suffix, function name): the attention path's functions, cumulative time each
PATH = (
    ("HF create_causal_mask", "masking_utils.py", "create_causal_mask"),
    ("HF create_sliding_window_causal_mask", "masking_utils.py", "create_sliding_window_causal_mask"),
    ("xattn mask factory (ffpa_mask)", "hf/mask_factory.py", "ffpa_mask"),
    ("  plan_hf_mask", "hf/masks.py", "plan_hf_mask"),
    ("attention function (ffpa_attention_forward)", "hf/routing.py", "ffpa_attention_forward"),
    ("  plan_call", "hf/call_plan.py", "plan_call"),
    ("  fallback_reason", "hf/support.py", "fallback_reason"),
    ("  _run_kernels", "hf/routing.py", "_run_kernels"),
    ("    attention_with_lse", "attention.py", "attention_with_lse"),
    ("    attention_op", "ops.py", "attention_op"),
    ("    forward_impl", "ops.py", "forward_impl"),
    ("    core checks (check_attention)", "checks.py", "check_attention"),
    ("    core checks (quick_check)", "checks.py", "quick_check"),
    ("sdpa (HF sdpa_attention_forward)", "sdpa_attention.py", "sdpa_attention_forward"),
    ("generate's per-token work (_sample)", "generation/utils.py", "_sample"),
    ("cache update (DynamicCache.update)", "cache_utils.py", "update"),
)


def _module(filename: str) -> str:
    """A short module name for a profiled file: xattn/..., transformers/..., torch/..., or the base name."""
    for root in ("xattn", "transformers", "torch", "tvm_ffi", "benchmarks"):
        key = f"/{root}/"
        if key in filename:
            return root + "/" + filename.split(key, 1)[1]
    return os.path.basename(filename)


def by_module(stats: pstats.Stats, steps: int) -> list[tuple[str, float]]:
    """Self host ms per step by module; a C function's self time goes to its callers' modules."""
    acc = collections.Counter()
    for (filename, _, name), (_, _, tt, _, callers) in stats.stats.items():
        if filename != "~":
            acc[_module(filename)] += tt
            continue
        total = sum(c[2] for c in callers.values()) or 1.0  # split by the callers' share of its calls' time
        for (cfile, _, _), c in callers.items():
            acc[_module(cfile) if cfile != "~" else "C (no Python caller)"] += tt * c[2] / total
    return [(m, t * 1e3 / steps) for m, t in acc.most_common()]


def path_times(stats: pstats.Stats, steps: int) -> list[dict]:
    """Cumulative ms per step and µs per call of each function in :data:`PATH` (summed over same-named ones)."""
    out = []
    for label, suffix, fn in PATH:
        ct = calls = 0
        for (filename, _, name), (_, nc, _, cum, _) in stats.stats.items():
            if name == fn and filename.endswith(suffix):
                ct += cum
                calls += nc
        if calls:
            out.append(dict(function=label, ms_per_step=round(ct * 1e3 / steps, 3),
                            calls_per_step=round(calls / steps, 2), us_per_call=round(ct * 1e6 / calls, 1)))
    return out


def sync_sites(step) -> list[dict]:
    """The host-device synchronisations of one call of ``step``, by innermost xattn/transformers frame."""
    import torch

    sites = collections.Counter()
    stacks = {}
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return original(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/xattn/" in f.filename or "/transformers/" in
                  f.filename or "/benchmarks/" in f.filename]
        site = f"{_module(frames[-1].filename)}:{frames[-1].lineno} ({frames[-1].name})" if frames else \
            f"{filename}:{lineno}"
        sites[site] += 1
        stacks.setdefault(site, [f"{_module(f.filename)}:{f.lineno} {f.name}" for f in frames[-6:]])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = original
    return [dict(site=s, count=n, stack=stacks[s]) for s, n in sites.most_common()]


def _profile(fn) -> pstats.Stats:
    prof = cProfile.Profile()
    prof.runcall(fn)
    return pstats.Stats(prof)


def _minus(long: list, short: list, key: str, fields: tuple, steps: int) -> list[dict]:
    """Per decode step: rows of the long run minus the same rows of the 1-token run, over ``steps``."""
    base = {r[key]: r for r in short}
    out = []
    for r in long:
        b = base.get(r[key], {})
        row = {key: r[key], **{f: round((r[f] - b.get(f, 0)) / steps, 3) for f in fields}}
        out.append(row)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", default="ffpa")
    ap.add_argument("--mode", default="eager", choices=("eager", "graphs"))
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=33)
    ap.add_argument("--label", default="", help="a tag for the report (e.g. before / after)")
    ap.add_argument("--out", default=None, help="append the report to this JSON file (a list of reports)")
    args = ap.parse_args(argv)

    import torch
    import torch.profiler as tp

    from benchmarks.decode import DEVICE, Decoder, build_model

    dec = Decoder(build_model(args.impl), args.mode, args.prompt, args.tokens)
    plain = dec.run()
    steps = args.tokens - 1
    gpu, kernels = {}, {}
    for n in (1, args.tokens):  # GPU busy time: CUDA time of every kernel, the 1-token run subtracted
        activity = tp.ProfilerActivity.CUDA if DEVICE == "cuda" else tp.ProfilerActivity.CPU
        with tp.profile(activities=[activity]) as cuda_prof:
            dec.generate(n)
        gpu[n], kernels[n] = _gpu_ms(cuda_prof), _kernel_ms(cuda_prof)
    gpu_per_token = (gpu[args.tokens] - gpu[1]) / steps
    top_kernels = _minus([dict(kernel=k, ms=t) for k, t in kernels[args.tokens].items()],
                         [dict(kernel=k, ms=t) for k, t in kernels[1].items()], "kernel", ("ms",), steps)
    top_kernels = sorted(top_kernels, key=lambda r: -r["ms"])[:12]
    long, short = (_profile(lambda n=n: dec.generate(n)) for n in (args.tokens, 1))
    modules = _minus([dict(module=m, ms=t) for m, t in by_module(long, 1)],
                     [dict(module=m, ms=t) for m, t in by_module(short, 1)], "module", ("ms",), steps)
    path = _minus(path_times(long, 1), path_times(short, 1), "function", ("ms_per_step", "calls_per_step"), steps)
    for row in path:
        calls = row["calls_per_step"]
        row["us_per_call"] = round(row["ms_per_step"] * 1e3 / calls, 1) if calls else 0.0
    syncs_long, syncs_short = (sync_sites(lambda n=n: dec.generate(n)) for n in (args.tokens, 1))
    syncs = [dict(s, count=round(s["count"] / steps, 2)) for s in
             _minus(syncs_long, syncs_short, "site", ("count",), 1) if s["count"] > 0]
    stacks = {s["site"]: s["stack"] for s in syncs_long}
    for s in syncs:
        s["stack"] = stacks[s["site"]]
    report = dict(impl=args.impl, mode=args.mode, prompt_len=args.prompt, steps=steps, label=args.label,
                  device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
                  ms_per_token=round(plain["ms_per_token"], 3), gpu_ms_per_token=round(gpu_per_token, 3),
                  host_bound=round(1 - gpu_per_token / plain["ms_per_token"], 3), gpu_ms_per_step_by_kernel=top_kernels,
                  host_ms_per_step_by_module=sorted(modules, key=lambda r: -r["ms"]),
                  attention_path=path, syncs_per_step=round(sum(s["count"] for s in syncs), 2), sync_sites=syncs)
    if args.out:
        reports = json.load(open(args.out)) if os.path.exists(args.out) else []
        reports = [r for r in reports if (r["impl"], r["mode"], r["label"]) != (args.impl, args.mode, args.label)]
        json.dump(reports + [report], open(args.out, "w"), indent=1)
    _print(report)


def _gpu_ms(prof) -> float:
    return sum(e.self_device_time_total for e in prof.key_averages() if e.device_time_total > 0) / 1e3


def _kernel_ms(prof) -> dict:
    """Device ms by kernel name (the first 90 characters) over the profiled call."""
    out = collections.Counter()
    for e in prof.key_averages():
        if e.self_device_time_total > 0:
            out[e.key[:90]] += e.self_device_time_total / 1e3
    return out


def _print(r: dict) -> None:
    print(f"=== {r['impl']} {r['mode']} prompt {r['prompt_len']} {r['label']}: {r['ms_per_token']:.2f} ms/token, "
          f"GPU busy {r['gpu_ms_per_token']:.2f} ms/token (host-bound share {r['host_bound']:.0%}) ===")
    print("GPU ms per step by kernel (torch.profiler):")
    for k in r.get("gpu_ms_per_step_by_kernel", []):
        print(f"  {k['ms']:8.3f}  {k['kernel']}")
    print("host ms per step by module (cProfile self time, C calls counted to their caller):")
    for m in r["host_ms_per_step_by_module"][:18]:
        print(f"  {m['ms']:8.3f}  {m['module']}")
    print("attention path (cumulative, cProfile):")
    for p in r["attention_path"]:
        if not p["calls_per_step"]:
            continue  # called once per generate(), not per step (or not at all): nothing per step to show
        print(f"  {p['ms_per_step']:8.3f} ms/step {p['calls_per_step']:6.1f} calls {p['us_per_call']:9.1f} us/call  "
              f"{p['function']}")
    print(f"host-device synchronisations per step: {r['syncs_per_step']}")
    for s in r["sync_sites"][:10]:
        print(f"  {s['count']:5.2f}x  {s['site']}")
        for frame in s["stack"]:
            print(f"           {frame}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
