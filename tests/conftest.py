"""Shared pytest setup: GPU tests skip cleanly where no usable sm90 GPU + kernel stack exists."""

import os
import tempfile

import pytest

# Tests never touch the user's kernel cache: one fresh directory per test session
# (so the compile tests really compile), unless XATTN_CACHE_DIR is set (the GPU kit sets it).
os.environ.setdefault("XATTN_CACHE_DIR", tempfile.mkdtemp(prefix="xattn-test-cache-"))

from xattn.core.device import cuda_gpus  # noqa: E402
from xattn.core.info import collect  # noqa: E402

if not cuda_gpus():
    # XLA:CPU compiles are most of the CPU run's time (B=2 x 128-token attention: ~0.8 s per jit, run in
    # microseconds): LLVM at -O0 compiles ~1.5x faster, and a per-process persistent cache compiles an HLO
    # seen before (jax.nn's side of a comparison, the same call under another partial) once. Numerics are
    # XLA's own either way (no fast-math); the GPU run is left as it is.
    if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        import atexit
        import shutil

        import jax

        _jax_cache = tempfile.mkdtemp(prefix="xattn-test-jax-cache-")
        atexit.register(shutil.rmtree, _jax_cache, ignore_errors=True)
        jax.config.update("jax_compilation_cache_dir", _jax_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

# XATTN_RECORD_SPECS=path: every KernelSpec the (CPU) run builds is written to ``path`` (JSON), so
# scripts/prefill_gpu_cache.py --recorded path can compile what the GPU twins of these tests need.
_RECORD = os.environ.get("XATTN_RECORD_SPECS")
_recorded = set()
if _RECORD:
    from xattn.core.spec import KernelSpec

    _post_init = KernelSpec.__post_init__

    def _recording_post_init(self):
        _post_init(self)
        _recorded.add(self)
    KernelSpec.__post_init__ = _recording_post_init


def pytest_sessionfinish(session, exitstatus):
    if _RECORD:
        import json

        from xattn.core.spec import supports

        rows = [{f: getattr(s, f) for f in ("family", "direction", "dtype", "head_dim", "head_dim_v",
                                            "qhead_per_kvhead", "causal", "varlen", "window_left", "window_right")}
                for s in list(_recorded) if supports(s) is None]
        with open(_RECORD, "w") as f:
            json.dump(sorted(rows, key=json.dumps), f, indent=0)


def _gpu_skip_reason():
    fams = collect()["families"]
    reasons = {f: s["why_not_run"] for f, s in fams.items() if not s["can_run"]}
    return "; ".join(f"{f}: {r}" for f, r in reasons.items()) or None


@pytest.hookimpl(tryfirst=True)  # before -m selects: the slow mark below must be there when it does
def pytest_collection_modifyitems(config, items):
    for item in items:  # a real sm_90a compile is a slow test: CI's second step (pytest -m slow) runs it
        if item.get_closest_marker("compile") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
