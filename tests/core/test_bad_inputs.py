"""The bad-input battery of the core (``ffpa_fwd/bwd``, ``fa4_fwd/bwd`` on DLPack buffers), on the CPU.

The real core runs (checks, hot path, launcher cache, the diagnosis of C-side refusals) with the CPU
standing in for the GPU and the fp64 reference as launcher (``checked_core.py``). The core never
allocates: its "correct result" for an empty call is to launch nothing; query rows without any key
are refused by name (the front ends write out 0 / lse -inf themselves). Each case is followed by a
good call. ``test_bad_inputs_gpu.py`` runs the same tables on the real launchers."""

from __future__ import annotations

import math

import pytest
import torch

import xattn.core as xc
from tests.battery import case, raises
from tests.reference import attention as ref_attention, attention_bwd as ref_bwd, rel_err, varlen_attention
from xattn.core.spec import canonical_mask

from . import checked_core

BF16 = torch.bfloat16
BIG = 2 ** 31
TOL = 2e-2


@pytest.fixture
def standin(monkeypatch):
    checked_core.install(monkeypatch)


def randn(*shape, dtype=BF16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _fwd(b=2, nq=8, nk=12, hq=4, hkv=1, d=512, dv=None, dtype=BF16, fn="ffpa_fwd", **kw):
    """Forward buffers ``[B, N, H, D]``; base FFPA d512 GQA 4 (a precompiled GPU config)."""
    def make(device):
        dv_ = dv or d
        bufs = dict(q=randn(b, nq, hq, d, dtype=dtype, device=device),
                    k=randn(b, nk, hkv, d, dtype=dtype, device=device, seed=1),
                    v=randn(b, nk, hkv, dv_, dtype=dtype, device=device, seed=2),
                    out=torch.empty(b, nq, hq, dv_, dtype=dtype, device=device),
                    lse=torch.empty(b, hq, nq, device=device))
        return fn, bufs, {"softmax_scale": 0.05, **kw}
    return make


def _fa4(**kw):
    return _fwd(**{"hq": 8, "hkv": 2, "d": 128, "causal": True, "fn": "fa4_fwd", **kw})


def _varlen(cu_q=(0, 4, 10), cu_k=(0, 6, 14), max_q=6, max_k=8, tq=None, tk=None, cu_dtype=torch.int32, **kw):
    """Packed FA4 d128 GQA 4 causal (the precompiled varlen GPU config)."""
    def make(device):
        nq, nk = cu_q[-1] if tq is None else tq, cu_k[-1] if tk is None else tk
        bufs = dict(q=randn(nq, 8, 128, device=device), k=randn(nk, 2, 128, device=device, seed=1),
                    v=randn(nk, 2, 128, device=device, seed=2), out=torch.zeros(nq, 8, 128, dtype=BF16, device=device),
                    lse=torch.full((8, nq), float("-inf"), device=device))  # FA4 varlen's documented pre-fill
        cu = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=cu_dtype, device=device),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=cu_dtype, device=device))
        return "fa4_fwd", bufs, {"softmax_scale": 0.05, "causal": True, **cu, "max_seqlen_q": max_q,
                                 "max_seqlen_k": max_k, **kw}
    return make


def _bwd(fwd_make, grads_fill=0.0, workspace="layout"):
    """Backward buffers for the forward call ``fwd_make`` builds (out/lse from the reference)."""
    def make(device):
        fn, b, kw = fwd_make(device)
        q, k, v = b["q"], b["k"], b["v"]
        if q.numel() and k.numel() and q.dtype in (BF16, torch.float16):
            out, lse = _reference(fn, b, kw)
            b["out"].copy_(out)
            b["lse"].copy_(lse)
        bufs = dict(dout=randn(*b["out"].shape, dtype=b["out"].dtype, device=device, seed=3), q=q, k=k, v=v,
                    out=b["out"], lse=b["lse"], dq=torch.full_like(q, grads_fill), dk=torch.full_like(k, grads_fill),
                    dv=torch.full_like(v, grads_fill))
        if workspace == "layout":
            layout = xc.bwd_workspace(fn[:-4], q.shape, k.shape, head_dim_v=v.shape[-1], causal=kw.get("causal", False),
                                      window_size=kw.get("window_size", (None, None)),
                                      num_seqs=kw["cu_seqlens_q"].shape[0] - 1 if "cu_seqlens_q" in kw else None)
            kw = {**kw, "workspace": [torch.full(s, 0.0 if f is None else f, dtype=torch.float32, device=device)
                                      for _, s, _, f in layout]}
        return fn[:-4] + "_bwd", bufs, kw
    return make


