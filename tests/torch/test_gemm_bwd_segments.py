"""torch's segmented GEMM backward (packed self-attention, one GEMM per row block across documents) on the
CPU: its launcher calls (torch views and the uploaded tables through TVM-FFI) with NumPy stand-ins of the
seg_* launchers (tests/numpy_gemm.py, which refuse misaligned or strided operands as TMA does), vs fp64;
and the choice of it on the GEMM route (:func:`xattn.core.routes.backward_route`)."""

import pytest
import torch

from tests import numpy_gemm
from tests.reference import varlen_attention
from xattn.core import gemm_bwd_plan as plan_mod
from xattn.core import routes
from xattn.torch import gemm_bwd as gb
from xattn.torch import gemm_bwd_segments as seg

pytest.importorskip("tvm_ffi")


def _case(lens, hq, hkv, extra, d=32, seed=0):
    """Packed q/k/v/dout of ``lens`` plus ``extra`` rows after the last document, and the fp64 gradients
    (0 on the extra rows) with the out/lse they come from."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + extra
    q, dout = (torch.randn(t, hq, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(t, hkv, d, generator=g).half() for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dout, cu


def _want(q, k, v, dout, cu, scale, causal):
    used = int(cu[-1])
    q64, k64, v64 = (x[:used].double().requires_grad_() for x in (q, k, v))
    out, lse = varlen_attention(q64, k64, v64, cu, cu, scale=scale, causal=causal)
    out.backward(dout[:used].double())
    pad = lambda x, n: torch.cat([x, x.new_zeros(n, *x.shape[1:])])  # noqa: E731
    extra = q.shape[0] - used
    grads = [pad(x.grad, extra) for x in (q64, k64, v64)]
    out = pad(out.detach(), extra)
    lse = torch.cat([lse.detach(), lse.new_zeros(lse.shape[0], extra)], dim=1)
    return out, lse, grads


@pytest.mark.parametrize("lens, hq, hkv, causal, rows, extra", [
    ((0, 1, 17, 100, 45), 4, 2, True, 16, 3),    # zero-length and 1-token documents, several blocks, GQA 2
    ((37, 64, 5), 3, 3, True, 24, 0),            # no GQA (query side copied per KV head), odd lengths
    ((70, 33), 8, 1, False, 16, 5),              # not causal, GQA 8, Hkv 1 (q and dq in place)
    ((130,), 2, 1, True, 64, 0),                 # one document
    ((9, 200, 3, 64), 6, 2, True, None, 2),      # the default rows (one block), GQA 3
])
def test_segments_vs_fp64(lens, hq, hkv, causal, rows, extra):
    q, k, v, dout, cu = _case(lens, hq, hkv, extra, seed=sum(lens))
    scale = 32 ** -0.5
    out, lse, want = _want(q, k, v, dout, cu, scale, causal)
    numpy_gemm.CALLS.clear()
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = seg.gemm_backward_segments(dout, q, k, v, out.half(), lse.float(), list(lens), softmax_scale=scale,
                                     causal=causal, gemms=gemms, rows=rows)
    for name, x, r, ref in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert x.shape == ref.shape and x.dtype == torch.float16 and x.is_contiguous(), name
        assert torch.isfinite(x).all(), name
        err = (x.double() - r).abs().max().item()
        assert err < 2e-2 * max(1.0, r.abs().max().item()), (name, err)
        assert not x[sum(lens):].any(), name  # rows past the last document
    launches = plan_mod.segment_launches(q.shape[0], lens, hq, hkv, causal, rows=rows)
    assert len(numpy_gemm.CALLS) == 5 * len(launches)
    assert numpy_gemm.CALLS.count("seg_acc") == 2 * len(launches)


def test_strided_and_offset_inputs_are_copied_for_the_launchers():
    """q/dout as views with a head stride past D and a start 2 elements in: the launchers get aligned copies
    (the stand-ins refuse operands TMA cannot take), the gradients are unchanged."""
    lens, hq, hkv = (50, 30), 4, 1
    q, k, v, dout, cu = _case(lens, hq, hkv, 0, seed=1)
    out, lse, want = _want(q, k, v, dout, cu, 0.2, True)
    wide = torch.zeros(q.shape[0], hq, 40, dtype=q.dtype)
    wide[:, :, 2:34] = q
    q_view = wide[:, :, 2:34]
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = seg.gemm_backward_segments(dout, q_view, k, v, out.half(), lse.float(), list(lens), softmax_scale=0.2,
                                     causal=True, gemms=gemms, rows=16)
    for x, r in zip(got, want):
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item())


def test_no_document_rows_gives_zero_gradients():
    q, k, v, dout, cu = _case((0, 0), 2, 1, 4)
    got = seg.gemm_backward_segments(dout, q, k, v, q, torch.zeros(2, 4), [0, 0], softmax_scale=0.2, causal=True,
                                     gemms=object())  # no launch: never touched
    assert [x.shape for x in got] == [q.shape, k.shape, v.shape] and not any(x.any() for x in got)


@pytest.mark.parametrize("lens", [[5, 9, 3], [-1, 4]])
def test_refuses_documents_past_the_rows(lens):
    q, k, v, dout, _ = _case([10], 2, 1, 0)
    with pytest.raises(ValueError, match="segmented backward"):
        seg.gemm_backward_segments(dout, q, k, v, q, torch.zeros(2, 10), lens, softmax_scale=0.2, causal=True)


@pytest.mark.parametrize("extra_q, extra_k", [(0, 5), (7, 0)])
def test_a_mix_with_unequal_row_counts_runs_on_the_segments(monkeypatch, extra_q, extra_k):
    """cu_seqlens shared by q and k but one side with rows after the last document that the other lacks
    (Tq != Tk, issue #42): the route is still the segments, whose key side takes the query side's row count,
    and the gradients are fp64's (0 on the rows past the documents)."""
    import xattn.torch.ops as ops

    lens = [300, 40, 20, 260]
    used = sum(lens)
    q, k, v, dout, cu = _case(lens, 8, 1, 0, d=512, seed=4)
    more = lambda x, n: torch.cat([x, torch.randn(n, *x.shape[1:]).half()])  # noqa: E731
    q, dout = more(q, extra_q), more(dout, extra_q)
    k, v = more(k, extra_k), more(v, extra_k)
    scale = 512 ** -0.5
    out, lse, want = _want(q[:used], k[:used], v[:used], dout[:used], cu, scale, True)
    out = torch.cat([out, out.new_zeros(extra_q, *out.shape[1:])])
    lse = torch.cat([lse, lse.new_full((lse.shape[0], extra_q), float("-inf"))], dim=1)
    calls, real = [], seg.gemm_backward_segments
    monkeypatch.setattr(seg, "gemm_backward_segments", lambda *a, **kw: calls.append(1) or real(
        *a, **{**kw, "gemms": gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)}))
    monkeypatch.setattr(ops, "check_buffers", lambda *a: 0)  # CUDA-only buffer checks (tested elsewhere)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "gemm")
    plan = ops._checked("bwd", "ffpa", q.bfloat16(), k.bfloat16(), v.bfloat16(), True, -1, -1, cu, cu, 300, 300)
    route, lengths = ops._bwd_route(plan[0], q, k, cu, cu)
    assert route.name == "gemm-segments"
    got = ops._gemm_bwd(plan, route.name, dout, q, k, v, out.half(), lse.float(), scale, lengths, (cu, cu, 300, 300))
    assert calls  # the outer call (Tq != Tk) and the one it makes on equal row counts
    for name, x, r, like in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert x.shape == like.shape, name
        assert (x[:used].double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item()), name
        assert not x[used:].any(), name


