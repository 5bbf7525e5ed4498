"""xattn.core.determinism: the decision table, and the kernel-source facts it rests on, re-read from
the installed ffpa-attn / flash-attn-4 so an upgrade that adds (or removes) a reduce-add fails here."""

import importlib.util
import pathlib
import re

import pytest

import xattn.core  # noqa: F401  (pins the DSL target before the kernel packages load)
from xattn.core.determinism import nondeterministic_op
from xattn.core.spec import KernelSpec

# Anything that adds into global memory in some order: atomics, TMA/bulk reduce-adds.
_UNORDERED_ADD = re.compile(r"atomic|reduce_bulk|cp\.reduce|reduction_kind|Reduce\w*S2G")


def _source(module: str) -> str:
    return pathlib.Path(importlib.util.find_spec(module).origin).read_text()


def _code(module: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in _source(module).splitlines())


@pytest.mark.parametrize("spec, op", [
    pytest.param(KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, 4, True), None, id="ffpa-fwd"),
    pytest.param(KernelSpec("ffpa", "bwd", "bfloat16", 512, 512, 1), None, id="ffpa-bwd-mha"),
    pytest.param(KernelSpec("ffpa", "bwd", "bfloat16", 512, 512, 8, True), None, id="ffpa-bwd-gqa8-causal"),
    pytest.param(KernelSpec("ffpa", "bwd", "float16", 384, 384, 4, False, True), None, id="ffpa-bwd-varlen-d384"),
    pytest.param(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, True, True), None, id="fa4-fwd"),
    pytest.param(KernelSpec("fa4", "bwd", "bfloat16", 128, 128, 1), "dQ over key blocks)", id="fa4-bwd-mha"),
    pytest.param(KernelSpec("fa4", "bwd", "bfloat16", 256, 256, 2, False, False, 63, 0),
                 "dQ over key blocks, dK/dV over the GQA group)", id="fa4-bwd-gqa2-window"),
])
def test_decision_table(spec, op):
    got = nondeterministic_op(spec)
    if op is None:
        assert got is None
    else:
        assert got.startswith("xattn backward (FA4 sm90 " + spec.short_name()) and got.endswith(op)


_FFPA_SM90 = ["_bwd_preprocess", "_dkdv_d512_sm90", "_dkdv_d384_sm90", "_dkdv_generic_sm90", "_dq_d512_sm90",
              "_dq_d384_sm90", "_dq_generic_sm90", "_fwd_d512_sm90", "_fwd_d384_sm90", "_fwd_generic_sm90"]


@pytest.mark.parametrize("module", _FFPA_SM90)
def test_ffpa_sm90_kernels_add_nothing_into_global_memory(module):
    """Each FFPA sm90 CTA owns its output tile and stores it plainly: bitwise reproducible."""
    assert not _UNORDERED_ADD.search(_code(f"ffpa_attn.cute.{module}"))


def test_ffpa_launcher_uses_exactly_those_modules():
    imported = set(re.findall(r"from ffpa_attn\.cute\.(\w+) import", _source("xattn.core.ffpa_sm90")))
    assert imported - {"_utils"} <= set(_FFPA_SM90)


def test_ffpa_dkdv_loops_over_the_gqa_group_inside_one_cta():
    src = _code("ffpa_attn.cute._dkdv_d512_sm90")
    assert "for q_head_offset in cutlass.range(self.qhead_per_kvhead" in src
    assert "cpasync.CopyBulkTensorTileS2GOp()" in src  # dK/dV: plain TMA stores


def test_fa4_backward_reduce_adds_dq_and_gqa_dkdv():
    src = _code("flash_attn.cute.flash_bwd_sm90")
    dq_store = src.split("def dQaccum_store", 1)[1].split("\n    def ", 1)[0]
    assert "cpasync_reduce_bulk_add_f32" in dq_store  # every key block adds its dQ partial
    assert src.count("cpasync_reduce_bulk_add_f32") == 3  # + dK and dV partials under GQA
    for fwd in ("flash_fwd_sm90", "flash_bwd_preprocess"):
        assert not _UNORDERED_ADD.search(_code(f"flash_attn.cute.{fwd}"))


def test_xattn_compiles_fa4_backward_without_its_deterministic_mode():
    """FA4 has deterministic=True on sm90 (semaphores); xattn's launchers do not use it. Wiring it in
    (fa4_sm90.py + semaphore workspace) must come with an update of xattn.core.determinism."""
    assert "deterministic=False" in _source("xattn.core.fa4_sm90")
    assert "mdQ_semaphore" in _source("flash_attn.cute.flash_bwd_sm90")