def _change(make, fn):
    def changed(device):
        name, bufs, kw = make(device)
        return (name, *fn(bufs, kw, device))
    return changed


def _set(make, **buffers):
    """Replace buffers: ``name=lambda bufs, device: tensor``."""
    return _change(make, lambda b, kw, d: ({**b, **{n: f(b, d) for n, f in buffers.items()}}, kw))


def _kw(make, **kw):
    return _change(make, lambda b, k, d: (b, {**k, **kw}))


def _noncontig_last(t):
    return torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)[..., ::2]


def _expanded(shape_q, shape_k, d=512):
    """Zero-stride views (no memory) of sizes past the kernels' limits; out is one too (never written)."""
    def make(device):
        z = torch.zeros(1, 1, 1, d, dtype=BF16, device=device)
        q, k = z.expand(*shape_q), z.expand(*shape_k)
        lse = torch.zeros(1, 1, 1, device=device).expand(shape_q[0], shape_q[2], shape_q[1])
        return "ffpa_fwd", dict(q=q, k=k, v=k, out=q, lse=lse), {"softmax_scale": 0.05}
    return make


def _misaligned(b, d):
    t = b["q"]
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype, device=d)
    return flat[1:].view(t.shape)


FWD = [
    case("empty-batch", _fwd(b=0), launches=0),
    case("zero-q-len", _fwd(nq=0), launches=0),
    case("zero-q-and-k-len", _fwd(nq=0, nk=0), launches=0),
    case("zero-k-len", _fwd(nk=0), ValueError, "k: no keys at all"),
    case("fa4-zero-k-len", _fa4(nk=0), ValueError, "k: no keys at all"),
    case("empty-batch-bad-out-shape", _set(_fwd(b=0), out=lambda b, d: torch.empty(0, 8, 4, 384, dtype=BF16,
                                                                                      device=d)),
         ValueError, "out:", "(0, 8, 4, 512)"),
    case("zero-q-len-lse-bf16", _set(_fwd(nq=0), lse=lambda b, d: b["lse"].to(BF16)), TypeError, "lse:", "float32"),
    case("fa4-q-longer-than-k", _fa4(nq=12, nk=5)),
    case("head-dim-72", _fwd(d=72, fn="fa4_fwd"), NotImplementedError, "FA4", "72/72"),
    case("head-dim-300", _fwd(d=300), NotImplementedError, "320-512", "300"),
    case("head-dim-600", _fwd(d=600), NotImplementedError, "320-512", "600"),
    case("head-dim-328", _fwd(d=328), NotImplementedError, "steps of 16", "328"),
    case("head-dim-0", _fwd(d=0), NotImplementedError, "got 0"),
    case("v-head-dim-384-with-512", _fwd(dv=384), NotImplementedError, "equal", "512 and 384"),
    case("ffpa-head-dim-128", _fwd(d=128), NotImplementedError, "320-512", "128"),
    case("v-len-mismatch", _set(_fwd(), v=lambda b, d: b["v"][:, :11]), ValueError, "v:", "(2, 12, 1, 512)"),
    case("k-batch-mismatch", _set(_fwd(), k=lambda b, d: b["k"][:1]), ValueError, "k:", "batch 2"),
    case("v-heads-mismatch", _set(_fwd(), v=lambda b, d: b["v"].repeat(1, 1, 2, 1)), ValueError, "v:"),
    case("k-head-dim-mismatch", _set(_fwd(), k=lambda b, d: b["k"][..., :384].contiguous()), ValueError, "k:"),
    case("k-dtype-fp16", _set(_fwd(), k=lambda b, d: b["k"].half()), TypeError, "k:", "bfloat16"),
    case("out-dtype-fp16", _set(_fwd(), out=lambda b, d: b["out"].half()), TypeError, "out:", "bfloat16"),
    case("lse-dtype-bf16", _set(_fwd(), lse=lambda b, d: b["lse"].to(BF16)), TypeError, "lse:", "float32"),
    case("out-shape", _set(_fwd(), out=lambda b, d: b["out"][:, :7]), ValueError, "out:", "(2, 8, 4, 512)"),
    case("lse-shape-transposed", _set(_fwd(), lse=lambda b, d: b["lse"].transpose(1, 2).contiguous()), ValueError,
         "lse:", "[B, Hq, Nq]"),
    case("gqa-ratio-not-dividing", _fwd(hkv=3), ValueError, "k:", "Hkv=3 must divide Hq=4"),
    case("zero-kv-heads", _fwd(hkv=0), ValueError, "Hkv=0"),
    case("scale-nan", _kw(_fwd(), softmax_scale=math.nan), ValueError, "softmax_scale", "nan"),
    case("scale-zero", _kw(_fwd(), softmax_scale=0.0), ValueError, "softmax_scale"),
    case("scale-negative", _kw(_fwd(), softmax_scale=-0.05), ValueError, "softmax_scale"),
    case("scale-inf", _kw(_fwd(), softmax_scale=math.inf), ValueError, "softmax_scale"),
    case("scale-none", _kw(_fwd(), softmax_scale=None), TypeError, "softmax_scale"),
    case("scale-bool", _kw(_fwd(), softmax_scale=True), TypeError, "softmax_scale"),
    case("scale-string", _kw(_fwd(), softmax_scale="0.05"), TypeError, "softmax_scale"),
    case("causal-int", _kw(_fwd(), causal=1), TypeError, "causal"),
    case("stream-string", _kw(_fwd(), stream="0"), TypeError, "stream"),
    case("window-not-a-pair", _fa4(window_size=5, causal=False), TypeError, "window_size"),
    case("window-three-sides", _fa4(window_size=(1, 2, 3), causal=False), TypeError, "window_size"),
    case("window-negative", _fa4(window_size=(-5, 0), causal=False), ValueError, "window_size", "left side"),
    case("window-float-side", _fa4(window_size=(2.5, 0), causal=False), TypeError, "window_size", "float"),
    case("window-on-ffpa", _kw(_fwd(), window_size=(63, 0)), NotImplementedError, "sliding-window"),
    case("fp32", _fwd(dtype=torch.float32), TypeError, "q:", "float32"),
    case("int32", _fwd(dtype=torch.int32), TypeError, "q:", "int32"),
    case("q-rank-3", _set(_fwd(), q=lambda b, d: b["q"][0]), ValueError, "q:", "rank 4"),
    case("q-rank-5", _set(_fwd(), q=lambda b, d: b["q"][None]), ValueError, "q:", "rank 4"),
    case("q-not-a-tensor", _set(_fwd(), q=lambda b, d: b["q"].tolist()), TypeError, "q:", "DLPack"),
    case("q-non-contiguous-last-dim", _set(_fwd(), q=lambda b, d: _noncontig_last(b["q"])), ValueError, "q:",
         "unit stride"),
    case("out-non-contiguous-last-dim", _set(_fwd(), out=lambda b, d: _noncontig_last(b["out"])), ValueError,
         "out:", "unit stride"),
    case("q-misaligned", _set(_fwd(), q=_misaligned), ValueError, "q:", "16-byte aligned"),
    case("q-sdpa-layout-view", _set(_fwd(), q=lambda b, d: b["q"].transpose(1, 2).contiguous().transpose(1, 2))),
    case("huge-k-len-2^31", _expanded((1, 8, 4, 512), (1, BIG, 1, 512)), ValueError, "k:", "2147483648"),
    case("huge-q-len-2^31", _expanded((1, BIG, 4, 512), (1, 8, 1, 512)), ValueError, "q:", "2147483648"),
    case("huge-rows-B*N", _expanded((65535, 32769, 4, 512), (65535, 8, 1, 512)), ValueError, "q:", "B * N"),
    case("huge-batch-70000", _expanded((70000, 1, 4, 512), (70000, 1, 1, 512)), ValueError, "q:", "batch 70000"),
    case("huge-heads-65536", _expanded((1, 1, 65536, 512), (1, 1, 1024, 512)), ValueError, "q:", "65536 heads"),
]