def test_gemm_route_dispatches_a_mix_to_the_segments(monkeypatch):
    """ops._gemm_bwd (the GEMM route of xattn.torch's backward) runs a self-attention mix on the segmented
    driver, with every document on the GEMMs (no short-document split), and its gradients are fp64's."""
    import xattn.torch.ops as ops

    lens = [300, 40, 0, 20, 260, 1]
    q, k, v, dout, cu = _case(lens, 8, 1, 0, d=512, seed=3)
    scale = 512 ** -0.5
    out, lse, want = _want(q, k, v, dout, cu, scale, True)
    calls, real = [], seg.gemm_backward_segments

    def on_standins(*a, **kw):
        calls.append(a[6])
        return real(*a, gemms=gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make), **kw)

    monkeypatch.setattr(seg, "gemm_backward_segments", on_standins)
    monkeypatch.setattr(gb, "gemm_backward_varlen", lambda *a, **kw: pytest.fail("took the grouped route"))
    monkeypatch.setattr(ops, "check_buffers", lambda *a: 0)  # CUDA-only buffer checks (tested elsewhere)
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))  # the GEMM routes at these sizes
    plan = ops._checked("bwd", "ffpa", q.bfloat16(), k.bfloat16(), v.bfloat16(), True, -1, -1, cu, cu, 300, 300)
    route, lengths = ops._bwd_route(plan[0], q, k, cu, cu)
    assert route.name == "gemm-segments"
    got = ops._gemm_bwd(plan, route.name, dout, q, k, v, out.half(), lse.float(), scale, lengths, (cu, cu, 300, 300))
    assert calls == [lens]
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item()), name


