"""The split-KV forward route of xattn.torch on the CPU stand-ins (tests/torch/stubs.py: the varlen forward and
the combine computed in fp64 under the kernels' contract): the split launch, the causal tail, the flat strided
views of k/v (FlashAttention's contiguous layout and HF's transposed cache) and the route choice."""

import pytest
import torch

import xattn.torch as xt
from xattn.core import routes, split_kv
from tests.reference import attention as ref_attention, varlen_attention as ref_varlen

from . import stubs

CALLS = stubs.CALLS


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)


def _decode_inputs(b, nq, hq, hkv, nk, d, layout, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, nq, hq, d, generator=g, dtype=torch.float64)
    if layout == "hf":  # HF's cache [B, Hkv, Nk, D], handed over transposed (no copy)
        k = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64).transpose(1, 2)
        v = torch.randn(b, hkv, nk, d, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        k = torch.randn(b, nk, hkv, d, generator=g, dtype=torch.float64)
        v = torch.randn(b, nk, hkv, d, generator=g, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("b, nq, hq, hkv, nk, causal, splits", [
    pytest.param(1, 1, 8, 1, 700, True, 3, id="B1-q1-g8-causal"),
    pytest.param(3, 1, 8, 2, 517, False, 4, id="B3-q1-g4"),
    pytest.param(2, 4, 4, 4, 300, True, 2, id="B2-q4-causal-tail"),
    pytest.param(2, 5, 4, 2, 3, True, 2, id="causal-tail-longer-than-cache"),
    pytest.param(2, 3, 4, 2, 1, False, 5, id="one-key-more-splits-than-keys"),
    pytest.param(1, 16, 2, 1, 1000, True, 7, id="16-speculative-queries"),
    pytest.param(1, 4, 8, 2, 900, True, 3, id="B1-q4-tail-written-in-place"),
    pytest.param(1, 5, 4, 2, 3, True, 2, id="B1-tail-longer-than-cache-copied"),
])
def test_split_route_matches_fp64(layout, b, nq, hq, hkv, nk, causal, splits):
    q, k, v = _decode_inputs(b, nq, hq, hkv, nk, 16, layout, seed=nk + nq)
    out, lse = xt.attention_with_lse(q, k, v, causal=causal, family="ffpa", num_splits=splits)
    ref_out, ref_lse = ref_attention(q, k, v, scale=16 ** -0.5, causal=causal)
    assert ("combine", "ffpa") in CALLS, "the split route did not run"
    tail = causal and nq > 1  # fp64: the tail's launch of its own (the slot call alone masks it in the split launch)
    assert sum(c == ("fwd", "ffpa") for c in CALLS) == 1 + tail
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)  # the partial lse is fp32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("family, d", [("ffpa", 16), ("fa4", 128)])
@pytest.mark.parametrize("nq, nk, causal, splits", [
    (4, 900, True, 3), (16, 1000, True, 7), (2, 2051, True, 5), (3, 131, True, 2), (5, 6, True, 4),  # a causal tail
    (1, 700, True, 3), (1, 1536, True, 3), (1, 5, False, 4), (3, 1001, False, 6),  # keys left over, or none
])
def test_one_sequence_runs_the_slot_launch(layout, family, d, nq, nk, causal, splits, monkeypatch):
    """B = 1, S dividing the keys, in a dtype without the slot call (fp64 here): the splits are one dense launch
    reading q through a batch stride of 0 (no copy of q per slot) and equal key chunks through a strided view of the
    cache, then the combine. Keys left over, or a causal tail (the slot call alone masks it into the last slot): the
    varlen launch. FA4 d128: its decode tile."""
    from xattn.core.split_kv import SplitFwdSpec
    from xattn.torch import ops

    seen, fwd = [], ops.LAUNCH["fwd"]
    monkeypatch.setitem(ops.LAUNCH, "fwd", lambda checked, q, k, *a, **kw: (seen.append((checked[0], q, k)),
                                                                            fwd(checked, q, k, *a, **kw))[1])
    q, k, v = _decode_inputs(1, nq, 8, 2, nk, d, layout, seed=nk + nq)
    out, lse = xt.attention_with_lse(q, k, v, causal=causal, family=family, num_splits=splits)
    ref_out, ref_lse = ref_attention(q, k, v, scale=d ** -0.5, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-5)
    dense = [x for x in seen if not x[0].varlen]
    plan = split_kv.plan_splits(splits, causal and nq > 1, nq, nk)
    launch = split_kv.slot_launch(plan, family, 1, nk, nq)
    if launch is None or plan.tail:  # keys left over, FA4's tail, or a tail in fp64: the varlen launch
        assert not dense and (plan.tail or nk % plan.splits)
        assert launch is None or launch.tail and family == "ffpa"
        return
    assert len(dense) == 1 == len(seen) and not dense[0][0].causal
    assert isinstance(dense[0][0], SplitFwdSpec) == (family == "fa4")  # FA4 d128: split_kv.SPLIT_TILES
    spec, q_slots, k_slots = dense[0]
    slots, chunk = k_slots.shape[:2]
    assert q_slots.shape == (slots, nq, 8, d) and q_slots.stride(0) == 0 and q_slots.data_ptr() == q.data_ptr()
    assert k_slots.data_ptr() == k.data_ptr() and k_slots.stride(0) == chunk * k.stride(1)  # views, no copies
    assert (slots, chunk, chunk) == (plan.splits, launch.chunk, launch.keys) and slots * chunk == nk


def _record_slot_calls() -> list:
    """``[(spec, splits), ...]`` of every slot call from here on (stubs.install restores LAUNCH per test)."""
    from xattn.torch import ops

    seen, real = [], ops.LAUNCH["slot_call"]

    def record(spec, *args, splits, **kw):
        seen.append((spec, splits))
        return real(spec, *args, splits=splits, **kw)

    ops.LAUNCH["slot_call"] = record
    return seen


@pytest.mark.parametrize("capturing", [False, True], ids=["host-lists", "device-arithmetic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("family, d, nq, nk, causal, splits", [
    ("fa4", 128, 1, 1536, True, 3), ("fa4", 128, 1, 1500, True, 4), ("ffpa", 16, 3, 1024, False, 7),
    ("fa4", 64, 2, 640, False, 5), ("ffpa", 16, 1, 900, True, 6),
    ("ffpa", 16, 4, 900, True, 3), ("ffpa", 16, 16, 1000, True, 7), ("ffpa", 16, 5, 6, True, 4),  # causal tails
    ("ffpa", 16, 2, 2051, True, 5), ("ffpa", 16, 3, 131, True, 2), ("ffpa", 16, 4, 4096, True, 8),
])
def test_one_sequence_is_one_slot_call(layout, family, d, nq, nk, causal, splits, dtype, capturing, monkeypatch):
    """B = 1 on the slot launch (S dividing the keys, or FFPA's causal tail in its last slot), 16-bit inputs: the
    split route is one core call (the slot launch and the combine in one host function, xattn.core.slot_call_sm90;
    the stand-in applies the last slot's mask) whose compile key names the split launch and the combine's chunk for
    P = S; twice on the same signature, still one call each. Values against fp64 within the partials' rounding to
    the input dtype. ``capturing``: set up as under CUDA-graph capture (the tail's bounds by device arithmetic)."""
    from xattn.core.split_kv import SlotCallSpec, combine_chunk, split_launch_spec
    from xattn.core.spec import KernelSpec
    from xattn.torch import split_kv as torch_split_kv

    monkeypatch.setattr(torch_split_kv, "_capturing", lambda device: capturing)
    monkeypatch.setattr(torch_split_kv, "_SETUPS", type(torch_split_kv._SETUPS)(256))  # set up afresh, this way
    seen = _record_slot_calls()
    plan = split_kv.plan_splits(splits, causal and nq > 1, nq, nk)
    slots = split_kv.slot_launch(plan, family, 1, nk, nq)
    assert slots.tail == plan.tail and slots.partials == plan.splits and slots.chunk == nk // plan.splits
    for seed in (1, 2):
        q, k, v = (t.to(dtype) for t in _decode_inputs(1, nq, 8, 2, nk, d, layout, seed=seed))
        CALLS.clear()
        out, lse = xt.attention_with_lse(q, k, v, causal=causal, family=family, num_splits=splits)
        assert CALLS == [("slot_call", family)], CALLS
        ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), scale=d ** -0.5, causal=causal)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)  # partials rounded to dtype
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    name = str(dtype).removeprefix("torch.")
    want = SlotCallSpec(family, name, d, d, 4, combine_chunk(plan.splits), tail=plan.tail)
    assert seen == [(want, plan.splits)] * 2
    assert want.launch_spec() == split_launch_spec(KernelSpec(family, "fwd", name, d, d, 4, False, False))
    assert want.tail_spec() is None  # one sequence: no tail launch of its own


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("b, nq, nk, causal, splits", [
    (3, 1, 1536, True, 3), (2, 1, 517, False, 4), (4, 4, 900, True, 3), (2, 16, 1000, True, 7),
    (3, 3, 640, False, 5), (2, 5, 6, True, 2), (2, 5, 3, True, 2), (5, 2, 300, True, 2),
])
@pytest.mark.parametrize("family, d", [("ffpa", 16), ("fa4", 16), ("fa4", 128)])
def test_a_batch_is_one_batched_slot_call(family, d, layout, b, nq, nk, causal, splits, dtype):
    """B > 1 sequences of full caches, 16-bit, both families (xattn.core.split_kv.batched_slot_call): one core call
    (q copied per slot, or FA4's decode tile reading q's own rows (d128, GQA: shared_q), the varlen split launch, the
    causal tail as the dense causal forward on each sequence's last Nq keys, the combine; xattn.core.slot_call_sm90
    "Batched") for any split count (S need not divide the keys), both cache layouts, q handed over transposed (HF)
    too; the compile key names the launches inside. Values against fp64."""
    from xattn.core.split_kv import SlotCallSpec, combine_chunk, split_launch_spec
    from xattn.core.spec import KernelSpec

    seen = _record_slot_calls()
    plan = split_kv.plan_splits(splits, causal and nq > 1, nq, nk)
    assert split_kv.batched_slot_call(plan, family, b) == plan.filled
    for seed in (1, 2):
        q, k, v = (t.to(dtype) for t in _decode_inputs(b, nq, 8, 2, nk, d, layout, seed=seed))
        if layout == "hf":  # HF's q [B, Hq, Nq, D] too
            q = q.transpose(1, 2).contiguous().transpose(1, 2)
        CALLS.clear()
        out, lse = xt.attention_with_lse(q, k, v, causal=causal, family=family, num_splits=splits)
        assert CALLS == ([("slot_call", family)] if plan.filled else CALLS) and CALLS, CALLS
        ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), scale=d ** -0.5, causal=causal)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)  # partials rounded to dtype
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    if not plan.filled:  # (a tail longer than the cache: the launches one by one, pre-filled)
        assert not seen
        return
    name = str(dtype).removeprefix("torch.")
    want = SlotCallSpec(family, name, d, d, 4, combine_chunk(plan.partials), tail=plan.tail, batched=True)
    assert seen == [(want, plan.splits)] * 2
    assert want.shared_q == (family == "fa4" and d == 128)
    split = split_launch_spec(KernelSpec(family, "fwd", name, d, d, 4, False, True), shared_q=True)
    assert want.launch_spec() == split and getattr(split, "shared_q", False) == want.shared_q
    assert want.tail_spec() == (KernelSpec(family, "fwd", name, d, d, 4, True, False) if plan.tail else None)