VARLEN = [
    case("varlen-ok-baseline", _varlen()),
    case("varlen-cu-int64", _varlen(cu_dtype=torch.int64), TypeError, "cu_seqlens_q", "int32", "int64"),
    case("varlen-cu-k-int64", _kw(_varlen(), cu_seqlens_k=torch.tensor([0, 6, 14])), TypeError, "cu_seqlens_k"),
    case("varlen-cu-float", _varlen(cu_dtype=torch.float32), TypeError, "cu_seqlens_q", "int32"),
    case("varlen-cu-2d", _change(_varlen(), lambda b, kw, d: (b, {**kw, "cu_seqlens_q": kw["cu_seqlens_q"][None]})),
         ValueError, "cu_seqlens_q", "[S + 1]"),
    case("varlen-cu-length-mismatch", _change(_varlen(), lambda b, kw, d: (
        b, {**kw, "cu_seqlens_k": kw["cu_seqlens_k"][:2]})), ValueError, "cu_seqlens_k", "(3,)"),
    case("varlen-cu-only-q", _kw(_varlen(), cu_seqlens_k=None), ValueError, "give both"),
    case("varlen-no-segments", _varlen(cu_q=(0,), cu_k=(0,), tq=10, tk=14), ValueError, "cu_seqlens_q", "S >= 1"),
    case("varlen-max-seqlen-missing", _kw(_varlen(), max_seqlen_q=None), ValueError, "max_seqlen_q: required"),
    case("varlen-max-seqlen-negative", _varlen(max_q=-1), ValueError, "max_seqlen_q", "non-negative"),
    case("varlen-max-seqlen-bool", _varlen(max_k=True), ValueError, "max_seqlen_k"),
    case("varlen-cu-non-contiguous", _change(_varlen(), lambda b, kw, d: (b, {
        **kw, "cu_seqlens_q": torch.tensor([0, 9, 4, 9, 10, 9], dtype=torch.int32, device=d)[::2]})),
        ValueError, "cu_seqlens_q", "unit stride"),
    case("varlen-zero-q-tokens", _varlen(cu_q=(0, 0, 0), max_q=0), launches=0),
    case("varlen-zero-k-tokens", _varlen(cu_k=(0, 0, 0), max_k=0), ValueError, "k: no keys at all"),
    case("varlen-document-without-keys", _varlen(cu_k=(0, 0, 14), max_k=14)),
    case("varlen-rank-4", _set(_varlen(), q=lambda b, d: b["q"][None]), ValueError, "q:", "rank 3"),
    case("varlen-lse-dense-shape", _set(_varlen(), lse=lambda b, d: b["lse"][None]), ValueError, "lse:", "[Hq, Tq]"),
    case("varlen-huge-tokens-2^31", _set(_varlen(), q=lambda b, d: torch.zeros(1, 8, 128, dtype=BF16, device=d)
                                         .expand(BIG, 8, 128)), ValueError, "q:", "2147483648"),
]

