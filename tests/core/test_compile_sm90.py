"""CI's proof that the kernels we ship build: every launcher family compiles for sm_90a.

Runs on a CPU-only machine (xattn pins CUTE_DSL_ARCH=sm_90a when no GPU is present) and
on the GPU machine alike. Each compile takes 2-7 s."""

import pytest
import tvm_ffi

from xattn.core import cache
from xattn.core.paged import PagedMetaSpec
from xattn.core.split_kv import CombineSpec, SlotCallSpec, SplitMetaSpec, split_launch_spec
from xattn.core.spec import KernelSpec

pytestmark = pytest.mark.compile


def _p(family, direction, d, dv=None, g=1, causal=False, varlen=False, window=(None, None), dtype="bfloat16"):
    spec = KernelSpec(family, direction, dtype, d, dv or d, g, causal, varlen, *window)
    return pytest.param(spec, id=spec.short_name())


SHIPPED = [
    # FFPA: the three sm90 kernel classes (d512 SplitD, <=384 D384-aware, generic), both passes.
    _p("ffpa", "fwd", 512),
    _p("ffpa", "fwd", 512, g=4, causal=True),
    _p("ffpa", "fwd", 512, g=4, causal=True, varlen=True),
    _p("ffpa", "fwd", 384, g=2, dtype="float16"),
    _p("ffpa", "fwd", 448, causal=True),
    _p("ffpa", "bwd", 512, g=4, causal=True),
    _p("ffpa", "bwd", 512, varlen=True),
    _p("ffpa", "bwd", 320, g=2, causal=True),
    _p("ffpa", "bwd", 448),
    # FA4: every sm90 head-dim config, GQA / causal / varlen / local, both passes.
    _p("fa4", "fwd", 128),
    _p("fa4", "fwd", 128, g=4, causal=True, varlen=True),
    _p("fa4", "fwd", 192, 128, g=4, causal=True),
    _p("fa4", "fwd", 256, g=2, window=(1023, 0)),
    _p("fa4", "fwd", 64, causal=True, dtype="float16"),
    _p("fa4", "fwd", 96, varlen=True),
    _p("fa4", "bwd", 128, g=4),
    _p("fa4", "bwd", 128, g=4, causal=True, varlen=True),
    _p("fa4", "bwd", 192, 128, causal=True),
    _p("fa4", "bwd", 256, g=2, window=(1023, 0)),
    _p("fa4", "bwd", 64, varlen=True),
    _p("fa4", "bwd", 96, g=2, causal=True),
]


def _gemm(kind, dtype="bfloat16", d32=False):
    from xattn.core.gemm_sm90 import GemmSpec

    spec = GemmSpec(kind, dtype, d32)
    return pytest.param(spec, id=spec.short_name())


# The chunked-GEMM d512 backward (xattn.core.gemm_sm90): every launcher kind, both dtypes of one.
SHIPPED += [_gemm(k) for k in ("probs_causal", "probs_full", "grad_scores", "mm_dq", "mm_kv")]
SHIPPED += [_gemm("acc", d32=True), _gemm("acc"), _gemm("probs_causal", "float16"), _gemm("acc", "float16", True),
            _gemm("mm_kv", d32=True)]
# Paged KV caches (xattn.core.paged_sm90): FFPA through its stand-ins, FA4 by TMA (page = key tile) and cp.async.
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (
    KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, 8, page_size=256),
    KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, page_size=128),
    KernelSpec("fa4", "fwd", "bfloat16", 256, 256, 2, True, page_size=16),
    KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, 4, True, True, page_size=64),  # prefill over the pages
    KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, True, True, page_size=16),
    KernelSpec("ffpa", "fwd", "bfloat16", 512, 512, 8, page_size=64, kv_heads_first=True),  # JAX's pool layout
    KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, page_size=128, kv_heads_first=True))]
# The paged split route's index kernel (xattn.core.paged_meta_sm90), with and without a causal tail.
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (PagedMetaSpec("ffpa", True), PagedMetaSpec("fa4", False),
                                                           PagedMetaSpec("ffpa", True, True))]
# The contiguous split route's index kernel (xattn.core.split_meta_sm90).
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (SplitMetaSpec("ffpa", True),
                                                           SplitMetaSpec("fa4", False, True))]
# FA4's split launch with the decode tile (xattn.core.split_kv.SplitFwdSpec), both dtypes.
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (
    split_launch_spec(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, varlen=True)),
    split_launch_spec(KernelSpec("fa4", "fwd", "float16", 128, 128, 1, varlen=True)),
    split_launch_spec(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, page_size=64)),  # paged: TMA per 64-key page
    split_launch_spec(KernelSpec("fa4", "fwd", "float16", 128, 128, 8, page_size=64, kv_heads_first=True)),
    split_launch_spec(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4, varlen=True), shared_q=True),  # q as it is
    split_launch_spec(KernelSpec("fa4", "fwd", "bfloat16", 128, 128, 4)))]  # the slot launch: dense, one sequence