def test_a_batch_of_wide_dtypes_keeps_the_launches_one_by_one():
    """The batched slot call is the kernels' 16-bit dtypes' (the launchers take no other): fp32 runs the launches."""
    for family, dtype in (("fa4", torch.float32), ("ffpa", torch.float32)):
        q, k, v = (t.to(dtype) for t in _decode_inputs(2, 1, 8, 2, 1024, 16, "contiguous", seed=4))
        CALLS.clear()
        out = xt.attention(q, k, v, causal=True, family=family, num_splits=4)
        assert ("slot_call", family) not in CALLS and ("combine", family) in CALLS, CALLS
        ref_out, _ = ref_attention(q.double(), k.double(), v.double(), scale=16 ** -0.5, causal=True)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)


def test_the_batched_slot_call_refuses_index_arrays_key_rows_or_work_that_do_not_fit():
    """launch_slot_call names a batched call's missing or mis-sized cu_seqlens, keys not a whole number of rows per
    sequence, and a work buffer too small, before any launch."""
    from xattn.core.api import launch_slot_call
    from xattn.core.split_kv import SlotCallSpec

    spec = SlotCallSpec("ffpa", "bfloat16", 512, 512, 4, 4, tail=True, batched=True)
    b, nq, nk, s = 2, 4, 1024, 3
    q, out, lse = torch.empty(b, nq, 8, 512), torch.empty(b, nq, 8, 512), torch.empty(b, 8, nq)
    k = torch.empty(b, nk, 2, 512)
    floats = split_kv.slot_work_floats(s + 1, nq, 8, 512, b, 512)
    cu = torch.zeros(b * (s + 2) + 1, dtype=torch.int32)
    kw = dict(splits=s, softmax_scale=0.1)
    with pytest.raises(ValueError, match="cu_seqlens: required"):
        launch_slot_call(spec, q, k, k, out, lse, torch.empty(floats), **kw)
    with pytest.raises(ValueError, match="slot_bounds: not taken"):
        launch_slot_call(spec, q, k, k, out, lse, torch.empty(floats), slot_bounds=cu[:2], cu_seqlens=(cu, cu), **kw)
    with pytest.raises(ValueError, match=r"cu_q expected \[11\]"):
        launch_slot_call(spec, q, k, k, out, lse, torch.empty(floats), cu_seqlens=(cu[:-1], cu), **kw)
    bad = torch.empty(b * nk * 2 * 512 + 512)[256:].as_strided((b, nk, 2, 512), (nk * 1024 + 256, 1024, 512, 1))
    with pytest.raises(ValueError, match="whole number"):
        launch_slot_call(spec, q, bad, bad, out, lse, torch.empty(floats), cu_seqlens=(cu, cu), **kw)
    with pytest.raises(ValueError, match=f"at least {floats} floats"):
        launch_slot_call(spec, q, k, k, out, lse, torch.empty(floats - 1), cu_seqlens=(cu, cu), **kw)
    shared = SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 4, tail=True, batched=True)  # FA4's decode tile
    assert shared.shared_q and not SlotCallSpec("fa4", "bfloat16", 256, 256, 4, 4, batched=True).shared_q
    q, out = torch.empty(b, nq, 8, 128), torch.empty(b, nq, 8, 128)
    k = torch.empty(b, nk, 2, 128)
    floats = split_kv.slot_work_floats(s + 1, nq, 8, 128, b, 128)
    with pytest.raises(ValueError, match="rows apart"):  # HF's transposed q: its sequences not Nq rows apart
        launch_slot_call(shared, q.transpose(1, 2).contiguous().transpose(1, 2), k, k, out, lse,
                         torch.empty(floats), cu_seqlens=(cu, cu), **kw)