BWD = [
    case("bwd-ok-baseline", _bwd(_fwd())),
    case("bwd-fa4-gqa-ok", _bwd(_fa4())),
    case("bwd-empty-batch", _bwd(_fwd(b=0)), launches=0),
    case("bwd-fa4-zero-q-len-writes-nothing", _bwd(_fa4(nq=0), grads_fill=7.0), launches=0, untouched=7.0),
    case("bwd-zero-k-len", _bwd(_fwd(nk=0)), ValueError, "k: no keys at all"),
    case("bwd-empty-batch-bad-dq", _set(_bwd(_fwd(b=0)), dq=lambda b, d: b["dq"][..., :384]), ValueError, "dq:"),
    case("bwd-workspace-missing", _bwd(_fwd(), workspace=None), ValueError, "workspace: required"),
    case("bwd-workspace-count", _change(_bwd(_fwd()), lambda b, kw, d: (b, {**kw, "workspace": kw["workspace"][:1]})),
         ValueError, "workspace: expected 2 buffers"),
    case("bwd-workspace-shape", _change(_bwd(_fwd()), lambda b, kw, d: (
        b, {**kw, "workspace": [w[..., :-1] for w in kw["workspace"]]})), ValueError, "workspace[dpsum]"),
    case("bwd-workspace-dtype", _change(_bwd(_fwd()), lambda b, kw, d: (
        b, {**kw, "workspace": [w.half() for w in kw["workspace"]]})), TypeError, "workspace[dpsum]", "float32"),
    case("bwd-dq-shape", _set(_bwd(_fwd()), dq=lambda b, d: b["dq"][:, :7]), ValueError, "dq:"),
    case("bwd-dv-dtype", _set(_bwd(_fwd()), dv=lambda b, d: b["dv"].half()), TypeError, "dv:"),
    case("bwd-dout-non-contiguous-last-dim", _set(_bwd(_fwd()), dout=lambda b, d: _noncontig_last(b["dout"])),
         ValueError, "dout:", "unit stride"),
    case("bwd-lse-shape", _set(_bwd(_fwd()), lse=lambda b, d: b["lse"][:, :, :7]), ValueError, "lse:"),
    case("bwd-scale-nan", _kw(_bwd(_fwd()), softmax_scale=math.nan), ValueError, "softmax_scale"),
    case("bwd-fa4-192-128-gqa", _bwd(_fwd(hq=4, hkv=2, d=192, dv=128, fn="fa4_fwd"), workspace=None),
         NotImplementedError, "head_dim == head_dim_v under GQA", gpu=False),
]


