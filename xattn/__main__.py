"""Command line: ``python -m xattn {info,demo}``."""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="xattn", description="Hopper attention for PyTorch and JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, GPU found, which kernel families run or compile here")
    info.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_parser("demo", help="run the kernels (GPU) or compile them for sm_90a (CPU)")
    args = parser.parse_args(argv)
    if args.command == "info":
        from xattn.core.info import collect, report

        print(json.dumps(collect(), indent=1) if args.json else report())
    elif args.command == "demo":
        from xattn.demo import main as demo

        demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
