"""The torch driver of the chunked-GEMM backward on the CPU: its launcher calls (torch views through
TVM-FFI) with NumPy stand-ins for the GEMM launchers (tests/numpy_gemm.py), vs the fp64 reference:
the block logic (row stacking, padding, causal limits, accumulation, the last block's dk/dv layout)."""

import pytest
import torch

from tests import numpy_gemm
from tests.reference import attention, attention_bwd, varlen_attention
from xattn.core import routes
from xattn.core.workspace import round_up
from xattn.torch import gemm_bwd as gb

pytest.importorskip("tvm_ffi")


@pytest.mark.parametrize("b, nq, nk, hq, hkv, causal, rows", [
    (2, 200, 200, 4, 2, True, 64),    # several blocks, GQA 2
    (1, 130, 190, 6, 2, True, 64),    # Nq < Nk, padded last block
    (1, 190, 130, 3, 3, True, 64),    # Nq > Nk: rows before the first key
    (2, 150, 171, 8, 1, False, 64),   # GQA 8, not causal, Nk not a multiple of 8
    (1, 300, 40, 2, 1, True, 64),     # whole blocks without keys
    (1, 77, 77, 4, 4, True, None),    # one block from the budget (mm_kv writes dk/dv)
    (2, 77, 90, 2, 2, False, None),   # one block, not causal, B 2
])
@pytest.mark.parametrize("layout", ["bnhd", "bhnd"])
def test_block_logic_vs_fp64(b, nq, nk, hq, hkv, causal, rows, layout):
    """``bhnd``: the inputs as HF hands them over ([B, H, N, D] transposed to [B, N, H, D])."""
    g = torch.Generator().manual_seed(nq * 7 + nk)
    d = 32

    def mk(n, h):
        if layout == "bnhd":
            return torch.randn(b, n, h, d, generator=g).half()
        return torch.randn(b, h, n, d, generator=g).half().transpose(1, 2)
    q, dout = mk(nq, hq), mk(nq, hq)
    k, v = mk(nk, hkv), mk(nk, hkv)
    scale = d ** -0.5
    out, lse = attention(q, k, v, scale=scale, causal=causal)
    want = attention_bwd(dout, q, k, v, out, lse, scale=scale, causal=causal)
    numpy_gemm.CALLS.clear()
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = gb.gemm_backward(dout, q, k, v, out.half(), lse.float(), softmax_scale=scale, causal=causal,
                           gemms=gemms, rows=rows)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape and x.dtype == torch.float16 and x.is_contiguous(), name
        err = (x.double() - r).abs().max().item()
        assert err < 2e-2 * max(1.0, r.abs().max().item()), (name, err)
    kinds = set(numpy_gemm.CALLS)
    assert {"grad_scores", "mm_dq", "probs_causal" if causal else "probs_full"} <= kinds
    # mm_kv writes dk/dv of a single block, or starts the fp32 accumulators that acc adds to
    with_keys = sum(kend > 0 for _, kend in gb.plan_mod.plan(b, nq, nk, hq, causal, rows=rows).blocks)
    assert "mm_kv" in kinds and ("acc" in kinds) == (with_keys > 1)


@pytest.mark.parametrize("b, nq, nk, hq, hkv, rows", [
    (1, 700, 700, 2, 2, 256),   # in place (B 1, no GQA), last block partial
    (2, 520, 530, 4, 1, 256),   # GQA 4, Nq < Nk (shift 10: key limits off the 8 grid)
    (1, 600, 380, 3, 3, 256),   # Nq > Nk: leading pieces without keys
    (1, 200, 200, 2, 1, None),  # one block (mm_kv writes dk/dv per key range)
])
@pytest.mark.parametrize("pieces", [2, 3, 4])
@pytest.mark.parametrize("split_acc", [True, False])
def test_causal_diagonal_pieces_vs_fp64(b, nq, nk, hq, hkv, rows, pieces, split_acc):
    """Causal blocks cut along the diagonal (each piece's P/dS/dq stop at its own key limit; dK/dV by
    key range or over zeroed P/dS) give the fp64 gradients, and launch per piece."""
    g = torch.Generator().manual_seed(nq + 3 * nk + pieces)
    d = 32
    q, dout = (torch.randn(b, nq, hq, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, generator=g).half() for _ in range(2))
    out, lse = attention(q, k, v, scale=0.25, causal=True)
    want = attention_bwd(dout, q, k, v, out, lse, scale=0.25, causal=True)
    numpy_gemm.CALLS.clear()
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = gb.gemm_backward(dout, q, k, v, out.half(), lse.float(), softmax_scale=0.25, causal=True, gemms=gemms,
                           rows=rows, pieces=pieces, split_acc=split_acc)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert torch.isfinite(x).all(), name
        err = (x.double() - r).abs().max().item()
        assert err < 2e-2 * max(1.0, r.abs().max().item()), (name, err)
    p = gb.plan_mod.plan(b, nq, nk, hq, True, rows=rows, pieces=pieces)
    assert numpy_gemm.CALLS.count("probs_causal") == sum(len(x) for x in p.pieces)
    assert max(len(x) for x in p.pieces) > 1


