"""Every core kernel family, forward and backward, against the fp64 reference on the GPU.

Outputs are poisoned with NaN first (except the values the contract asks the caller to
pre-fill, from ``KernelSpec.output_fill`` and workspace ``fill``), so an element the
kernels fail to write shows up as NaN. Inputs are fresh ``randn`` draws."""

from __future__ import annotations

import math

import pytest
import torch

import xattn.core as xc
from tests.reference import attention, rel_err, varlen_attention

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}
NAN = float("nan")
DT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _fill(t: torch.Tensor, name: str, fills: dict) -> torch.Tensor:
    return t.fill_(fills.get(name, NAN))


def core_fwd(family, q, k, v, *, scale, causal=False, window=(None, None), cu=None, max_seqlen=None):
    """Allocate poisoned out/lse, apply the documented pre-fill, run the core forward."""
    varlen = cu is not None
    spec = xc.KernelSpec(family, "fwd", DT[q.dtype], q.shape[-1], v.shape[-1], q.shape[-2] // k.shape[-2],
                         causal, varlen, *window)
    fills = spec.output_fill()
    out = _fill(q.new_empty((*q.shape[:-1], v.shape[-1])), "out", fills)
    lse_shape = (q.shape[1], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    lse = _fill(torch.empty(lse_shape, device=q.device), "lse", fills)
    kw = dict(softmax_scale=scale, causal=causal)
    if family == "fa4":
        kw["window_size"] = window
    if varlen:
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1])
    (xc.ffpa_fwd if family == "ffpa" else xc.fa4_fwd)(q, k, v, out, lse, **kw)
    return out, lse


def core_bwd(family, dout, q, k, v, out, lse, *, scale, causal=False, window=(None, None), cu=None,
             max_seqlen=None):
    varlen = cu is not None
    spec = xc.KernelSpec(family, "bwd", DT[q.dtype], q.shape[-1], v.shape[-1], q.shape[-2] // k.shape[-2],
                         causal, varlen, *window)
    fills = spec.output_fill()
    dq, dk, dv = (_fill(torch.empty_like(t), n, fills) for t, n in ((q, "dq"), (k, "dk"), (v, "dv")))
    layout = xc.bwd_workspace(family, q.shape, k.shape, head_dim_v=v.shape[-1], causal=causal,
                              window_size=window, num_seqs=cu[0].numel() - 1 if varlen else None)
    ws = [torch.full(shape, NAN if fill is None else fill, dtype=torch.float32, device=q.device)
          for _, shape, _, fill in layout]
    kw = dict(softmax_scale=scale, causal=causal, workspace=ws)
    if family == "fa4":
        kw["window_size"] = window
    if varlen:
        kw.update(cu_seqlens_q=cu[0], cu_seqlens_k=cu[1], max_seqlen_q=max_seqlen[0], max_seqlen_k=max_seqlen[1])
    (xc.ffpa_bwd if family == "ffpa" else xc.fa4_bwd)(dout, q, k, v, out, lse, dq, dk, dv, **kw)
    return dq, dk, dv


