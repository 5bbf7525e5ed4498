"""``python -m xattn info``: versions, the GPU found, and which kernel families run here."""

from __future__ import annotations

import importlib.util
import platform
import sys

from .device import cuda_gpus, no_gpu_reason, target_arch
from .spec import library_versions

__all__ = ["collect", "report"]

# Top-level names only: find_spec("a.b") would import "a", and the kernel packages pull in
# cutlass, which must not initialise before xattn pins its target arch.
_KERNEL_MODULES = {"ffpa": "ffpa_attn", "fa4": "flash_attn"}
_GLUE_MODULES = ("cutlass", "tvm_ffi", "quack")


def missing_modules(modules) -> list[str]:
    """The names in ``modules`` that cannot be imported here (found by spec, nothing is imported)."""
    out = []
    for m in modules:
        try:
            if importlib.util.find_spec(m) is None:
                out.append(m)
        except (ImportError, ValueError):
            out.append(m)
    return out


def collect() -> dict:
    """Everything ``info`` prints, as a dict (also used by tests and benchmarks)."""
    gpus = cuda_gpus()
    families = {}
    for fam, module in _KERNEL_MODULES.items():
        missing = missing_modules((*_GLUE_MODULES, module))
        if missing:
            run = compile_ = f"missing Python modules: {', '.join(missing)} (pip install xattn)"
        else:
            compile_ = None if target_arch() == "sm_90a" else (
                f"CuTeDSL targets {target_arch()}; set CUTE_DSL_ARCH=sm_90a to compile sm90 kernels")
            if not gpus:
                run = f"no GPU: {no_gpu_reason()}"
            elif gpus[0].capability[0] != 9:
                run = f"GPU 0 is {gpus[0].name} ({gpus[0].arch}); xattn ships sm90 (Hopper) kernels"
            else:
                run = None
        families[fam] = {"can_run": run is None, "why_not_run": run,
                         "can_compile": compile_ is None, "why_not_compile": compile_}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": dict(library_versions()),
        "gpus": [{"index": g.index, "name": g.name, "arch": g.arch, "sms": g.num_sms} for g in gpus],
        "no_gpu_reason": no_gpu_reason(),
        "target_arch": target_arch(),
        "families": families,
        "disk_cache": _cache_state(),
        "d512_backward": _routes("route_table"),
        "forward": _routes("forward_table"),
    }


def _routes(table: str) -> list[str]:
    from . import routes

    try:
        return getattr(routes, table)()
    except ValueError as e:  # a bad XATTN_BWD_ROUTE / XATTN_FWD_ROUTE / budget: say so instead of failing info
        return [str(e)]


def _cache_state() -> dict:
    from . import disk_cache

    return {"enabled": disk_cache.enabled(), "path": str(disk_cache.cache_dir()),
            "entries": len(disk_cache.entries()) if disk_cache.enabled() else 0}


def report(data: dict | None = None) -> str:
    """Human-readable form of :func:`collect`."""
    d = data or collect()
    lines = [f"xattn {d['versions'].get('xattn', '?')} on Python {d['python']} ({d['platform']})",
             "libraries: " + ", ".join(f"{k} {v}" for k, v in d["versions"].items() if k != "xattn")]
    if d["gpus"]:
        lines += [f"GPU {g['index']}: {g['name']} ({g['arch']}, {g['sms']} SMs)" for g in d["gpus"]]
    else:
        lines.append(f"GPU: none ({d['no_gpu_reason']})")
    lines.append(f"CuTeDSL target arch: {d['target_arch']}")
    c = d["disk_cache"]
    lines.append(f"kernel disk cache: {c['path']} ({c['entries']} entries)" if c["enabled"]
                 else "kernel disk cache: off (XATTN_CACHE=0)")
    for fam, st in d["families"].items():
        run = "yes" if st["can_run"] else f"no - {st['why_not_run']}"
        comp = "yes" if st["can_compile"] else f"no - {st['why_not_compile']}"
        lines.append(f"{fam:5s} run here: {run}")
        lines.append(f"{'':5s} compile here: {comp}")
    lines += [f"forward: {x}" for x in d.get("forward", [])]
    lines += [f"d512 backward: {x}" for x in d.get("d512_backward", [])]
    return "\n".join(lines)
