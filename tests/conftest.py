"""Shared pytest setup: GPU tests skip cleanly where no usable sm90 GPU + kernel stack exists."""

import os
import tempfile

import pytest

# Tests never touch the user's kernel cache: one fresh directory per test session
# (so the compile tests really compile), unless XATTN_CACHE_DIR is set (the GPU kit sets it).
os.environ.setdefault("XATTN_CACHE_DIR", tempfile.mkdtemp(prefix="xattn-test-cache-"))

from xattn.core.info import collect


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
