"""The GEMM backward of packed (varlen) d512 batches on the GPU vs fp64 and vs FFPA's varlen backward on
the same out/lse (issue #23), on both layouts (documents grouped into dense batches; self-attention
documents in row blocks across documents, "segments"): documents of 0/1/17/1000/8192 tokens in one
batch, Nq != Nk per document, GQA 1/4/8, causal and not; the default route through autograd; no host
sync; the memory bounds."""

import pytest
import torch

import xattn.torch as xt
import xattn.torch.ops as ops
from tests.reference import attention_bwd
from xattn.core import routes
from xattn.torch import gemm_bwd, gemm_bwd_segments

DRIVERS = {"groups": (gemm_bwd, "gemm_backward_varlen"), "segments": (gemm_bwd_segments, "gemm_backward_segments"),
           "dense": (gemm_bwd, "gemm_backward_equal_documents")}
ROUTE = {"groups": "gemm-groups", "segments": "gemm-segments", "dense": "gemm-dense"}  # every document on the GEMMs

pytestmark = pytest.mark.gpu

SCALE = 512 ** -0.5


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _packed(lens_q, lens_k, hq, hkv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    mk = lambda t, h: torch.randn(t, h, 512, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    return mk(tq, hq), mk(tk, hkv), mk(tk, hkv), mk(tq, hq)


def _want(dout, q, k, v, out, lse, lens_q, lens_k, causal):
    """fp64 gradients per document from the given out/lse (0 for documents without rows or keys)."""
    dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float64, device="cuda") for x in (q, k, v))
    sq = sk = 0
    for nq, nk in zip(lens_q, lens_k):
        if nq and nk:
            rq, rk = slice(sq, sq + nq), slice(sk, sk + nk)
            g = attention_bwd(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq],
                              lse[None, :, rq], scale=SCALE, causal=causal)
            dq[rq], dk[rk], dv[rk] = (x[0] for x in g)
        sq, sk = sq + nq, sk + nk
    return dq, dk, dv


def _count_driver_calls(monkeypatch, layout):
    """Force the GEMM route of packed ``layout`` (XATTN_BWD_ROUTE) and count its driver's calls."""
    module, name = DRIVERS[layout]
    monkeypatch.setenv("XATTN_BWD_ROUTE", ROUTE[layout])
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


def _check(monkeypatch, lens_q, lens_k, hq, hkv, dtype, causal, seed, layout="groups"):
    q, k, v, dout = _packed(lens_q, lens_k, hq, hkv, dtype, seed)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    mq, mk = max(lens_q), max(lens_k)
    out, lse = ops.fwd(q, k, v, "ffpa", SCALE, causal, -1, -1, cu_q, cu_k, mq, mk)
    want = _want(dout, q, k, v, out, lse, lens_q, lens_k, causal)
    args = (dout, q, k, v, out, lse, "ffpa", SCALE, causal, -1, -1, cu_q, cu_k, mq, mk)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = ops.bwd(*args)
    calls = _count_driver_calls(monkeypatch, layout)
    got = ops.bwd(*args)
    assert calls == [1]
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert x.shape == f.shape and x.dtype == dtype and x.is_contiguous(), name
        assert torch.isfinite(x).all(), name
        err, err_ffpa = (x.double() - r).abs().max().item(), (f.double() - r).abs().max().item()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)