def test_under_capture_a_causal_tail_is_the_same_one_slot_call():
    """Under CUDA-graph capture (stood in for here) a step with FFPA's causal tail is the one slot call as eagerly
    (the tail is the split launch's last slot: nothing to run beside it); the same memo serves both."""
    from xattn.torch import split_kv as torch_split_kv

    q, k, v = (t.to(torch.bfloat16) for t in _decode_inputs(1, 4, 8, 2, 900, 16, "contiguous", seed=3))
    ref_out, _ = ref_attention(q.double(), k.double(), v.double(), scale=16 ** -0.5, causal=True)
    for capturing in (True, False):
        torch_split_kv._capturing, real = (lambda device, _c=capturing: _c), torch_split_kv._capturing
        try:
            CALLS.clear()
            out = xt.attention(q, k, v, causal=True, family="ffpa", num_splits=3)
        finally:
            torch_split_kv._capturing = real
        assert CALLS == [("slot_call", "ffpa")]
        torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)


def test_the_slot_call_refuses_a_split_count_or_work_buffer_that_does_not_fit():
    """The core entry names a bad S (not dividing Nk, out of range) or a work buffer too small before any launch."""
    from xattn.core.api import launch_slot_call
    from xattn.core.split_kv import SlotCallSpec

    spec = SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 4)
    q, k = torch.empty(1, 1, 8, 128), torch.empty(1, 1024, 2, 128)
    out, lse = torch.empty(1, 1, 8, 128), torch.empty(1, 8, 1)
    floats = split_kv.slot_work_floats(4, 1, 8, 128)
    with pytest.raises(ValueError, match="at most the splits' keys"):  # no key at all: every slot empty
        launch_slot_call(spec, q, k[:, :0], k[:, :0], out, lse, torch.empty(floats), splits=4, softmax_scale=0.1)
    for splits, work, match in ((3, floats, "divide Nk 1024"), (0, floats, "splits"),
                                (128, floats, "splits"), (4, floats - 1, f"at least {floats} floats")):
        with pytest.raises(ValueError, match=match):
            launch_slot_call(spec, q, k, k, out, lse, torch.empty(work), splits=splits, softmax_scale=0.1)
    bounds = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_bounds: not taken"):
        launch_slot_call(spec, q, k, k, out, lse, torch.empty(floats), splits=4, softmax_scale=0.1,
                         slot_bounds=bounds)
    tail = SlotCallSpec("ffpa", "bfloat16", 512, 512, 4, 8, tail=True)
    q5, k5, out5, lse5 = torch.empty(1, 4, 8, 512), torch.empty(1, 7, 2, 512), torch.empty(1, 4, 8, 512), \
        torch.empty(1, 8, 4)
    for kw, match in ((dict(), "slot_bounds: required"), (dict(slot_bounds=bounds), "leave the last slot Nq keys")):
        with pytest.raises(ValueError, match=match):  # 7 keys in 2 slots: the last one holds 4, Nq 4: fine; 3: not
            launch_slot_call(tail, q5, k5, k5, out5, lse5, torch.empty(10 ** 6), splits=3, softmax_scale=0.1, **kw)
    with pytest.raises(ValueError, match="chunk one of"):
        SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 5)
    with pytest.raises(ValueError, match="causal tail in the last slot"):
        SlotCallSpec("fa4", "bfloat16", 128, 128, 4, 4, tail=True)


