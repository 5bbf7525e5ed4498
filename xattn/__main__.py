"""Command line: ``python -m xattn {info,demo,warmup,cache}``."""

from __future__ import annotations

import argparse
import json
import sys


MODEL_PRESETS = ("gemma4",)  # xattn.core.warmup.PRESETS, named here so that parsing imports no kernel stack
_WARMUP_DEFAULTS = dict(family=["ffpa", "fa4"], head_dims=[(512, 512), (128, 128)], gqa=[1], causal=["no", "yes"])


def _head_dim(text: str) -> tuple[int, int]:
    """``D`` or ``D:Dv`` as ints > 0 (an argparse type: a bad value is a usage error, not a traceback)."""
    d, _, dv = text.partition(":")
    try:
        pair = int(d), int(dv or d)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected D or D:Dv (ints), e.g. 512 or 192:128; got {text!r}") from None
    if min(pair) < 1:
        raise argparse.ArgumentTypeError(f"head dims must be positive, got {text!r}")
    return pair


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m xattn`` / the ``xattn`` script; returns the exit code."""
    parser = argparse.ArgumentParser(prog="xattn", description="Hopper attention for PyTorch and JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU found, which kernel families run or compile here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("demo", help="run the kernels (GPU) or compile them for sm_90a (CPU)")
    warm = sub.add_parser("warmup", help="compile launchers into the disk cache (GPU or CPU login node)")
    warm.add_argument("--model", choices=MODEL_PRESETS,
                      help="a preset instead of --family/--head-dims/--gqa/--causal (not combinable with them)")
    warm.add_argument("--family", nargs="+", choices=["ffpa", "fa4"], help="default: ffpa fa4")
    warm.add_argument("--head-dims", nargs="+", type=_head_dim,
                      help="D or D:Dv, e.g. 512 128 192:128 (each goes to the family that supports it; "
                           "default 512 128)")
    warm.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    warm.add_argument("--gqa", nargs="+", type=_positive_int, help="Hq // Hkv ratios (default 1)")
    warm.add_argument("--causal", nargs="+", choices=["no", "yes"], help="default: no yes")
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
        given = [f"--{n.replace('_', '-')}" for n in _WARMUP_DEFAULTS if getattr(args, n) is not None]
        if args.model is not None and given:
            parser.error(f"warmup: --model {args.model} is a preset; it cannot be combined with {', '.join(given)}")
        for name, default in _WARMUP_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
        return _warmup(args, parser)
    elif args.command == "cache":
        return _cache(args.action)
    return 0


def _warmup(args, parser) -> int:
    import os

    if args.arch:  # before xattn.core pins anything: the DSL reads this once
        os.environ["CUTE_DSL_ARCH"] = args.arch
        os.environ.setdefault("FLASH_ATTENTION_ARCH", args.arch)
        os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", "132")
    from xattn.core import warmup

    specs, skipped = warmup.plan(
        families=args.family, head_dims=args.head_dims, dtypes=args.dtypes, gqa=args.gqa,
        causal=[c == "yes" for c in args.causal], varlen=[v == "yes" for v in args.varlen],
        directions=args.passes, model=args.model, arch=args.arch or "sm_90a")
    for spec, reason in skipped:
        print(f"skip {spec.short_name()}: {reason}", file=sys.stderr)
    if not specs:  # never exit 0 having built nothing
        from xattn.core.spec import family_for

        lost = [f"{d}/{dv}" for d, dv in args.head_dims if family_for(d, dv) is None]
        why = f"no kernel family serves head dims {', '.join(lost)}" if lost else "every combination is unsupported"
        parser.error(f"warmup: nothing to build: {why} (FFPA: 320-512 step 16; FA4: 64, 96, 128, 192, 192:128, 256)")
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
            shared = disk_cache.cache_dir() / (e["file"].removesuffix(".o") + ".so")  # the linked form, if any
            linked = f"  + .so {shared.stat().st_size / 1e3:.1f} kB" if shared.is_file() else ""
            print(f"{e['file']}  {e['bytes'] / 1e3:8.1f} kB{linked}  compiled in {e.get('compile_seconds', '?')} s"
                  f"  on {e.get('created', '?')}  {kind}")
        print(f"{len(rows)} entries in {disk_cache.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