def test_workspace_past_int32_is_refused_before_allocation():
    """FA4's dq_accum holds ``Nq * D`` fp32 per head: at 2**23 tokens of d256 its last dim is 2**31."""
    with raises(ValueError, "workspace[dq_accum]", "32-bit"):
        xc.bwd_workspace("fa4", (1, 2 ** 23, 2, 256), (1, 64, 1, 256))
    with raises(ValueError, "workspace[dq_accum]"):
        xc.bwd_workspace("fa4", (2 ** 24, 2, 128), (64, 1, 128), num_seqs=1)
    assert xc.bwd_workspace("fa4", (1, 2 ** 22, 2, 256), (1, 64, 1, 256))  # just below: fine


# --- running a case -----------------------------------------------------------------------------

def _reference(fn, b, kw):
    scale = kw["softmax_scale"]
    causal, left, right = canonical_mask(kw.get("causal", False), *kw.get("window_size", (None, None)))
    if kw.get("cu_seqlens_q") is not None:
        return varlen_attention(b["q"], b["k"], b["v"], kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(),
                                scale=scale, causal=causal, window=(left, right))
    return ref_attention(b["q"], b["k"], b["v"], scale=scale, causal=causal, window=(left, right))


def _reference_bwd(b, kw):
    causal = kw.get("causal", False)
    if kw.get("cu_seqlens_q") is not None:
        return checked_core._varlen_bwd(*(b[n] for n in ("dout", "q", "k", "v", "out", "lse")),
                                        kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), kw["softmax_scale"], causal,
                                        (None, None))
    return ref_bwd(*(b[n] for n in ("dout", "q", "k", "v", "out", "lse")), scale=kw["softmax_scale"], causal=causal)


def _close(got, want, what):
    assert got.shape == want.shape, what
    if want.numel():
        got, want = got.cpu().double(), want.cpu().double()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows differ"
        assert rel_err(got, want) < TOL, (what, rel_err(got, want))


def call(fn, bufs, kw):
    names = ("q", "k", "v", "out", "lse") if fn.endswith("fwd") else ("dout", "q", "k", "v", "out", "lse", "dq", "dk",
                                                                      "dv")
    getattr(xc, fn)(*(bufs[n] for n in names), **kw)


def check_result(c, fn, bufs, kw, launches=None):
    before = len(launches) if launches is not None else None
    snapshot = {n: t.clone() for n, t in bufs.items()}
    call(fn, bufs, kw)
    if launches is not None and "launches" in c.extra:
        assert len(launches) - before == c.extra["launches"], launches[before:]
    if "untouched" in c.extra:  # no query rows: nothing written, the caller's zeros (here 7s) stay
        for n in ("dq", "dk", "dv"):
            assert torch.equal(bufs[n], snapshot[n]), n
        return
    if fn.endswith("fwd"):
        out, lse = _reference(fn, bufs, kw)
        _close(bufs["out"], out, "out")
        _close(bufs["lse"], lse, "lse")
    else:
        for n, want in zip(("dq", "dk", "dv"), _reference_bwd(bufs, kw)):
            _close(bufs[n], want, n)


def good_call(device="cpu"):
    fn, bufs, kw = _fwd(b=1, nq=16, nk=20)(device)
    call(fn, bufs, kw)
    out, lse = _reference(fn, bufs, kw)
    _close(bufs["out"], out, "out")
    _close(bufs["lse"], lse, "lse")


def run(c, device, launches=None):
    fn, bufs, kw = c.make(device)
    if c.error is not None:
        with raises(c.error, *c.words):
            call(fn, bufs, kw)
    else:
        check_result(c, fn, bufs, kw, launches)
    good_call(device)


@pytest.mark.parametrize("c", FWD + VARLEN + BWD)
def test_core(c, standin):
    run(c, "cpu", checked_core.LAUNCHES)