@pytest.mark.parametrize("family, d, nq, nk", [("fa4", 128, 1, 1536), ("ffpa", 16, 4, 900)],
                         ids=["fa4-even", "ffpa-tail"])
def test_a_signature_seen_before_runs_the_slot_launch_from_its_memo(family, d, nq, nk, monkeypatch):
    """The second call of a decode signature on the slot launch makes none of the decisions again (no validation,
    route or slot plan: xattn.torch.ops._SLOT_CALLS) and is still right on other values and another key layout of
    the same shapes (HF's transposed cache: the views follow the call's strides); a changed route request
    (XATTN_FWD_ROUTE) or num_splits is another signature."""
    from xattn.core import split_kv as core_split_kv
    from xattn.torch import ops

    def run(layout, seed, **kw):  # FFPA's tail: 16-bit (the slot call alone masks it into the last slot)
        q, k, v = _decode_inputs(1, nq, 8, 2, nk, d, layout, seed)
        if family == "ffpa":
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        out, lse = xt.attention_with_lse(q, k, v, causal=True, family=family, **kw)
        ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), scale=d ** -0.5, causal=True)
        tol = 2e-2 if family == "ffpa" else 1e-6  # the partials rounded to bf16
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)

    run("contiguous", 1, num_splits=3)
    assert len(ops._SLOT_CALLS) == 1
    decided = []
    for owner, name in ((ops, "_fwd_setup"), (ops, "_fwd_route"), (core_split_kv, "slot_launch")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _real=real, _name=name, **kw: (decided.append(_name),
                                                                                    _real(*a, **kw))[1])
    CALLS.clear()
    run("hf", 2, num_splits=3)
    ran = ("slot_call" if family == "ffpa" else "combine", family)  # FA4 fp64: the launches one by one
    assert not decided and ran in CALLS, "the memo did not run the slot launch"
    run("contiguous", 3, num_splits=4)  # another split count: decided afresh
    assert "_fwd_route" in decided and len(ops._SLOT_CALLS) == 2
    decided.clear()
    CALLS.clear()
    monkeypatch.setenv("XATTN_FWD_ROUTE", "fused")
    run("contiguous", 4, num_splits=3)  # the same call under another route request: the fused kernel
    assert "_fwd_route" in decided and ran not in CALLS and ("combine", family) not in CALLS