@pytest.mark.parametrize("layout", ["groups", "segments"])
@pytest.mark.parametrize("g", [1, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_documents_0_1_17_1000_8192(monkeypatch, g, causal, layout):
    lens = [0, 1, 17, 1000, 8192, 300]
    _check(monkeypatch, lens, lens, 2 * g, 2, torch.bfloat16, causal, seed=g * 2 + causal, layout=layout)


@pytest.mark.parametrize("layout", ["dense", "groups", "segments"])
@pytest.mark.parametrize("g, causal", [(1, False), (8, True)])
def test_equal_documents(monkeypatch, layout, g, causal):
    """Documents of one length (with empty ones between them): views of one dense batch by default, and the
    same gradients on the other two layouts."""
    lens = [0, 3000, 3000, 0, 3000]
    _check(monkeypatch, lens, lens, 2 * g, 2, torch.bfloat16, causal, seed=30 + g, layout=layout)


def _random_mix(seed):
    """Seeded documents: 1-12 of log-uniform lengths 1..3000 with empty ones, or (one draw in four) equal ones."""
    import math
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    if rng.random() < 0.25:
        return [rng.randint(1, 2500)] * n
    return [0 if rng.random() < 0.1 else int(math.exp(rng.uniform(0, math.log(3000)))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(12))
def test_random_mixes_on_every_layout(monkeypatch, seed):
    """A small fuzz of the packed layouts: seeded mixes (GQA 1/4/8, causal or not), each run on every layout
    that takes it (dense views for equal documents, segments for self-attention, groups always), vs fp64
    within 1.5x FFPA's varlen backward's error."""
    import random

    rng = random.Random(1000 + seed)
    lens = _random_mix(seed)
    if not any(lens):
        lens[0] = 1
    g, causal = rng.choice([1, 4, 8]), rng.random() < 0.6
    layouts = ["groups", "segments"] + (["dense"] if routes.equal_documents(lens, lens) else [])
    for layout in layouts:
        with monkeypatch.context() as m:
            _check(m, lens, lens, 2 * g, 2, torch.bfloat16, causal, seed=seed, layout=layout)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_segments_gemma4_heads_and_a_tail_past_the_documents(monkeypatch, dtype):
    """Gemma 4 global-layer heads (Hq 32 / Hkv 4) on the segments: a mix of lengths, N not a tile
    multiple, and 37 packed rows after the last document (their gradients are 0)."""
    lens = [777, 4100, 65, 2999, 1]
    q, k, v, dout = _packed(lens + [37], lens + [37], 32, 4, dtype, seed=21)
    cu = _cu(lens)
    m = max(lens)
    out, lse = ops.fwd(q, k, v, "ffpa", SCALE, True, -1, -1, cu, cu, m, m)
    want = _want(dout, q, k, v, out, lse, lens, lens, True)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = ops.bwd(dout, q, k, v, out, lse, "ffpa", SCALE, True, -1, -1, cu, cu, m, m)
    got = gemm_bwd_segments.gemm_backward_segments(dout, q, k, v, out, lse, lens, softmax_scale=SCALE, causal=True)
    used = sum(lens)
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert not x[used:].any(), name
        err, err_ffpa = (x.double() - r).abs()[:used].max().item(), (f.double() - r).abs()[:used].max().item()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_queries_and_keys_differ_per_document(monkeypatch, dtype, causal):
    """Bottom-right causal per document, a document without keys, and one with more queries than keys."""
    lens_q, lens_k = [389, 77, 250, 1031, 5], [517, 0, 130, 1031, 64]
    _check(monkeypatch, lens_q, lens_k, 8, 2, dtype, causal, seed=11 + causal)


@pytest.mark.parametrize("layout", ["groups", "segments"])
def test_many_short_documents_share_launches(monkeypatch, layout):
    """Packed SFT data: hundreds of short documents share launches (and stay exact)."""
    gen = torch.Generator().manual_seed(3)
    lens = torch.randint(60, 130, (200,), generator=gen).tolist()
    _check(monkeypatch, lens, lens, 8, 1, torch.bfloat16, True, seed=5, layout=layout)


def _run_driver(layout, dout, q, k, v, out, lse, lens):
    if layout == "groups":
        return gemm_bwd.gemm_backward_varlen(dout, q, k, v, out, lse, lens, lens, softmax_scale=SCALE, causal=True)
    return gemm_bwd_segments.gemm_backward_segments(dout, q, k, v, out, lse, lens, softmax_scale=SCALE, causal=True)


@pytest.mark.parametrize("layout", ["groups", "segments"])
def test_no_host_sync_inside_the_driver(layout):
    """Past the one read of cu_seqlens (in the route choice), the driver never waits for the GPU: a
    copy per document group from pageable memory serialised host and GPU on the H200. The segments
    driver is run twice more on the same inputs: bitwise the same gradients."""
    lens = [3000, 2900, 1000, 900, 300, 17, 1]
    q, k, v, dout = _packed(lens, lens, 8, 1, torch.bfloat16, seed=2)
    cu = _cu(lens)
    out, lse = ops.fwd(q, k, v, "ffpa", SCALE, True, -1, -1, cu, cu, max(lens), max(lens))
    first = _run_driver(layout, dout, q, k, v, out, lse, lens)  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _run_driver(layout, dout, q, k, v, out, lse, lens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _want(dout, q, k, v, out, lse, lens, lens, True)
    for name, x, r, x0 in zip(("dq", "dk", "dv"), got, want, first):
        assert (x.double() - r).norm() / r.norm() < 1e-2, name
        assert torch.equal(x, x0), name


def test_autograd_backward_reads_the_forwards_copy_of_cu_seqlens():
    """Through autograd the forward starts an asynchronous copy of cu_seqlens, so the packed backward
    never waits for the GPU (a sync per full layer would stall training)."""
    lens = [2100, 3000, 17]
    q, k, v, dout = _packed(lens, lens, 8, 1, torch.bfloat16, seed=6)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cu = _cu(lens)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    xt.attention(qg, kg, vg, **kw).backward(dout)  # warm
    grads = [x.grad.clone() for x in (qg, kg, vg)]
    for x in (qg, kg, vg):
        x.grad = None
    out = xt.attention(qg, kg, vg, **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out.backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(x.grad, g) for x, g in zip((qg, kg, vg), grads))


def test_forward_copies_cu_seqlens_before_its_kernel():
    """The forward enqueues its copy of cu_seqlens before its own kernel, so a backward enqueued right
    after it waits only for the GPU to reach the forward, not to finish it (the micro-benchmark case)."""
    lens = [2048] * 4
    q, k, v, _ = _packed(lens, lens, 8, 1, torch.bfloat16, seed=7)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cu = _cu(lens)
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    xt.attention(qg, kg, vg, **kw)  # warm
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = xt.attention(qg, kg, vg, **kw)
        torch.cuda.synchronize()
    assert out.grad_fn.lengths is not None  # the autograd node holds the forward's copy
    gpu = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    copies = [i for i, e in enumerate(gpu) if "DtoH" in e.name]
    kernels = [i for i, e in enumerate(gpu) if "ffpa" in e.name.lower() and "fwd" in e.name.lower()]
    assert copies and kernels, [e.name for e in gpu]
    assert max(copies) < min(kernels), [e.name for e in gpu]


@pytest.mark.parametrize("lens, layout", [([2100, 3000, 2500], "segments"), ([2048] * 3, "dense"),
                                          ([2600, 2500, 2400], "groups")])
def test_default_route_through_autograd(monkeypatch, lens, layout):
    """Gemma 4 global-layer heads (GQA 8, causal), documents past the table's threshold: xt.attention
    with cu_seqlens takes the GEMM backward by default (a mix of lengths on the segments, equal
    documents as one dense batch, lengths within one group's fill grouped), gradients close to fp64."""
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    module, name = DRIVERS[layout]
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    q, k, v, dout = _packed(lens, lens, 8, 1, torch.bfloat16, seed=9)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cu = _cu(lens)
    out = xt.attention(qg, kg, vg, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                       max_seqlen_k=max(lens))
    out.backward(dout)
    assert calls == [1]
    ref_out, ref_lse = ops.fwd(q, k, v, "ffpa", SCALE, True, -1, -1, cu, cu, max(lens), max(lens))
    want = _want(dout, q, k, v, ref_out, ref_lse, lens, lens, True)
    for name, x, r in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), want):
        assert (x.double() - r).norm() / r.norm() < 1e-2, name


MIX = [0, 17, 1000, 3000, 1500, 90]


@pytest.mark.parametrize("layout, lens", [("groups", MIX), ("segments", MIX), ("dense", [0, 1500, 1500, 1500])])
def test_varlen_memory_within_the_documented_bound(monkeypatch, layout, lens):
    from xattn.core.routes import varlen_workspace_bytes

    monkeypatch.setenv("XATTN_BWD_ROUTE", ROUTE[layout])
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", "64")
    monkeypatch.setattr(routes, "packed_layout", lambda *a, **kw: layout)  # the bound of that layout
    q, k, v, dout = _packed(lens, lens, 8, 2, torch.bfloat16, seed=4)
    cu = _cu(lens)
    out, lse = ops.fwd(q, k, v, "ffpa", SCALE, True, -1, -1, cu, cu, max(lens), max(lens))
    run = lambda: ops.bwd(dout, q, k, v, out, lse, "ffpa", SCALE, True, -1, -1, cu, cu, max(lens), max(lens))  # noqa: E731
    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = run()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(x.untyped_storage().nbytes() for x in grads)
    bound = varlen_workspace_bytes(lens, lens, 8, 2, 512, True, budget=64 << 20)
    assert 0 < extra <= bound, (extra, bound)


def test_auto_route_splits_short_documents_onto_ffpa(monkeypatch):
    """The default route on a mix: documents of >= 2048 keys (GQA 8) on the GEMMs, the short ones in one
    gathered call of FFPA's varlen backward; gradients vs fp64 within 1.5x FFPA's whole-batch error; the
    memory within the documented bound."""
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm-groups+fused")  # the grouped route's split, as auto takes it
    lens = [4000, 300, 17, 2100, 1000, 1]
    q, k, v, dout = _packed(lens, lens, 8, 1, torch.bfloat16, seed=11)
    cu, m = _cu(lens), max(lens)
    out, lse = ops.fwd(q, k, v, "ffpa", SCALE, True, -1, -1, cu, cu, m, m)
    want = _want(dout, q, k, v, out, lse, lens, lens, True)
    args = (dout, q, k, v, out, lse, "ffpa", SCALE, True, -1, -1, cu, cu, m, m)
    fused, real = [], ops._launch_bwd
    monkeypatch.setattr(ops, "_launch_bwd", lambda *a: fused.append(a[3].shape[0]) or real(*a))
    ops.bwd(*args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    got = ops.bwd(*args)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - sum(x.untyped_storage().nbytes() for x in got)
    assert fused == [300 + 17 + 1000 + 1] * 2
    from xattn.core.routes import varlen_workspace_bytes

    monkeypatch.setattr(routes, "packed_layout", lambda *a, **kw: "groups")  # the bound of the grouped layout
    assert 0 < extra <= varlen_workspace_bytes(lens, lens, 8, 1, 512, True), extra
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")
    ffpa = ops.bwd(*args)
    for name, x, f, r in zip(("dq", "dk", "dv"), got, ffpa, want):
        assert torch.isfinite(x).all(), name
        err, err_ffpa = (x.double() - r).abs().max().item(), (f.double() - r).abs().max().item()
        assert err <= 1.5 * err_ffpa + 1e-3, (name, err, err_ffpa)