def _inputs(shape_q, shape_k, dv, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(shape_q, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(shape_k, device="cuda", dtype=dtype, generator=g)
    v = torch.randn((*shape_k[:-1], dv), device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _check_against_reference(family, q, k, v, *, causal, window=(None, None), cu=None, max_seqlen=None,
                             scale=None):
    scale = scale or 1 / math.sqrt(q.shape[-1])
    out, lse = core_fwd(family, q, k, v, scale=scale, causal=causal, window=window, cu=cu, max_seqlen=max_seqlen)
    dout = torch.randn_like(out)
    dq, dk, dv = core_bwd(family, dout, q, k, v, out, lse, scale=scale, causal=causal, window=window, cu=cu,
                          max_seqlen=max_seqlen)
    torch.cuda.synchronize()
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    if cu is None:
        ref_out, ref_lse = attention(q64, k64, v64, scale=scale, causal=causal, window=window)
    else:
        ref_out, ref_lse = varlen_attention(q64, k64, v64, *cu, scale=scale, causal=causal, window=window)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    tol = TOL[q.dtype]
    errs = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
    errs.update({n: rel_err(g, r) for n, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads)})
    for name, t in dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv).items():
        assert not t.isnan().any(), f"{name}: NaN left (unwritten element or bad math); errs={errs}"
    empty_rows = ~torch.isfinite(ref_lse)
    assert (lse[empty_rows] == float("-inf")).all(), "rows with no visible key must have lse = -inf"
    for name, e in errs.items():
        assert e <= tol, f"{name}: rel. err {e:.2e} > {tol:.0e}; all: {errs}"
    return errs


FFPA_DENSE = [
    pytest.param(d, g, causal, nq, nk, dtype, id=f"d{d}-g{g}-{'causal' if causal else 'full'}-{nq}x{nk}-{DT[dtype]}")
    for d, dtype in ((512, torch.bfloat16),)
    for g in (1, 2, 4) for causal in (False, True) for nq, nk in ((256, 256), (192, 320), (320, 192))
] + [
    pytest.param(d, 2, causal, 200, 264, dtype, id=f"d{d}-g2-{'causal' if causal else 'full'}-200x264-{DT[dtype]}")
    for d, dtype in ((320, torch.bfloat16), (384, torch.float16), (448, torch.bfloat16)) for causal in (False, True)
]


@pytest.mark.parametrize("d, g, causal, nq, nk, dtype", FFPA_DENSE)
def test_ffpa_dense(d, g, causal, nq, nk, dtype):
    q, k, v = _inputs((2, nq, 2 * g, d), (2, nk, 2, d), d, dtype, seed=d + g + nq)
    _check_against_reference("ffpa", q, k, v, causal=causal)


FA4_DENSE = [
    pytest.param(d, dv, g, causal, window, nq, nk,
                 id=f"d{d}x{dv}-g{g}-{'causal' if causal else 'full'}-w{window[0]}-{nq}x{nk}")
    for d, dv, gs in ((64, 64, (1, 4)), (96, 96, (1, 2)), (128, 128, (1, 4)), (192, 128, (1,)), (256, 256, (1, 2)))
    for g in gs for causal, window in ((False, (None, None)), (True, (None, None)), (False, (100, 0)))
    for nq, nk in ((256, 256), (200, 330))
]


@pytest.mark.parametrize("d, dv, g, causal, window, nq, nk", FA4_DENSE)
def test_fa4_dense(d, dv, g, causal, window, nq, nk):
    q, k, v = _inputs((2, nq, 2 * g, d), (2, nk, 2, d), dv, torch.bfloat16, seed=d + g + nq)
    _check_against_reference("fa4", q, k, v, causal=causal, window=window)


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device="cuda")


# Uneven documents, a document with no queries, one with fewer keys than queries.
VARLEN_Q = [100, 0, 257, 63, 30]
VARLEN_K = [90, 60, 250, 130, 30]


@pytest.mark.parametrize("family, d, dv, g", [
    pytest.param("ffpa", 512, 512, 4, id="ffpa-d512-g4"),
    pytest.param("ffpa", 384, 384, 1, id="ffpa-d384-g1"),
    pytest.param("fa4", 128, 128, 4, id="fa4-d128-g4"),
    pytest.param("fa4", 192, 128, 1, id="fa4-d192x128-g1"),
    pytest.param("fa4", 256, 256, 2, id="fa4-d256-g2"),
])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen(family, d, dv, g, causal):
    cu = (_cu(VARLEN_Q), _cu(VARLEN_K))
    q, k, v = _inputs((sum(VARLEN_Q), 2 * g, d), (sum(VARLEN_K), 2, d), dv, torch.bfloat16, seed=d + g)
    _check_against_reference(family, q, k, v, causal=causal, cu=cu, max_seqlen=(max(VARLEN_Q), max(VARLEN_K)))


def test_ffpa_gemma_scale_one():
    """Gemma 4 uses scaling=1.0 with q/k norms: never assume 1/sqrt(d)."""
    q, k, v = _inputs((1, 256, 8, 512), (1, 256, 2, 512), 512, torch.bfloat16, seed=7)
    q = (q / q.float().norm(dim=-1, keepdim=True).to(q.dtype) * 4).contiguous()
    k = (k / k.float().norm(dim=-1, keepdim=True).to(k.dtype) * 4).contiguous()
    _check_against_reference("ffpa", q, k, v, causal=True, scale=1.0)