def test_the_slot_launch_takes_one_sequence_split_evenly_or_with_ffpas_tail_in_its_last_slot():
    plan = split_kv.plan_splits(8, True, 4, 4096)
    assert split_kv.slot_launch(plan, "ffpa", 1, 4096, 4) == split_kv.SlotLaunch(512, 512, 8, True)
    assert split_kv.slot_launch(split_kv.plan_splits(7, True, 4, 4100), "ffpa", 1, 4100, 4) == \
        split_kv.SlotLaunch(585, 4100 - 6 * 585, 7, True)  # the last slot holds the remainder
    assert split_kv.slot_launch(plan, "fa4", 1, 4096, 4) is None  # FA4's tail: split_kv.TAIL_SLOT_FAMILIES
    assert split_kv.slot_launch(plan, "ffpa", 2, 4096, 4) is None  # two sequences: q once per slot, or shared_q
    assert split_kv.slot_launch(split_kv.plan_splits(8, False, 4, 4096), "ffpa", 1, 4096, 4) == \
        split_kv.SlotLaunch(512, 512, 8)  # S divides the keys
    assert split_kv.slot_launch(split_kv.plan_splits(4, False, 1, 1024), "fa4", 1, 1024, 1) == \
        split_kv.SlotLaunch(256, 256, 4)
    assert split_kv.slot_launch(split_kv.plan_splits(3, False, 1, 700), "fa4", 1, 700, 1) is None  # a key left over
    assert split_kv.slot_launch(split_kv.plan_splits(8, True, 4, None), "ffpa", 1, 4096, 4) is None  # lengths per call
    assert split_kv.slot_launch(split_kv.plan_splits(2, True, 5, 3), "ffpa", 1, 3, 5) is None  # tail longer than keys


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("b, causal, nq", [(2, False, 1), (2, True, 4), (4, True, 2), (3, True, 3), (2, True, 1)])
def test_fa4_d128_split_launch_runs_the_decode_tile_on_q_as_it_is(layout, b, causal, nq, monkeypatch):
    """The split launch of FA4 d128 (two or more sequences; one takes the slot launch) is the core's decode tile
    (split_kv.SPLIT_TILES) reading q's own B*Nq rows for every slot (shared_q: no copy of q per slot); the causal
    tail is FlashAttention's own tile."""
    from xattn.core.split_kv import SplitFwdSpec
    from xattn.torch import ops

    seen, fwd = [], ops.LAUNCH["fwd"]
    monkeypatch.setitem(ops.LAUNCH, "fwd", lambda checked, q, *a, **kw: (seen.append((checked[0], q)),
                                                                         fwd(checked, q, *a, **kw))[1])
    q, k, v = _decode_inputs(b, nq, 8, 2, 900, 128, layout, seed=3 + b + nq)
    out, lse = xt.attention_with_lse(q, k, v, causal=causal, family="fa4", num_splits=3)
    tiled = [(s, q_launch) for s, q_launch in seen if isinstance(s, SplitFwdSpec)]
    assert len(tiled) == 1 and (tiled[0][0].tile_m, tiled[0][0].tile_n) == (64, 64) and not tiled[0][0].causal
    assert tiled[0][0].shared_q and tiled[0][1].shape == (b * nq, 8, 128) and tiled[0][1].data_ptr() == q.data_ptr()
    assert len(seen) == 1 + (causal and nq > 1)  # the causal tail: FlashAttention's own tile
    ref_out, ref_lse = ref_attention(q, k, v, scale=128 ** -0.5, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-6, rtol=1e-5)