# The split-KV route's combine (xattn.core.combine_sm90): whole rows per CTA at Dv 128 / 512, a CTA of one row's
# threads not a power of two at Dv 384, several such rows at Dv 96; every chunk the route picks.
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (
    CombineSpec("fa4", "bfloat16", 128, 4), CombineSpec("ffpa", "float16", 512, 16),
    CombineSpec("ffpa", "bfloat16", 384, 8), CombineSpec("fa4", "float16", 96, 16))]
# The slot call (xattn.core.slot_call_sm90): the slot launch and the combine in one host function, per family.
SHIPPED += [pytest.param(s, id=s.short_name()) for s in (
    SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 16), SlotCallSpec("fa4", "float16", 256, 256, 2, 8),
    SlotCallSpec("ffpa", "bfloat16", 512, 512, 8, 16), SlotCallSpec("ffpa", "float16", 512, 512, 4, 16, tail=True),
    SlotCallSpec("ffpa", "bfloat16", 384, 384, 4, 8, tail=True),  # the tail masked into the last slot, every kernel
    SlotCallSpec("ffpa", "bfloat16", 320, 320, 2, 4, tail=True),
    SlotCallSpec("ffpa", "bfloat16", 512, 512, 8, 4, batched=True),  # B > 1: the varlen splits, the dense tail
    SlotCallSpec("ffpa", "bfloat16", 384, 384, 4, 8, tail=True, batched=True),
    SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 4, batched=True),  # FA4's decode tile on q's own rows (shared_q)
    SlotCallSpec("fa4", "float16", 128, 128, 4, 8, tail=True, batched=True),  # the same, FA4's dense causal tail
    SlotCallSpec("fa4", "bfloat16", 256, 256, 2, 4, tail=True, batched=True))]  # no decode tile: the broadcast
# The packed route's (xattn.core.gemm_segments_sm90).
SHIPPED += [_gemm(k) for k in ("seg_probs", "seg_grad_scores", "seg_mm_dq", "seg_acc")] + [_gemm("seg_acc", "float16")]


@pytest.mark.parametrize("spec", SHIPPED)
def test_launcher_compiles_for_sm90(spec):
    cache.set_compiler(None)
    launcher = cache.get_launcher(spec)
    assert isinstance(launcher.function, tvm_ffi.Function)
    assert launcher.spec.arch == "sm_90a"


def test_segment_launchers_trace_their_table_offsets_and_restore_quacks_manager(monkeypatch):
    """Each seg_* launcher's traced kernel takes the operands' offsets from the table rows the module
    documents (xattn.core.gemm_segments_sm90), seg_acc on VarlenMTileScheduler; quack's own manager is
    back afterwards."""
    import quack.gemm_sm90 as sm90
    from quack.varlen_utils import VarlenManager

    from xattn.core import gemm_segments_sm90 as seg
    from xattn.core.gemm_sm90 import GemmSpec

    rows_read = []
    table = seg._TableManager._table
    monkeypatch.setattr(seg._TableManager, "_table", lambda self, row, b: rows_read.append((self.ROLE, row))
                        or table(self, row, b))
    want = {"seg_probs": {("rows", 0), ("rows", 1)}, "seg_grad_scores": {("rows", 0), ("rows", 1)},
            "seg_mm_dq": {("dq", 0), ("dq", 1)}, "seg_acc": {("keys", 0), ("keys", 2)}}
    for kind, reads in want.items():
        rows_read.clear()
        seg.compile_segment_gemm(GemmSpec(kind, "bfloat16"))
        assert set(rows_read) == reads, kind
        assert sm90.VarlenManager is VarlenManager


def test_paged_ffpa_maps_the_key_and_value_copies_only_and_restores_its_names():
    """FFPA pages through two stand-in names (xattn.core.paged_sm90): the page table must reach exactly
    the K and V copies (not Q's load or the output's stores), and FFPA's own names are back afterwards."""
    import ffpa_attn.cute._fwd_d512_sm90 as module
    from ffpa_attn.cute.utils.seqlen_info import SeqlenInfoQK
    from quack import copy_utils

    from xattn.core.paged_sm90 import compile_paged

    mapped = []
    compile_paged(KernelSpec("ffpa", "fwd", "bfloat16", 384, 384, 2, True, page_size=128), mapped)
    assert mapped == [2]
    assert module.SeqlenInfoQK is SeqlenInfoQK and module.copy_utils is copy_utils


def test_fa4_d96_unmasked_paged_kernel_is_built_with_the_128_row_tile(monkeypatch):
    """flash_attn.cute's d96 unmasked config (a 144-row key tile) gave wrong paged results on the GPU
    (xattn.core.paged_sm90): the paged launcher takes the causal config's 128-row tile; the unpaged launchers and
    the other head dims keep flash_attn's own."""
    from xattn.core import paged_sm90

    built = []

    class Recorder:
        def __init__(self, *args, tile_n, **kwargs):
            built.append(tile_n)
            raise StopIteration  # recorded: no compile needed

    monkeypatch.setattr(paged_sm90, "FlashAttentionForwardSm90", Recorder)
    for d, causal in ((96, False), (96, True), (128, False), (256, False)):
        with pytest.raises(StopIteration):
            paged_sm90.compile_paged(KernelSpec("fa4", "fwd", "bfloat16", d, d, 2, causal, page_size=128))
    assert built == [128, 128, 128, 80]