def test_sdpa_layout_views_need_no_copy():
    """[B, H, N, D] storage viewed as [B, N, H, D] (what HF hands over) runs as is."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in _inputs((2, 256, 4, 512), (2, 256, 4, 512), 512, torch.bfloat16, seed=3))
    assert not q.is_contiguous()
    _check_against_reference("ffpa", q, k, v, causal=False)


@pytest.mark.parametrize("family, d", [("ffpa", 512), ("fa4", 128)])
def test_cupy_buffers_give_the_same_bits_as_torch(family, d):
    cp = pytest.importorskip("cupy")
    q, k, v = _inputs((2, 300, 4, d), (2, 300, 2, d), d, torch.float16, seed=11)
    out_t, lse_t = core_fwd(family, q, k, v, scale=0.07, causal=True)
    torch.cuda.synchronize()
    qc, kc, vc = (cp.asarray(t.cpu().numpy()) for t in (q, k, v))  # fresh CuPy allocations
    out_c = cp.zeros(qc.shape, dtype=cp.float16)
    lse_c = cp.full((2, 4, 300), -cp.inf, dtype=cp.float32)
    fn = xc.ffpa_fwd if family == "ffpa" else xc.fa4_fwd
    fn(qc, kc, vc, out_c, lse_c, softmax_scale=0.07, causal=True)
    cp.cuda.Device().synchronize()
    assert torch.equal(torch.from_numpy(cp.asnumpy(out_c)).cuda(), out_t)
    assert torch.equal(torch.from_numpy(cp.asnumpy(lse_c)).cuda(), lse_t)


def test_explicit_stream_gives_the_same_bits():
    q, k, v = _inputs((2, 512, 8, 512), (2, 512, 2, 512), 512, torch.bfloat16, seed=5)
    out_a, lse_a = core_fwd("ffpa", q, k, v, scale=0.05)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    out_b, lse_b = torch.full_like(out_a, NAN), torch.full_like(lse_a, NAN)
    torch.cuda.synchronize()
    xc.ffpa_fwd(q, k, v, out_b, lse_b, softmax_scale=0.05, stream=side.cuda_stream)
    side.synchronize()
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_torch_current_stream_is_used():
    """stream=None follows torch.cuda.current_stream(): work queued there is ordered."""
    q, k, v = _inputs((1, 1024, 8, 512), (1, 1024, 8, 512), 512, torch.bfloat16, seed=9)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        q2 = q * 1  # produced on `side`, consumed on `side` by the kernel
        out, lse = core_fwd("ffpa", q2, k, v, scale=0.05)
    side.synchronize()
    ref, _ = core_fwd("ffpa", q, k, v, scale=0.05)
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


def _bad_out_cases(q):
    spare = torch.empty(q.numel() + 8, device="cuda", dtype=q.dtype)
    return [
        pytest.param(lambda: spare[1:1 + q.numel()].view(q.shape), (ValueError,),
                     "out: data pointer must be 16-byte aligned", id="misaligned"),
        pytest.param(lambda: torch.empty_like(q, dtype=torch.float16), (TypeError,), "out: expected dtype bfloat16",
                     id="dtype"),
        pytest.param(lambda: torch.empty(q.shape[:-1] + (q.shape[-1] * 2,), device="cuda", dtype=q.dtype)[..., ::2],
                     (ValueError,), "out: needs unit stride", id="strided"),
        pytest.param(lambda: torch.empty((q.shape[0], q.shape[1] + 1, *q.shape[2:]), device="cuda", dtype=q.dtype),
                     (ValueError,), "out: expected shape", id="shape"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_bad_buffers_on_gpu_are_named_before_launch(case):
    """Buffers that pass the cheap q/k/v checks are refused by the launcher's C-side checks,
    then named by the full validation; the CUDA context stays healthy."""
    q, k, v = _inputs((1, 128, 4, 128), (1, 128, 4, 128), 128, torch.bfloat16, seed=1)
    lse = torch.empty(1, 4, 128, device="cuda")
    make, exc, words = _bad_out_cases(q)[case].values
    with pytest.raises(exc, match=words.replace("(", r"\(")):
        xc.fa4_fwd(q, k, v, make(), lse, softmax_scale=0.1)
    out, _ = core_fwd("fa4", q, k, v, scale=0.1)  # the context still works
    torch.cuda.synchronize()
    assert not out.isnan().any()


def test_bad_workspace_is_named_before_launch():
    q, k, v = _inputs((1, 128, 8, 512), (1, 128, 2, 512), 512, torch.bfloat16, seed=2)
    out, lse = core_fwd("ffpa", q, k, v, scale=0.05)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    ws = [torch.empty(1, 8, 128, device="cuda"), torch.empty(1, 8, 100, device="cuda")]
    with pytest.raises(ValueError, match=r"workspace\[lse_log2\]: expected shape \(1, 8, 128\)"):
        xc.ffpa_bwd(out, q, k, v, out, lse, *grads, softmax_scale=0.05, workspace=ws)
    ws[1] = torch.empty(1, 8, 128, device="cuda", dtype=torch.float16)
    with pytest.raises(TypeError, match=r"workspace\[lse_log2\]: expected dtype float32"):
        xc.ffpa_bwd(out, q, k, v, out, lse, *grads, softmax_scale=0.05, workspace=ws)