def test_fa4_d128_packed_decode_and_cache_seqlens_read_q_as_it_is(monkeypatch):
    """The device-length split route (attention_with_kvcache's cache_seqlens, packed decode steps) on the shared-q
    launch: one sequence of none, one of a key, odd lengths; the packed step with empty documents."""
    from xattn.core.split_kv import SplitFwdSpec
    from xattn.torch import ops

    specs, fwd = [], ops.LAUNCH["fwd"]
    monkeypatch.setitem(ops.LAUNCH, "fwd", lambda checked, *a, **kw: (specs.append(checked[0]), fwd(checked, *a, **kw)))
    q, k, v = _decode_inputs(4, 2, 8, 2, 700, 128, "contiguous", seed=9)
    lengths = torch.tensor([700, 0, 1, 333], dtype=torch.int32)
    out = xt.attention_with_kvcache(q, k, v, cache_seqlens=lengths, causal=True, num_splits=4)
    for i, n in enumerate(lengths.tolist()):
        if n:
            ref, _ = ref_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], scale=128 ** -0.5, causal=True)
            torch.testing.assert_close(out[i:i + 1], ref, atol=1e-6, rtol=1e-5)
    lens_q, lens_k = [2, 0, 1, 3], [500, 9, 300, 700]
    cu_q = torch.tensor([0] + torch.tensor(lens_q).cumsum(0).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + torch.tensor(lens_k).cumsum(0).tolist(), dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    qp = torch.randn(int(cu_q[-1]) + 2, 8, 128, generator=g, dtype=torch.float64)  # two trailing rows
    kp, vp = (torch.randn(int(cu_k[-1]), 2, 128, generator=g, dtype=torch.float64) for _ in range(2))
    out = xt.attention(qp, kp, vp, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=3,
                       max_seqlen_k=700, num_splits=4)
    ref, _ = ref_varlen(qp, kp, vp, cu_q, cu_k, scale=128 ** -0.5, causal=True)
    torch.testing.assert_close(out[:int(cu_q[-1])], ref[:int(cu_q[-1])], atol=1e-6, rtol=1e-5)
    assert any(isinstance(s, SplitFwdSpec) and s.shared_q for s in specs)


def test_auto_route_splits_a_long_cache_and_not_a_prefill():
    q, k, v = _decode_inputs(1, 1, 8, 1, 4096, 16, "contiguous", seed=1)
    xt.attention(q, k, v, causal=True, family="ffpa")
    assert ("combine", "ffpa") in CALLS
    CALLS.clear()
    q, k, v = _decode_inputs(1, 64, 8, 1, 4096, 16, "contiguous", seed=2)
    xt.attention(q, k, v, causal=True, family="ffpa")
    assert ("combine", "ffpa") not in CALLS and CALLS == [("fwd", "ffpa")]


def test_num_splits_one_and_the_forced_routes():
    q, k, v = _decode_inputs(1, 1, 8, 1, 4096, 16, "contiguous", seed=3)
    xt.attention(q, k, v, family="ffpa", num_splits=1)
    assert CALLS == [("fwd", "ffpa")]
    with routes.forced_forward("fused"):
        xt.attention(q, k, v, family="ffpa")
    assert ("combine", "ffpa") not in CALLS
    with pytest.raises(ValueError, match="window"), routes.forced_forward("split-kv"):
        xt.attention(q, k, v, family="fa4", window_size=(8, 0))
    with pytest.raises(ValueError, match="num_splits"):
        xt.attention(q, k, v, family="ffpa", num_splits=-1)


def test_strides_without_a_common_row_stride_stay_fused():
    """k sliced along the heads of a bigger buffer with an odd batch stride: no flat view, so fused."""
    q, _, _ = _decode_inputs(2, 1, 4, 2, 600, 16, "contiguous", seed=4)
    big = torch.randn(2 * 19224, dtype=torch.float64)
    k = big.as_strided((2, 600, 2, 16), (19224, 32, 16, 1))  # 19224 % 32 != 0
    with routes.forced_forward("split-kv"), pytest.raises(ValueError, match="row stride"):
        xt.attention(q, k, k, family="ffpa")
    out = xt.attention(q, k, k, family="ffpa", num_splits=4)  # auto: the fused kernel
    torch.testing.assert_close(out, ref_attention(q, k, k, scale=0.25)[0], atol=1e-10, rtol=1e-10)
    assert ("combine", "ffpa") not in CALLS


@pytest.mark.parametrize("seed", range(40))
def test_device_cu_seqlens_equal_the_core_plan(seed):
    """The device formulas (no host-to-device copy: capturable) give the core's documents, for plans with one
    chunk (every sequence full) and with per-sequence chunks (device lengths)."""
    import random

    from xattn.core import split_kv
    from xattn.torch.split_kv import device_cu_seqlens_k, device_cu_seqlens_q
    r = random.Random(seed)
    b, nq, nk = r.randint(1, 4), r.randint(1, 16), r.randint(1, 5000)
    rows = nk * r.choice([1, 4])
    causal, splits = r.random() < 0.5, r.randint(2, 60)
    static, packed = r.random() < 0.5, r.random() < 0.3
    lengths = [nk] * b if static else [r.randint(0, nk) for _ in range(b)]
    plan = split_kv.plan_splits(splits, causal, nq, nk if static else None)
    key_rows = rows * (b - 1) + nk
    starts = None
    if packed:  # packed keys: each document starts where the previous one's keys end (trailing rows after)
        starts = [sum(lengths[:i]) for i in range(b)]
        key_rows = sum(lengths) + r.randint(0, 7)
    want = split_kv.split_cu_seqlens(plan, nq, rows, lengths, key_rows, starts)
    cu_q, tail_q = device_cu_seqlens_q(plan, b, nq, "cpu")
    cu_k, tail_k = device_cu_seqlens_k(plan, nq, rows, key_rows, torch.tensor(lengths),
                                       None if starts is None else torch.tensor(starts))
    got = [cu_q.tolist(), cu_k.tolist(), tail_q.tolist() if plan.tail else [], tail_k.tolist() if plan.tail else []]
    assert got == [list(x) for x in want]


def test_int32_lists_are_one_tensor_with_aligned_views():
    from xattn.torch.split_kv import int32_lists

    a, none, b, c = int32_lists(torch.device("cpu"), [0, 3, 7], [], [5], list(range(9)))
    assert none is None and a.dtype == b.dtype == c.dtype == torch.int32
    assert (a.tolist(), b.tolist(), c.tolist()) == ([0, 3, 7], [5], list(range(9)))
    assert a.untyped_storage().data_ptr() == c.untyped_storage().data_ptr()  # one tensor, one copy
    assert all(t.data_ptr() % 16 == 0 for t in (a, b, c))  # each view starts on 16 bytes, as a fresh tensor


@pytest.mark.parametrize("tree_pool", [True, False], ids=["graph-tree-warming-up", "eager"])
def test_outside_graph_pools_reuses_one_worker_and_runs_nested_builds_in_it(tree_pool, monkeypatch):
    """While a CUDA-graph tree of this thread may be warming up (torch.compile's trees send the caller's allocations
    to a graph pool), CUDA builds run in one worker thread, started once; a build that asks again runs in place (a
    nested submit to the one worker would wait for itself). With no tree at work they run here (no thread hop).
    The CUDA calls are stand-ins here."""
    import contextlib
    import threading

    from xattn.torch import split_kv as sk

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(sk, "_graph_tree_pool", lambda device: tree_pool)
    cuda = torch.device("cuda", 0)
    ident = lambda: threading.get_ident()  # noqa: E731
    outer, inner = sk.outside_graph_pools(lambda: (ident(), sk.outside_graph_pools(ident, cuda)), cuda)
    again = sk.outside_graph_pools(ident, cuda)
    here = threading.get_ident()
    assert outer == inner == again != here if tree_pool else outer == inner == again == here
    assert sk.outside_graph_pools(ident, torch.device("cpu")) == here


def test_graph_tree_pool_reads_this_threads_tree_manager(monkeypatch):
    """A graph pool may be at work where this thread's tree manager on the device warms up or records; not where the
    trees were never imported or the thread has no manager; and yes where torch's internals do not answer."""
    import sys
    import threading
    import types

    from xattn.torch import split_kv as sk

    cuda = torch.device("cuda", 0)
    monkeypatch.delitem(sys.modules, "torch._inductor.cudagraph_trees", raising=False)
    assert not sk._graph_tree_pool(cuda)

    def trees(manager):
        local = threading.local()
        local.tree_manager_containers = {0: types.SimpleNamespace(tree_manager=manager)}
        return types.SimpleNamespace(local=local, get_obj=lambda loc, name: getattr(loc, name))

    manager = lambda warmup, recording: types.SimpleNamespace(in_warmup=warmup, in_recording=recording)  # noqa: E731
    for value, expected in ((manager(True, False), True), (manager(False, True), True),
                            (manager(False, False), False), (None, False)):
        monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", trees(value))
        assert sk._graph_tree_pool(cuda) == expected, value
    broken = trees(manager(False, False))
    broken.get_obj = lambda loc, name: 1 / 0
    monkeypatch.setitem(sys.modules, "torch._inductor.cudagraph_trees", broken)
    assert sk._graph_tree_pool(cuda)


def _packed(lens_q, lens_k, hq, hkv, d, dv, seed, trailing_q=0, trailing_k=0):
    g = torch.Generator().manual_seed(seed)
    cu = lambda lens: torch.tensor([sum(lens[:i]) for i in range(len(lens) + 1)], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q) + trailing_q, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k) + trailing_k, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k) + trailing_k, hkv, dv, generator=g, dtype=torch.float64)
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("family, lens_q, lens_k, hq, hkv, causal, splits, tq_extra, tk_extra", [
    pytest.param("ffpa", [1, 1, 1], [700, 33, 1290], 8, 1, True, 3, 0, 0, id="decode-3-docs-g8"),
    pytest.param("ffpa", [4, 0, 1, 3], [900, 500, 0, 2], 4, 2, True, 4, 2, 5, id="empty-docs-trailing-rows"),
    pytest.param("fa4", [2, 5, 1], [3, 600, 1], 4, 4, True, 2, 1, 0, id="tail-longer-than-keys"),
    pytest.param("fa4", [16, 7], [1000, 257], 2, 1, False, 7, 0, 3, id="16-queries-not-causal"),
    pytest.param("ffpa", [3], [2000], 8, 2, True, 5, 3, 0, id="one-doc-fewer-queries-than-max"),
])
def test_packed_split_route_matches_fp64(family, lens_q, lens_k, hq, hkv, causal, splits, tq_extra, tk_extra):
    """Packed decoding (vLLM's and HF continuous batching's decode calls) on the split route, drawn from the
    varlen contract: empty and 1-token documents, a document with fewer queries than max_seqlen_q, a causal
    document with fewer keys than queries, rows past cu_seqlens_q[-1] and cu_seqlens_k[-1]."""
    d, dv = (16, 16) if family == "ffpa" else (32, 24)
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, hq, hkv, d, dv, seed=sum(lens_k), trailing_q=tq_extra,
                                  trailing_k=tk_extra)
    max_q = max(lens_q) + (family == "ffpa")  # a max_seqlen_q above every document's is within the contract
    with routes.forced_forward("split-kv"):
        out, lse = xt.attention_with_lse(q, k, v, causal=causal, family=family, cu_seqlens_q=cu_q,
                                         cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max(lens_k),
                                         num_splits=splits)
    assert ("combine", family) in CALLS, "the split route did not run"
    ref_out, ref_lse = ref_varlen(q, k, v, cu_q, cu_k, scale=d ** -0.5, causal=causal)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    torch.testing.assert_close(lse[finite].double(), ref_lse[finite], atol=1e-6, rtol=1e-5)


