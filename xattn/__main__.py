"""Command line: ``python -m xattn {info,demo,warmup,cache}``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m xattn`` / the ``xattn`` script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="xattn", description="Hopper attention for PyTorch and JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU found, which kernel families run or compile here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("demo", help="run the kernels (GPU) or compile them for sm_90a (CPU)")
    warm = sub.add_parser("warmup", help="compile launchers into the disk cache (GPU or CPU login node)")
    warm.add_argument("--model", help="preset instead of the options below: gemma4")
    warm.add_argument("--family", nargs="+", default=["ffpa", "fa4"], choices=["ffpa", "fa4"])
    warm.add_argument("--head-dims", nargs="+", default=["512", "128"],
                      help="D or D:Dv, e.g. 512 128 192:128 (each goes to the family that supports it)")
    warm.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    warm.add_argument("--gqa", nargs="+", type=int, default=[1], help="Hq // Hkv ratios")
    warm.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    warm.add_argument("--varlen", nargs="+", default=["no"], choices=["no", "yes"])
    warm.add_argument("--passes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    warm.add_argument("--arch", default=None, choices=["sm_90a"],
                      help="target arch when compiling away from the target GPU (sets CUTE_DSL_ARCH)")
    warm.add_argument("--dry-run", action="store_true", help="list what would be built")
    cache = sub.add_parser("cache", help="the disk cache: list | clear | path")
    cache.add_argument("action", choices=["list", "clear", "path"])
    args = parser.parse_args(argv)
    if args.command == "info":
        from xattn.core.info import collect, report

        print(json.dumps(collect(), indent=1) if args.json else report())
    elif args.command == "demo":
        from xattn.demo import main as demo

        demo()
    elif args.command == "warmup":
        return _warmup(args)
    elif args.command == "cache":
        return _cache(args.action)
    return 0


def _warmup(args) -> int:
    import os

    if args.arch:  # before xattn.core pins anything: the DSL reads this once
        os.environ["CUTE_DSL_ARCH"] = args.arch
        os.environ.setdefault("FLASH_ATTENTION_ARCH", args.arch)
        os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    from xattn.core import warmup

    head_dims = []
    for hd in args.head_dims:
        d, _, dv = hd.partition(":")
        head_dims.append((int(d), int(dv or d)))
    specs, skipped = warmup.plan(
        families=args.family, head_dims=head_dims, dtypes=args.dtypes, gqa=args.gqa,
        causal=[c == "yes" for c in args.causal], varlen=[v == "yes" for v in args.varlen],
        directions=args.passes, model=args.model, arch=args.arch or "sm_90a")
    for spec, reason in skipped:
        print(f"skip {spec.short_name()}: {reason}", file=sys.stderr)
    if args.dry_run:
        print("\n".join(s.short_name() for s in specs))
        return 0
    warmup.run(specs)
    return 0


def _cache(action: str) -> int:
    from xattn.core import disk_cache

    if action == "path":
        print(disk_cache.cache_dir())
    elif action == "clear":
        print(f"removed {disk_cache.clear()} entries from {disk_cache.cache_dir()}")
    else:
        rows = disk_cache.entries()
        for e in rows:
            spec = e.get("spec", {})
            kind = (f"gemm/{spec['kind']}" if "kind" in spec  # a GEMM of the d512 chunked backward
                    else f"{spec.get('family', '?')}/{spec.get('direction', '?')}")
            print(f"{e['file']}  {e['bytes'] / 1e3:8.1f} kB  compiled in {e.get('compile_seconds', '?')} s"
                  f"  on {e.get('created', '?')}  {kind}")
        print(f"{len(rows)} entries in {disk_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
