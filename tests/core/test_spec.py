"""Compile keys and the single support check."""

import dataclasses
import subprocess
import sys

import pytest

from xattn.core.spec import KernelSpec, library_versions, supports


def spec(**kw):
    base = dict(family="ffpa", direction="fwd", dtype="bfloat16", head_dim=512, head_dim_v=512)
    base.update(kw)
    return KernelSpec(**base)


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="ffpa-d512"),
    pytest.param(dict(head_dim=320, head_dim_v=320, qhead_per_kvhead=4), id="ffpa-d320-gqa4"),
    pytest.param(dict(head_dim=384, head_dim_v=384, causal=True, varlen=True, direction="bwd"), id="ffpa-d384-bwd"),
    pytest.param(dict(family="fa4", head_dim=128, head_dim_v=128), id="fa4-d128"),
    pytest.param(dict(family="fa4", head_dim=192, head_dim_v=128, direction="bwd"), id="fa4-192-128-bwd"),
    pytest.param(dict(family="fa4", head_dim=256, head_dim_v=256, window_left=1024, window_right=0),
                 id="fa4-d256-local"),
])
def test_supported(kw):
    assert supports(spec(**kw)) is None


@pytest.mark.parametrize("kw, words", [
    pytest.param(dict(head_dim=256, head_dim_v=256), "320-512", id="ffpa-d256"),
    pytest.param(dict(head_dim=520, head_dim_v=520), "320-512", id="ffpa-d520"),
    pytest.param(dict(head_dim=328, head_dim_v=328), "steps of 16", id="ffpa-d328"),
    pytest.param(dict(head_dim=512, head_dim_v=384), "equal", id="ffpa-unequal"),
    pytest.param(dict(window_left=128, window_right=0), "sliding-window", id="ffpa-window"),
    pytest.param(dict(dtype="float32"), "float16 or bfloat16", id="fp32"),
    pytest.param(dict(arch="sm_100a"), "sm90", id="arch"),
    pytest.param(dict(family="fa4", head_dim=512, head_dim_v=512), "FA4 on sm90 supports", id="fa4-d512"),
    pytest.param(dict(family="fa4", head_dim=128, head_dim_v=128, causal=True, window_left=8), "mutually exclusive",
                 id="causal-window"),
    pytest.param(dict(qhead_per_kvhead=0), "positive", id="gqa0"),
    pytest.param(dict(family="fa4", direction="bwd", head_dim=192, head_dim_v=128, qhead_per_kvhead=2), "GQA",
                 id="fa4-192-128-gqa-bwd"),
    pytest.param(dict(family="xyz"), "unknown kernel family", id="family"),
])
def test_unsupported_says_why(kw, words):
    reason = supports(spec(**kw))
    assert reason is not None and words in reason


def test_key_is_hashable_frozen_and_complete():
    a, b = spec(), spec()
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.causal = True
    # every field that changes the code changes the key
    for change in [dict(causal=True), dict(varlen=True), dict(qhead_per_kvhead=2), dict(dtype="float16"),
                   dict(direction="bwd"), dict(head_dim=384, head_dim_v=384), dict(arch="sm_90")]:
        assert spec(**change) != a, change
    assert dict(a.versions)["ffpa-attn"] == "0.2.4"
    assert spec(versions=(("ffpa-attn", "9.9"),)) != a


def test_versions_cover_kernel_stack():
    names = dict(library_versions())
    for dist in ("xattn", "nvidia-cutlass-dsl", "apache-tvm-ffi", "ffpa-attn", "flash-attn-4"):
        assert names[dist] != "missing", dist


def test_target_name_is_deterministic_across_processes():
    code = ("from xattn.core.spec import KernelSpec;"
            "print(KernelSpec('fa4','bwd','float16',192,128,4,True,True).target_name())")
    names = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
             for _ in range(2)}
    here = KernelSpec("fa4", "bwd", "float16", 192, 128, 4, True, True).target_name()
    assert names == {here + "\n"}
    assert here.startswith("xattn_fa4_bwd_float16_d192x128_g4_causal_varlen_sm_90a_")


def test_ffpa_gqa_ratio_must_divide_the_forward_tile():
    """A ratio that does not divide the 64-row tile failed to COMPILE (SplitD asserts); refuse it by name."""
    from xattn.core.spec import FFPA_FWD_TILE_M, KernelSpec, supports

    for direction in ("fwd", "bwd"):
        assert "GQA ratio must divide 64" in supports(KernelSpec("ffpa", direction, "float16", 448, 448, 3, False,
                                                                 True))
        assert supports(KernelSpec("ffpa", direction, "bfloat16", 512, 512, 8, True, False)) is None
    utils = pytest.importorskip("ffpa_attn.cute._utils")
    assert FFPA_FWD_TILE_M == utils.SM90_FWD_TILE_M