def test_packed_decode_auto_route_and_its_gradient():
    """auto: a packed decode batch on a long cache splits, a packed prefill does not; the backward of a split
    forward (the fused one, on its out and lse) gives fp64's gradients."""
    q, k, v, cu_q, cu_k = _packed([1, 2], [4000, 3000], 4, 4, 16, 16, seed=5)  # g 1: the fused backward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = xt.attention(*leaves, causal=True, family="ffpa", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2,
                       max_seqlen_k=4000)
    assert ("combine", "ffpa") in CALLS
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = ref_varlen(*ref_leaves, cu_q, cu_k, scale=0.25, causal=True)[0]
    want = torch.autograd.grad(ref_out, ref_leaves, dout)
    torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    CALLS.clear()
    q, k, v, cu_q, cu_k = _packed([64, 64], [4000, 3000], 8, 1, 16, 16, seed=6)
    xt.attention(q, k, v, causal=True, family="ffpa", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=64,
                 max_seqlen_k=4000)
    assert ("combine", "ffpa") not in CALLS


@pytest.mark.parametrize("b, nq, p, strided", [(1, 1, 8, False), (1, 1, 8, True), (2, 1, 8, False), (1, 4, 8, True),
                                               (3, 2, 1, True), (3, 2, 1, False), (2, 3, 5, False)])
def test_query_slots_repeat_q_per_split(b, nq, p, strided):
    """``q_split`` holds q once per slot for every stride pattern; a single query is a row-stride-0 view."""
    from xattn.torch.split_kv import _slots

    base = torch.randn(b, 5, nq, 8, dtype=torch.float16)
    q = base.permute(0, 2, 1, 3) if strided else base.reshape(b, nq, 5, 8)  # heads 5 != queries
    got = _slots(q, p)
    want = q.unsqueeze(1).expand(b, p, nq, 5, 8).reshape(b * p * nq, 5, 8)
    assert torch.equal(got, want)
    if b * nq == 1:
        assert got.data_ptr() == q.data_ptr() and got.stride(0) == 0


@pytest.mark.parametrize("packed, b, nq", [(False, 1, 1), (False, 1, 4), (False, 3, 1), (False, 3, 4), (True, 1, 1),
                                           (True, 3, 1), (True, 3, 4)])