@pytest.mark.parametrize("lens, hq, hkv, causal, extra", [
    ((40, 0, 40, 40), 4, 2, True, 3),     # an empty document between equal ones, rows after the last
    ((96, 96), 8, 1, False, 0),           # not causal, GQA 8
])
def test_equal_documents_run_as_one_dense_batch(monkeypatch, lens, hq, hkv, causal, extra):
    """A packed batch whose documents share one length is a dense batch: ops._gemm_bwd runs the dense driver
    on views of it (no gather, no segments), gradients fp64's, 0 after the last document."""
    import xattn.torch.ops as ops

    q, k, v, dout, cu = _case(lens, hq, hkv, extra, d=512, seed=len(lens))
    scale = 512 ** -0.5
    out, lse, want = _want(q, k, v, dout, cu, scale, causal)
    seen, real = [], gb.gemm_backward

    def dense_on_standins(*a, **kw):
        seen.append(tuple(a[1].shape))
        return real(*a, **{**kw, "gemms": gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)})

    monkeypatch.setattr(gb, "gemm_backward", dense_on_standins)
    monkeypatch.setattr(gb, "gemm_backward_varlen", lambda *a, **kw: pytest.fail("took the grouped route"))
    monkeypatch.setattr(seg, "gemm_backward_segments", lambda *a, **kw: pytest.fail("took the segments"))
    monkeypatch.setattr(ops, "check_buffers", lambda *a: 0)  # CUDA-only buffer checks (tested elsewhere)
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 0),))  # the GEMM routes at these sizes
    n = max(lens)
    plan = ops._checked("bwd", "ffpa", q.bfloat16(), k.bfloat16(), v.bfloat16(), causal, -1, -1, cu, cu, n, n)
    route, lengths = ops._bwd_route(plan[0], q, k, cu, cu)
    assert route.name == "gemm-dense"
    got = ops._gemm_bwd(plan, route.name, dout, q, k, v, out.half(), lse.float(), scale, lengths, (cu, cu, n, n))
    docs = sum(1 for x in lens if x)
    assert seen == [(docs, n, hq, 512)]
    for name, x, r, ref in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert x.shape == ref.shape, name
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item()), name
        assert not x[sum(lens):].any(), name


@pytest.mark.parametrize("lens, hq", [((1,), 1), ((2, 1), 2), ((3,), 1)])
def test_a_batch_of_fewer_rows_than_one_launch_alignment(lens, hq):
    """Found by the contract fuzz (issue #42): a launch's rows are padded to a multiple of 8 with rows that
    read query rows 0, 1, ...; a batch with fewer query-side rows than that padding (one 1-token document,
    one head) indexed past its row vectors (IndexError here, a device-side assert on the GPU)."""
    q, k, v, dout, cu = _case(list(lens), hq, 1, 0, d=32, seed=9)
    scale = 32 ** -0.5
    out, lse, want = _want(q, k, v, dout, cu, scale, True)
    got = seg.gemm_backward_segments(dout, q, k, v, out.half(), lse.float(), list(lens), softmax_scale=scale,
                                     causal=True, gemms=gb.CoreGemms(torch.float16, num_sms=132,
                                                                     launcher=numpy_gemm.make))
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item()), name
