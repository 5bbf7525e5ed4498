"""Shared pytest setup: GPU tests skip cleanly where no usable sm90 GPU + kernel stack exists."""

import os
import tempfile

import pytest

# Tests never touch the user's kernel cache: one fresh directory per test session
# (so the compile tests really compile), unless XATTN_CACHE_DIR is set (the GPU kit sets it).
os.environ.setdefault("XATTN_CACHE_DIR", tempfile.mkdtemp(prefix="xattn-test-cache-"))

from xattn.core.info import collect

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


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