def test_device_lengths_take_the_index_kernel_and_few_framework_kernels(packed, b, nq, monkeypatch):
    """attention_with_kvcache(cache_seqlens=) and the packed decode call (cu_seqlens_q/k) on the split route: one index
    kernel (xattn.core.split_meta_sm90) writes the launches' cu_seqlens_k, the lse pre-fills and the packed gathers;
    around the launches only q's per-split copy (B Nq > 1), the causal tail's two slot copies (Nq > 1) and
    the packed call's three gathers remain (12-39 framework kernels before), against fp64."""
    from .framework_kernels import counting

    g = torch.Generator().manual_seed(b * 10 + nq)
    hq, hkv, d, nk = 8, 2, 16, 700
    lengths = [nk - 3 * i for i in range(b)]
    with routes.forced_forward("split-kv"):
        if packed:
            cu_q = torch.tensor([0] + [nq * (i + 1) for i in range(b)], dtype=torch.int32)
            cu_k = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            q = torch.randn(b * nq + 2, hq, d, generator=g, dtype=torch.float64)  # 2 trailing rows
            k, v = (torch.randn(int(cu_k[-1]) + 5, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
            step = lambda: xt.attention_with_lse(q, k, v, causal=True, cu_seqlens_q=cu_q,  # noqa: E731
                                                 cu_seqlens_k=cu_k, max_seqlen_q=nq, max_seqlen_k=nk)
        else:
            q = torch.randn(b, nq, hq, d, generator=g, dtype=torch.float64)
            k, v = (torch.randn(b, nk + 4, hkv, d, generator=g, dtype=torch.float64) for _ in range(2))
            seqlens = torch.tensor(lengths, dtype=torch.int32)
            step = lambda: xt.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, causal=True,  # noqa: E731
                                                     return_softmax_lse=True)
        step()
        CALLS.clear()
        with counting(monkeypatch) as kernels:
            out, lse = step()
    assert [c[0] for c in CALLS][:1] == ["split_meta"] and [c[0] for c in CALLS][-1] == "combine", CALLS
    tail_copies = 2 if nq > 1 else 0  # (device lengths: the tail is never written in place)
    assert sorted(kernels) == sorted(["copy_"] * ((b * nq > 1) + tail_copies) + ["index_select"] * 3 * packed), kernels
    for i, n in enumerate(lengths):
        if packed:
            rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
            want, want_lse = ref_attention(q[None, rows], k[None, int(cu_k[i]):int(cu_k[i + 1])],
                                           v[None, int(cu_k[i]):int(cu_k[i + 1])], scale=d ** -0.5, causal=True)
            torch.testing.assert_close(out[rows], want[0])
            torch.testing.assert_close(lse[:, rows].double(), want_lse[0])
        else:
            want, want_lse = ref_attention(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], scale=d ** -0.5, causal=True)
            torch.testing.assert_close(out[i:i + 1], want)
            torch.testing.assert_close(lse[i:i + 1].double(), want_lse)
    if packed:  # the trailing rows: the sentinels
        assert torch.all(out[b * nq:] == 0) and torch.all(torch.isneginf(lse[:, b * nq:]))


def test_side_stream_protocol(monkeypatch):
    """The causal tail's second stream (:class:`xattn.torch.split_kv.Side`) on a device that is not the current
    one, with CUDA's calls recorded: the side waits for the caller's stream before its block, the block runs with
    the side current, the caller's stream and current device come back (also when the block raises), and
    ``join`` makes the caller's stream wait for the side. Each thread gets its own events."""
    import threading

    from xattn.torch import split_kv

    log, current = [], {"stream": "main", "device": 0}

    class Event:
        def __init__(self, device):
            self.name = f"event{len(log)}"
            log.append(("event", str(device)))

        def record(self, stream):
            log.append(("record", self.name, stream))

        def wait(self, stream):
            log.append(("wait", self.name, stream))

    class Stream(str):
        device_index = 1

        def __new__(cls, device):
            return super().__new__(cls, "side")

    def set_stream(s):
        current.update(stream=s, device=1)
        log.append(("set_stream", str(s)))

    monkeypatch.setattr(split_kv, "_SIDES", threading.local())
    monkeypatch.setattr(torch, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda i: "main" if i == 1 else "other")
    monkeypatch.setattr(torch.accelerator, "set_stream", set_stream)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: current["device"])
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: current.update(device=i))

    side = split_kv.Side(torch.device("cuda", 1))
    assert log == [("event", "cuda:1"), ("event", "cuda:1")]  # on the tensors' device, not the current one
    del log[:]
    with side.fork():
        log.append(("body", current["stream"], current["device"]))
    with pytest.raises(RuntimeError), side.after_main():
        raise RuntimeError("in the block")
    side.join()
    forked, joined = side._forked.name, side._joined.name
    assert log == [("record", forked, "main"), ("wait", forked, "side"), ("set_stream", "side"), ("body", "side", 1),
                   ("set_stream", "main"), ("record", forked, "main"), ("wait", forked, "side"),
                   ("set_stream", "side"), ("set_stream", "main"), ("record", joined, "side"), ("wait", joined, "main")]
    assert current == {"stream": "main", "device": 0}  # the caller's device is current again
    assert split_kv.Side(torch.device("cuda", 1))._forked is side._forked  # made once per thread and device
    other = []
    thread = threading.Thread(target=lambda: other.append(split_kv.Side(torch.device("cuda", 1))._forked))
    thread.start()
    thread.join()
    assert other[0] is not side._forked
