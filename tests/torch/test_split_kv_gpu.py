"""The split-KV decode route on the H200 with the real kernels: out and lse against fp64, and against the fused
kernel of the same call (num_splits=1): the split result must be as close to fp64 as the fused one, within one
more bf16 rounding of the partials. Fresh random inputs; FlashAttention's and HF's cache layouts."""

import pytest
import torch

import xattn.torch as xt
from tests.reference import attention as ref_attention, poison_allocator, rel_err
from xattn.core import routes

pytestmark = pytest.mark.gpu


def _decode(b, nq, hq, hkv, nk, d, layout, seed, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    if layout == "hf":  # [B, Hkv, Nk, D] caches, handed over transposed (the split route reads them in place)
        return mk(b, nq, hq, d), mk(b, hkv, nk, d).transpose(1, 2), mk(b, hkv, nk, d).transpose(1, 2)
    return mk(b, nq, hq, d), mk(b, nk, hkv, d), mk(b, nk, hkv, d)


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("d, b, nq, hq, hkv, nk, causal", [
    pytest.param(512, 1, 1, 32, 4, 9000, True, id="d512-B1-q1-g8-9000"),
    pytest.param(512, 3, 1, 16, 4, 5003, False, id="d512-B3-q1-g4"),
    pytest.param(512, 2, 4, 32, 4, 4100, True, id="d512-B2-q4-causal-tail"),
    pytest.param(512, 1, 16, 8, 1, 3000, True, id="d512-B1-q16-g8"),
    pytest.param(512, 1, 4, 32, 4, 9001, True, id="d512-B1-q4-tail-in-place"),
    pytest.param(128, 1, 1, 32, 8, 20000, True, id="d128-B1-g4"),
    pytest.param(128, 4, 3, 32, 8, 6000, True, id="d128-B4-q3-tail"),
    pytest.param(256, 2, 1, 32, 16, 7001, False, id="d256-B2-g2"),
    # FA4 d128's split launch reads q as it is (shared_q): sequences of one and several queries, tails copied in
    pytest.param(128, 8, 1, 32, 8, 8192, True, id="d128-B8-g4-shared-q"),
    pytest.param(128, 3, 2, 16, 8, 5001, False, id="d128-B3-q2-g2-shared-q"),
    pytest.param(128, 5, 16, 8, 8, 3000, True, id="d128-B5-q16-g1-tail-shared-q"),
    pytest.param(128, 2, 8, 64, 8, 4100, True, id="d128-B2-q8-g8-tail-shared-q"),
    # one sequence: the slot launch (dense, q through a batch stride of 0) where S divides the keys, else varlen
    pytest.param(128, 1, 1, 32, 8, 8192, True, id="d128-B1-slots-divide-the-keys"),
    pytest.param(128, 1, 1, 32, 8, 8200, True, id="d128-B1-keys-left-over-varlen"),
    pytest.param(128, 1, 4, 32, 8, 9001, True, id="d128-B1-q4-tail-varlen"),
    pytest.param(128, 1, 3, 16, 8, 5001, False, id="d128-B1-q3-g2-not-causal-varlen"),
    pytest.param(256, 1, 1, 32, 16, 7001, True, id="d256-B1-keys-left-over-varlen"),
    pytest.param(512, 1, 1, 32, 4, 8192, True, id="d512-B1-slots-divide-the-keys"),
    # ... and without a causal tail that is one host function (the slot call, xattn.core.slot_call_sm90)
    pytest.param(256, 1, 1, 32, 16, 8192, True, id="d256-B1-slot-call"),
    pytest.param(512, 1, 3, 32, 4, 6144, False, id="d512-B1-q3-not-causal-slot-call"),
    pytest.param(128, 1, 2, 32, 16, 4096, False, id="d128-B1-q2-g2-not-causal-slot-call"),
])
def test_split_kv_vs_fp64_and_fused(layout, d, b, nq, hq, hkv, nk, causal):
    q, k, v = _decode(b, nq, hq, hkv, nk, d, layout, seed=nk + d)
    poison_allocator()
    with routes.forced_forward("split-kv"):
        out, lse = xt.attention_with_lse(q, k, v, causal=causal)
    fused_out, fused_lse = xt.attention_with_lse(q, k, v, causal=causal, num_splits=1)
    ref_out, ref_lse = ref_attention(q, k, v, scale=d ** -0.5, causal=causal)
    err, fused_err = rel_err(out, ref_out), rel_err(fused_out, ref_out)
    assert err < 2 * fused_err + 2e-3, (err, fused_err)
    assert (lse.double() - ref_lse).abs().max() < 1e-3 + (fused_lse.double() - ref_lse).abs().max()


def test_auto_route_at_the_issue_shape_splits_and_matches():
    """The rule's own choice at Gemma-4-31B's global layer (d512 Hq32/Hkv4, B1, 32k cache, one new token)."""
    q, k, v = _decode(1, 1, 32, 4, 32768, 512, "contiguous", seed=7)
    problem = routes.FwdProblem("ffpa", 1, 4, 8, 1, 32768, causal=True,
                                num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert routes.forward_route(problem, "auto").name == "split-kv"
    poison_allocator()
    out = xt.attention(q, k, v, causal=True)
    ref_out, _ = ref_attention(q, k, v, scale=512 ** -0.5, causal=True)
    assert rel_err(out, ref_out) < 1e-2


@pytest.mark.parametrize("b, nq, d, hkv, nk", [(2, 1, 512, 4, 8192), (2, 4, 512, 4, 8192), (1, 1, 128, 8, 8200),
                                              (1, 1, 128, 8, 8192), (1, 1, 512, 4, 8192), (1, 4, 512, 4, 8192),
                                              (4, 1, 128, 8, 8192), (3, 4, 128, 8, 6000), (2, 2, 256, 16, 5000)],
                         ids=["q1", "q4-causal-tail-on-a-side-stream", "d128-B1-keys-left-over-varlen",
                              "d128-B1-slot-call", "d512-B1-slot-call", "d512-B1-q4-slots-and-tail",
                              "d128-B4-batched-shared-q", "d128-B3-q4-batched-tail", "d256-B2-q2-batched-tail"])
def test_split_kv_under_a_cuda_graph(b, nq, d, hkv, nk):
    """Captured once (after a warm-up that builds the cu_seqlens), replayed on new values in the same buffers;
    with Nq > 1 the causal tail is a branch of the graph (its second stream)."""
    q, k, v = _decode(b, nq, 32, hkv, nk, d, "contiguous", seed=11)
    xt.attention(q, k, v, causal=True, num_splits=16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = xt.attention(q, k, v, causal=True, num_splits=16)
    for seed in (12, 13):
        fresh = _decode(b, nq, 32, hkv, nk, d, "contiguous", seed=seed)
        for dst, src in zip((q, k, v), fresh):
            dst.copy_(src)
        graph.replay()
        ref_out, _ = ref_attention(q, k, v, scale=d ** -0.5, causal=True)
        assert rel_err(out, ref_out) < 1e-2


def test_causal_tail_orders_its_stream_after_the_callers():
    """On a caller's own stream, right after a long kernel and the write of the last keys: the tail (on the
    route's second stream) must see them, and the caller's stream must see the tail's slot before it reads out.
    The route's events are reused from call to call: the warm-up call before records them first."""
    q, k, v = _decode(1, 4, 32, 4, 16384, 512, "contiguous", seed=21)
    fresh = _decode(1, 4, 32, 4, 16384, 512, "contiguous", seed=22)
    xt.attention(*fresh, causal=True, num_splits=8)
    busy = torch.randn(8192, 8192, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(4):
            busy = busy @ busy / 8192 ** 0.5  # keeps the stream busy for milliseconds
        k[:, -4:].copy_(fresh[1][:, -4:])  # the tail's keys
        v[:, -4:].copy_(fresh[2][:, -4:])
        out = xt.attention(q, k, v, causal=True, num_splits=8)
        assert torch.cuda.current_stream() == stream  # the route gave the caller's stream back
        got = out.float().clone()
    torch.cuda.synchronize()
    ref_out, _ = ref_attention(q, k, v, scale=512 ** -0.5, causal=True)
    assert rel_err(got, ref_out) < 1e-2


def _split_on_a_busy_stream(q, k, v, fresh, causal):
    """``(out, lse)`` of the split route on a caller's stream kept busy for milliseconds, right after ``fresh``'s keys
    and values were copied into k and v there (the call must enqueue on that stream); freed memory poisoned first."""
    busy = torch.randn(8192, 8192, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    poison_allocator()
    with torch.cuda.stream(stream):
        for _ in range(4):
            busy = busy @ busy / 8192 ** 0.5
        k.copy_(fresh[1])
        v.copy_(fresh[2])
        with routes.forced_forward("split-kv"):
            out, lse = xt.attention_with_lse(q, k, v, causal=causal)
        got = out.clone(), lse.clone()
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("d, nq, hkv, nk, causal, dtype", [
    (128, 1, 8, 8192, True, torch.bfloat16), (128, 1, 8, 20000, True, torch.float16),
    (256, 1, 16, 8192, True, torch.bfloat16), (512, 1, 4, 9000, True, torch.bfloat16),
    (512, 3, 4, 6144, False, torch.float16), (512, 4, 4, 9001, True, torch.bfloat16),  # FFPA's causal tail inside
    (512, 2, 4, 4100, True, torch.float16),
])
def test_slot_call_is_one_call_and_equals_the_launches(layout, d, nq, hkv, nk, causal, dtype, monkeypatch):
    """One sequence on the slot launch runs eagerly as one host function (xattn.core.slot_call_sm90: the dense split
    launch, FFPA's causal tail masked into its last slot, and the combine, the partials in one work buffer), on a
    caller's own stream right after the keys were written there (the call must enqueue on that stream). Without a
    tail the kernels are the two launches' (same bits, out and lse); with one the varlen route's launches one by one
    compute it otherwise (equal within bf16 rounding). Judged against fp64 too."""
    from xattn.torch import ops
    from xattn.torch import split_kv as torch_split_kv

    calls, real = [], ops.LAUNCH["slot_call"]
    monkeypatch.setitem(ops.LAUNCH, "slot_call", lambda *a, **kw: (calls.append(a[0]), real(*a, **kw))[1])
    q, k, v = _decode(1, nq, 32, hkv, nk, d, layout, seed=nk + d + nq, dtype=dtype)
    fresh = _decode(1, nq, 32, hkv, nk, d, layout, seed=nk + d + nq + 1, dtype=dtype)
    got = _split_on_a_busy_stream(q, k, v, fresh, causal)
    assert len(calls) == 1, "the slot call did not run"
    monkeypatch.setattr(ops, "_SLOT_CALLS", type(ops._SLOT_CALLS)(256))
    tail = calls[0].tail
    two = torch_split_kv.slot_call
    monkeypatch.setattr(torch_split_kv, "slot_call", (lambda *a: None) if tail else
                        (lambda *a: two(*a)._replace(call=None)))
    with routes.forced_forward("split-kv"):
        out2, lse2 = xt.attention_with_lse(q, k, v, causal=causal)
    assert len(calls) == 1  # the launches this time
    if not tail:
        assert torch.equal(got[0], out2) and torch.equal(got[1], lse2)
    assert rel_err(got[0], out2) < 1e-2 and (got[1] - lse2).abs().max() < 1e-3
    ref_out, ref_lse = ref_attention(q, k, v, scale=d ** -0.5, causal=causal)
    assert rel_err(got[0], ref_out) < 1e-2 and (got[1].double() - ref_lse).abs().max() < 1e-3


@pytest.mark.parametrize("d, nq, hq, hkv, nk, splits", [
    (512, 4, 32, 4, 8192, 32), (512, 4, 32, 4, 8195, 32), (512, 16, 8, 1, 1000, 3), (512, 2, 16, 2, 4100, 5),
    (512, 4, 32, 4, 100, 2),  # one slot: the plan keeps S 1 (a key tile)
    (384, 2, 32, 4, 3001, 7), (320, 8, 16, 4, 2000, 5), (448, 3, 8, 8, 1500, 4),
])
def test_the_last_slot_masks_ffpas_causal_tail(d, nq, hq, hkv, nk, splits, monkeypatch):
    """FFPA's causal tail inside the slot launch (xattn.core.slot_call_sm90, ``_last_slot_causal``): every head dim
    kernel of FFPA (d512, d384, generic) with the mask, the last slot holding the remainder of Nk // S (0 to S - 1
    keys more) or the only slot, GQA 1-8, Nq 2-16: against fp64 and the fused kernel (num_splits 1), out and lse."""
    from xattn.torch import ops

    calls, real = [], ops.LAUNCH["slot_call"]
    monkeypatch.setitem(ops.LAUNCH, "slot_call", lambda *a, **kw: (calls.append(a[0]), real(*a, **kw))[1])
    q, k, v = _decode(1, nq, hq, hkv, nk, d, "contiguous", seed=nk + d + nq)
    poison_allocator()
    out, lse = xt.attention_with_lse(q, k, v, causal=True, num_splits=splits)
    assert len(calls) == 1 and calls[0].tail, "the slot call with its causal tail did not run"
    fused_out, fused_lse = xt.attention_with_lse(q, k, v, causal=True, num_splits=1)
    ref_out, ref_lse = ref_attention(q, k, v, scale=d ** -0.5, causal=True)
    err, fused_err = rel_err(out, ref_out), rel_err(fused_out, ref_out)
    assert err < 2 * fused_err + 2e-3, (err, fused_err)
    assert (lse.double() - ref_lse).abs().max() < 1e-3 + (fused_lse.double() - ref_lse).abs().max()


@pytest.mark.parametrize("layout", ["contiguous", "hf"])
@pytest.mark.parametrize("d, b, nq, hkv, nk, causal, dtype", [
    (512, 8, 1, 4, 8192, True, torch.bfloat16), (512, 2, 1, 4, 9000, True, torch.float16),
    (512, 3, 4, 4, 9001, True, torch.bfloat16), (512, 2, 16, 1, 3000, True, torch.float16),
    (512, 4, 3, 4, 6144, False, torch.bfloat16), (512, 8, 4, 4, 8192, True, torch.bfloat16),
    # FA4: d128 on its decode tile reading q's own rows (shared_q, GQA), d256 and g1 through the broadcast
    (128, 8, 1, 8, 8192, True, torch.bfloat16), (128, 3, 4, 8, 9001, True, torch.float16),
    (128, 2, 16, 32, 3000, True, torch.bfloat16), (128, 4, 3, 4, 6144, False, torch.bfloat16),
    (256, 8, 1, 16, 8192, True, torch.bfloat16), (256, 3, 4, 16, 5001, True, torch.bfloat16),
])
def test_batched_slot_call_is_one_call_and_matches_the_launches(layout, d, b, nq, hkv, nk, causal, dtype,
                                                                monkeypatch):
    """B > 1 full caches run eagerly as the batched slot call (xattn.core.slot_call_sm90 "Batched": q copied per slot
    or read as it is (FA4 d128, GQA), the varlen split launch, the family's dense causal tail into slot S, the
    combine), on a caller's busy stream right after the keys were written there; q handed over transposed (HF) too.
    Without a tail the kernels are the launches one by one's (same bits); the tail runs the dense causal kernel where
    they run the varlen one (equal within bf16 rounding). Judged against fp64 too."""
    from xattn.torch import ops
    from xattn.torch import split_kv as torch_split_kv

    calls, real = [], ops.LAUNCH["slot_call"]
    monkeypatch.setitem(ops.LAUNCH, "slot_call", lambda *a, **kw: (calls.append(a[0]), real(*a, **kw))[1])
    q, k, v = _decode(b, nq, 32, hkv, nk, d, layout, seed=nk + b + nq, dtype=dtype)
    if layout == "hf":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    fresh = _decode(b, nq, 32, hkv, nk, d, layout, seed=nk + b + nq + 1, dtype=dtype)
    got = _split_on_a_busy_stream(q, k, v, fresh, causal)
    assert len(calls) == 1 and calls[0].batched, "the batched slot call did not run"
    monkeypatch.setattr(ops, "_SLOT_CALLS", type(ops._SLOT_CALLS)(256))
    monkeypatch.setattr(torch_split_kv, "slot_call", lambda *a: None)
    with routes.forced_forward("split-kv"):
        out2, lse2 = xt.attention_with_lse(q, k, v, causal=causal)
    assert len(calls) == 1  # the launches one by one this time
    if not calls[0].tail:
        assert torch.equal(got[0], out2) and torch.equal(got[1], lse2)
    assert rel_err(got[0], out2) < 1e-2 and (got[1] - lse2).abs().max() < 1e-3
    ref_out, ref_lse = ref_attention(q, k, v, scale=d ** -0.5, causal=causal)
    assert rel_err(got[0], ref_out) < 1e-2 and (got[1].double() - ref_lse).abs().max() < 1e-3


@pytest.mark.parametrize("d, lens_q, lens_k, hq, hkv, causal, trailing", [
    pytest.param(512, [1] * 8, [9000, 1, 0, 4100, 7, 3000, 513, 8192], 32, 4, True, (0, 0), id="d512-decode-8-docs"),
    pytest.param(512, [4, 0, 1, 3], [9001, 500, 2, 4000], 32, 4, True, (3, 5), id="d512-spec-decode-trailing"),
    pytest.param(128, [2, 16, 1], [20000, 6000, 1], 32, 8, True, (0, 7), id="d128-mixed"),
    pytest.param(256, [1, 1], [7001, 12000], 32, 16, False, (2, 0), id="d256-not-causal"),
])
def test_packed_split_kv_vs_fp64_and_fused(d, lens_q, lens_k, hq, hkv, causal, trailing):
    """Packed decoding (vLLM's / HF continuous batching's decode step) on the split route, forced, against fp64
    and the fused varlen kernel: empty, 1-key and fewer-keys-than-queries documents, rows past cu[-1]."""
    g = torch.Generator(device="cuda").manual_seed(sum(lens_k) + d)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    tk = sum(lens_k) + trailing[1]
    q, k, v = mk(sum(lens_q) + trailing[0], hq, d), mk(tk, hkv, d), mk(tk, hkv, d)
    cu = lambda lens: torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)  # noqa: E731
    kw = dict(cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              causal=causal)
    poison_allocator()
    with routes.forced_forward("split-kv"):
        out, lse = xt.attention_with_lse(q, k, v, **kw)
    fused_out, fused_lse = xt.attention_with_lse(q, k, v, num_splits=1, **kw)
    from tests.reference import varlen_attention

    ref_out, ref_lse = varlen_attention(q, k, v, kw["cu_seqlens_q"], kw["cu_seqlens_k"], scale=d ** -0.5,
                                        causal=causal)
    err, fused_err = rel_err(out, ref_out), rel_err(fused_out, ref_out)
    assert err < 2 * fused_err + 2e-3, (err, fused_err)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite) and torch.equal(out[~finite.any(0)], ref_out[~finite.any(0)].to(
        out.dtype))
    assert (lse[finite].double() - ref_lse[finite]).abs().max() < 1e-3 + \
        (fused_lse[finite].double() - ref_lse[finite]).abs().max()


@pytest.mark.parametrize("p, chunk, dv, dtype", [(3, 4, 128, torch.bfloat16), (5, 8, 512, torch.bfloat16),
                                                 (16, 16, 128, torch.bfloat16), (17, 16, 384, torch.bfloat16),
                                                 (40, 16, 256, torch.float16), (127, 16, 128, torch.bfloat16),
                                                 (9, 4, 128, torch.bfloat16), (7, 8, 256, torch.float16)])
def test_combine_never_reads_a_partial_of_lse_minus_inf(p, chunk, dv, dtype):
    """The combine's contract the routes rely on (no out pre-fill for partials): a partial row of lse -inf is
    skipped, whatever its out holds (NaN here); the rest merge by lse, against fp64. P around each chunk of
    partials a thread loads (within one chunk, one past it, several; the most there are), Dv of whole and partial
    CTAs."""
    from xattn.core.split_kv import CombineSpec
    from xattn.torch import ops

    g = torch.Generator(device="cuda").manual_seed(5 + p)
    b, nq, hq = 3, 2, 8
    out_p = torch.randn(p, b, nq, hq, dv, device="cuda", dtype=dtype, generator=g)
    lse_p = torch.randn(p, b, hq, nq, device="cuda", generator=g) * 3
    dead = torch.rand(p, b, hq, nq, device="cuda", generator=g) < 0.4
    dead[:, 0, 0] = True  # a row with no live partial: out 0, lse -inf
    lse_p[dead] = float("-inf")
    out_p.permute(0, 1, 3, 2, 4)[dead] = float("nan")
    out = torch.empty(b, nq, hq, dv, device="cuda", dtype=dtype)
    lse = torch.empty(b, hq, nq, device="cuda")
    spec = CombineSpec("ffpa" if dv > 256 else "fa4", str(dtype).removeprefix("torch."), dv, chunk)
    ops.LAUNCH["combine"](spec, out_p, lse_p.permute(0, 1, 3, 2), out, lse.permute(0, 2, 1))
    total = torch.logsumexp(lse_p.double(), 0)
    w = torch.exp(lse_p.double() - total).nan_to_num(0.0).permute(0, 1, 3, 2)[..., None]  # [P, B, Nq, Hq, 1]
    ref = torch.where(w > 0, w * out_p.double(), 0.0).sum(0)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() < 2e-2
    assert torch.equal(torch.isneginf(lse), torch.isneginf(total))
    assert (lse.double() - total).nan_to_num(0.0).abs().max() < 1e-4


@pytest.mark.parametrize("tail, packed, rows", [(False, False, 9000), (True, False, 9000), (True, True, -1),
                                                (False, True, -1), (True, False, 0)])
def test_split_index_kernel_matches_the_torch_formulation(tail, packed, rows):
    """The contiguous split route's index kernel (xattn.core.split_meta_sm90) against the torch ops it replaced (the
    CPU stand-in: xattn.torch.split_kv.device_cu_seqlens_k) and the host loops of the packed gathers: cu_seqlens_k of
    the split and tail launches for fixed and per-sequence chunks, empty, 1-key and full sequences, dense (from row
    b * rows) and packed keys (cu_seqlens_k), the lse fill, the packed rows with trailing rows."""
    from tests.torch.stubs import _stub_split_meta
    from xattn.core.split_kv import SplitMetaSpec
    from xattn.torch import ops

    host = _stub_split_meta()
    spec = SplitMetaSpec("ffpa", tail, packed)
    for splits, chunk, nq in ((33, 0, 1), (4, 0, 4), (7, 256, 3), (1, 0, 16), (127, 0, 2)):
        lengths = [0, 1, 9000, 129, 4097, nq, 8191]
        b = len(lengths)
        if rows >= 0:
            keys = torch.tensor(lengths, dtype=torch.int32)
            key_rows = rows * (b - 1) + 9000
        else:
            keys = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            key_rows = int(keys[-1]) + 11
        p = splits + tail
        bufs = [torch.full((b * (p + 1) + 1,), -7, dtype=torch.int32), torch.full((2 * b + 1,), -7, dtype=torch.int32),
                torch.zeros(3 * b * p * nq + 5)]
        gathers = None
        if packed:
            counts = torch.randint(0, nq + 1, (b,), generator=torch.Generator().manual_seed(splits))
            cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), counts.cumsum(0).to(torch.int32)])
            gathers = [cu_q] + [torch.full((n,), -7, dtype=torch.int32) for n in (b * nq, int(cu_q[-1]) + 3, 33)]
        got = [t.cuda() for t in bufs]
        got_gathers = [t.cuda() for t in gathers] if packed else None
        kw = dict(batch=b, rows=rows, key_rows=key_rows, seqlen_q=nq, splits=splits, chunk=chunk)
        ops.LAUNCH["split_meta"](spec, keys.cuda(), got[0], got[1] if tail else got[0], got[2], got_gathers, **kw)
        host(spec, keys, bufs[0], bufs[1] if tail else bufs[0], bufs[2], gathers, **kw)
        assert torch.equal(got[0].cpu(), bufs[0]), (splits, chunk, nq, got[0].cpu(), bufs[0])
        if tail:
            assert torch.equal(got[1].cpu(), bufs[1]), (splits, chunk, nq)
        assert torch.isneginf(got[2]).all()
        for name, a, w in zip(("q_rows", "out_rows", "zero"), (got_gathers or [])[1:], (gathers or [])[1:]):
            assert torch.equal(a.cpu(), w), (name, splits, nq)