def test_core_gemms_refuses_fp32():
    with pytest.raises(ValueError, match="float16/bfloat16"):
        gb.CoreGemms(torch.float32, num_sms=132, launcher=numpy_gemm.make)


def test_row_blocks_round_trip():
    x = torch.randn(2, 150, 6, 8)
    xp = gb._rows_to_blocks(x, 2, 64, 192)
    assert xp.shape == (4, 3, 3 * 64, 8)
    x6 = xp.view(2, 2, 3, 64, 3, 8)  # [B, Hkv, block, row, head in group, D]
    assert x6[:, :, 2, 150 - 128:].abs().sum() == 0  # padded rows are zero
    assert torch.equal(x6[1, 1, 0, 5, 2], x[1, 5, 1 * 3 + 2])  # row 5 of head 5 = kv head 1, 3rd of its group
    back = torch.empty_like(x)
    gb._blocks_to_rows(xp, back, 64)
    assert torch.equal(back, x)


@pytest.mark.parametrize("g", [1, 4])
def test_row_vectors_are_row_contiguous_without_padding(g):
    """delta arrives transposed ([B, Hq, N] view of [B, N, Hq]); with no padding to copy it and
    g == 1 a reshape would keep its strides, which quack's TMA refuses (a stride-1 batch mode)."""
    x = torch.randn(1, 128, 2 * g).transpose(1, 2)
    xp = gb._vec_to_blocks(x, 2, 64, 128, 0.0)
    assert xp.shape == (2, 2, g * 64) and xp.is_contiguous()
    assert torch.equal(xp.view(1, 2, 2, 64, g).permute(0, 1, 4, 2, 3).reshape(1, 2 * g, 128), x)


@pytest.mark.parametrize("b, hq, hkv, in_place", [(1, 2, 2, True), (1, 4, 2, False), (2, 2, 2, False)])
def test_single_sequence_without_gqa_runs_in_place(b, hq, hkv, in_place):
    """B == 1 and g == 1: the GEMMs read q and write dq in place (no row copies); K/V are read in
    place whenever B == 1. Results match the copying path's."""
    g = torch.Generator().manual_seed(5)
    nq, nk, d = 150, 170, 32
    q, dout = (torch.randn(b, nq, hq, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, generator=g).half() for _ in range(2))
    out, lse = attention(q, k, v, scale=d ** -0.5, causal=True)
    seen = []

    def recording(spec):
        fn = numpy_gemm.make(spec)

        def call(*args):
            seen.append((spec.kind, [a.data_ptr() for a in args if isinstance(a, torch.Tensor)]))
            return fn(*args)
        return call

    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=recording)
    dq, dk, dv = gb.gemm_backward(dout, q, k, v, out.half(), lse.float(), softmax_scale=d ** -0.5, causal=True,
                                  gemms=gemms, rows=64)
    probs = [ptrs for kind, ptrs in seen if kind == "probs_causal"]
    mm_dq = [ptrs for kind, ptrs in seen if kind == "mm_dq"]
    assert (probs[0][0] == q.data_ptr()) == in_place  # A of block 0: q itself, or a copy
    assert (mm_dq[0][2] == dq.data_ptr()) == in_place  # D of block 0: dq itself, or a buffer
    assert (probs[0][1] == k.data_ptr()) == (b == 1)  # K in place for one sequence
    want = attention_bwd(dout, q, k, v, out, lse, scale=d ** -0.5, causal=True)
    for name, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item()), name


def _varlen_case(lens_q, lens_k, hq, hkv, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    tq, tk = sum(lens_q), sum(lens_k)
    q, dout = (torch.randn(tq, hq, d, generator=g).half() for _ in range(2))
    k, v = (torch.randn(tk, hkv, d, generator=g).half() for _ in range(2))
    return q, k, v, dout, cu(lens_q), cu(lens_k)


def _varlen_want(q, k, v, dout, cu_q, cu_k, scale, causal):
    """fp64 autograd through the packed reference, and its out/lse."""
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    out, lse = varlen_attention(q64, k64, v64, cu_q, cu_k, scale=scale, causal=causal)
    out.backward(dout.double())
    return out.detach(), lse.detach(), (q64.grad, k64.grad, v64.grad)


@pytest.mark.parametrize("lens_q, lens_k, hq, hkv, causal, rows", [
    ([0, 1, 17, 100, 64, 130], None, 4, 1, True, None),      # empty, 1-token and odd documents, GQA 4
    ([0, 1, 17, 100, 64, 130], None, 4, 1, False, None),     # the same, not causal (padded keys masked)
    ([200, 70, 70, 3], None, 8, 1, True, 64),                # several blocks per document, GQA 8
    ([150, 40, 90], [190, 40, 30], 2, 2, True, 64),          # Nq != Nk per document (bottom-right)
    ([150, 40, 90], [190, 0, 30], 6, 2, False, None),        # a document without keys
    ([64, 64, 64, 64], None, 2, 1, False, None),             # one group, nothing padded: probs_full
])
def test_varlen_documents_vs_fp64(lens_q, lens_k, hq, hkv, causal, rows):
    """Packed documents through the grouped, padded blocks: every document's gradients vs fp64, rows
    and keys of empty documents 0, no block straddling two documents."""
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, dout, cu_q, cu_k = _varlen_case(lens_q, lens_k, hq, hkv, seed=sum(lens_q))
    scale = 32 ** -0.5
    out, lse, want = _varlen_want(q, k, v, dout, cu_q, cu_k, scale, causal)
    numpy_gemm.CALLS.clear()
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = gb.gemm_backward_varlen(dout, q, k, v, out.half(), lse.float(), lens_q, lens_k, softmax_scale=scale,
                                  causal=causal, gemms=gemms, rows=rows)
    for name, x, r, ref in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert x.shape == ref.shape and x.dtype == torch.float16 and x.is_contiguous(), name
        err = (x.double() - r).abs().max().item()
        assert err < 2e-2 * max(1.0, r.abs().max().item()), (name, err)
        assert torch.isfinite(x).all(), name
    masked = causal or any(grp.masked_keys for grp in gb.plan_mod.varlen_groups(lens_q, lens_k, hq))
    assert ("probs_causal" in numpy_gemm.CALLS) == masked


def test_varlen_groups_share_launches():
    """Many short documents of one padded length run as one batch: one probabilities launch (per
    diagonal piece of the group's one block), not one per document."""
    lens = [100, 110, 120, 128, 97] * 4
    q, k, v, dout, cu_q, cu_k = _varlen_case(lens, lens, 2, 1)
    out, lse, want = _varlen_want(q, k, v, dout, cu_q, cu_k, 0.2, True)
    numpy_gemm.CALLS.clear()
    gemms = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
    got = gb.gemm_backward_varlen(dout, q, k, v, out.half(), lse.float(), lens, lens, softmax_scale=0.2,
                                  causal=True, gemms=gemms)
    (grp,) = gb.plan_mod.varlen_groups(lens, lens, 2)
    (pieces,) = gb.plan_mod.plan(len(grp.docs), grp.pad_q, grp.pad_k, 2, True, shift=grp.shift).pieces
    assert numpy_gemm.CALLS.count("probs_causal") == len(pieces)  # one per piece of the group's one block
    for x, r in zip(got, want):
        assert (x.double() - r).abs().max().item() < 2e-2 * max(1.0, r.abs().max().item())


@pytest.mark.parametrize("lens, route", [([2048] * 3, "gemm-dense"), ([3000, 100, 5000], "gemm-segments"),
                                         ([512] * 8, "fused")])
def test_varlen_route_reads_document_lengths(monkeypatch, lens, route):
    """A packed d512 batch routes by the keys an average row's document holds (GQA 8: GEMM from 2048)."""
    import xattn.torch.ops as ops

    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    t = sum(lens)
    q, k = torch.empty(t, 8, 512, dtype=torch.bfloat16), torch.empty(t, 1, 512, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    spec = ops._checked("bwd", "ffpa", q, k, k, True, -1, -1, cu, cu, max(lens), max(lens))[0]
    chosen, lengths = ops._bwd_route(spec, q, k, cu, cu)
    assert chosen.name == route and lengths == (lens, lens)
    monkeypatch.setenv("XATTN_BWD_ROUTE", "ffpa")  # the forced FFPA route never reads cu_seqlens
    assert ops._bwd_route(spec, q, k, cu, cu)[1] is None


def test_varlen_route_under_cuda_graph_capture_needs_no_lengths(monkeypatch):
    """While a CUDA graph captures, the packed backward keeps FFPA's route (reading cu_seqlens on the
    host would break the capture)."""
    import xattn.torch.ops as ops

    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    q, k = torch.empty(8192, 8, 512, dtype=torch.bfloat16), torch.empty(8192, 1, 512, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4096, 8192], dtype=torch.int32)
    spec = ops._checked("bwd", "ffpa", q, k, k, True, -1, -1, cu, cu, 4096, 4096)[0]

    class CudaLike(torch.Tensor):
        is_cuda = True

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cu_dev = cu.as_subclass(CudaLike)
    route, lengths = ops._bwd_route(spec, q, k, cu_dev, cu_dev)
    assert route.name == "fused" and "CUDA graph capture" in route.reason and lengths is None


@pytest.mark.parametrize("lens_q, lens_k, causal", [
    ([300, 40, 0, 20, 260, 1], None, True),    # long documents on the GEMMs, short ones (and 1 token) on FFPA
    ([280, 30, 90], [300, 25, 100], False),    # Nq != Nk per document, not causal
])
def test_short_groups_leave_the_gemm_route(monkeypatch, lens_q, lens_k, causal):
    """Under the auto route, groups padded to fewer keys than the measured table's run through the family's
    fused varlen backward as one gathered sub-batch (here: an fp64 stand-in of it), the rest on the GEMMs;
    the gradients are the fp64 ones. A forced GEMM route keeps every group."""
    import xattn.torch.ops as ops
    from tests.reference import attention_bwd as ref_bwd

    lens_k = lens_k or lens_q
    d = 512
    q, k, v, dout, cu_q, cu_k = _varlen_case(lens_q, lens_k, 8, 1, d=d, seed=len(lens_q))
    scale = d ** -0.5
    out, lse, want = _varlen_want(q, k, v, dout, cu_q, cu_k, scale, causal)
    monkeypatch.setattr(routes, "MIN_KEYS_BY_GROUP", ((1, 256),))
    real = gb.gemm_backward_varlen
    gemm_docs, fused = [], []

    def on_standins(*a, groups, **kw):
        gemm_docs.extend(i for grp in groups for i in grp.docs)
        kw["gemms"] = gb.CoreGemms(torch.float16, num_sms=132, launcher=numpy_gemm.make)
        return real(*a, groups=groups, **kw)

    def fused_fp64(plan, grads, dout, q, k, v, out, lse, softmax_scale, cu_q, cu_k, max_q, max_k):
        assert plan[0].varlen and plan[0].family == "ffpa"
        fused.append(q.shape[0])
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            rq, rk = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
            g = ref_bwd(dout[None, rq], q[None, rq], k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq],
                        scale=softmax_scale, causal=causal)
            for grad, rows, x in zip(grads, (rq, rk, rk), g):
                grad[rows] = x[0].to(grad.dtype)

    monkeypatch.setattr(gb, "gemm_backward_varlen", on_standins)
    monkeypatch.setattr(ops, "_launch_bwd", fused_fp64)
    monkeypatch.setattr(ops, "check_buffers", lambda *a: 0)  # CUDA-only buffer checks (tested elsewhere)
    monkeypatch.delenv("XATTN_BWD_ROUTE", raising=False)
    lengths = (lens_q, lens_k)
    plan = ops._checked("bwd", "ffpa", q.bfloat16(), k.bfloat16(), v.bfloat16(), causal, -1, -1, cu_q, cu_k,
                     max(lens_q), max(lens_k))
    got = ops._gemm_bwd(plan, "gemm-groups+fused", dout, q, k, v, out.half(), lse.float(), scale, lengths,
                        (cu_q, cu_k, max(lens_q), max(lens_k)))
    short = [i for i, (a, b) in enumerate(zip(lens_q, lens_k)) if a and b and round_up(b, 64) < 256]
    assert sorted(gemm_docs) == [i for i, (a, b) in enumerate(zip(lens_q, lens_k)) if a and b and i not in short]
    assert fused == [sum(lens_q[i] for i in short)]
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        err = (x.double() - r).abs().max().item()
        assert err < 2e-2 * max(1.0, r.abs().max().item()), (name, err)
    gemm_docs.clear(), fused.clear()
    ops._gemm_bwd(plan, "gemm-groups", dout, q, k, v, out.half(), lse.float(), scale, lengths,
                  (cu_q, cu_k, max(lens_q), max(lens_k)))
    assert not fused and len(gemm_docs) == sum(1 for a, b in zip(lens_q, lens_k) if a and b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_words_is_a_copy(dtype):
    """copy_words moves 16-bit permutations as 8-byte words, bit for bit what copy_ writes; anything else
    (a start or a last dim off 4 elements, fp32) falls to copy_."""
    x = torch.randn(6, 4, 3, 16).to(dtype)
    x.view(-1)[::7] = float("nan")  # NaN bit patterns survive either way
    for src in (x.permute(1, 0, 2, 3), x[:, 1:3].transpose(0, 1), x[..., 2:14].transpose(0, 2), x[..., 1:13]):
        dst = torch.empty(src.shape, dtype=dtype)
        gb.copy_words(dst, src)
        assert torch.equal(dst.view(torch.int8 if dtype == torch.float32 else torch.int16),
                           src.contiguous().view(torch.int8 if dtype == torch.float32 else torch.int16))
