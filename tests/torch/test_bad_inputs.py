"""The bad-input battery of the torch front ends, on the CPU: ``xattn.torch.attention_with_lse`` (dense
and varlen), the HF function ``ffpa_attention_forward`` and the FA4 helpers of ``xattn.torch.fa4``.

The REAL core runs underneath (every check, the hot path, the launcher cache); only the compiled
launchers are replaced by the fp64 reference (``tests/core/checked_core.py``). Each case is a named
error or a correct result (vs ``tests/reference.py``, forward and gradients), and a good call after
it must still be right. ``test_bad_inputs_gpu.py`` runs the same tables on the real kernels."""

from __future__ import annotations

import math

import pytest
import torch

import xattn.torch as xt
from tests.bad_input_table import BIG, TABLE, VARLEN_TABLE, Ops, cases
from tests.battery import case, raises
from tests.core import checked_core
from tests.reference import attention as ref_attention, rel_err, varlen_attention as ref_varlen
from xattn.core.spec import canonical_mask

BF16 = torch.bfloat16
TOL = 2e-2  # bf16 outputs vs fp64 (the CPU stand-in rounds the exact result; the kernels: ~3e-3)


@pytest.fixture
def standin(monkeypatch):
    checked_core.install(monkeypatch)


def randn(*shape, dtype=BF16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed + 31 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def _dense(b=2, nq=8, nk=12, hq=4, hkv=1, d=512, dv=None, dtype=BF16, **kw):
    """Inputs ``[B, N, H, D]``; the base case is FFPA d512 GQA 4 (a precompiled GPU config)."""
    def make(device):
        q = randn(b, nq, hq, d, dtype=dtype, device=device)
        k = randn(b, nk, hkv, d, dtype=dtype, device=device, seed=1)
        v = randn(b, nk, hkv, dv or d, dtype=dtype, device=device, seed=2)
        return (q, k, v), dict(kw)
    return make


def _fa4(**kw):
    """FA4 d128 GQA 4 causal (a precompiled GPU config)."""
    return _dense(**{"hq": 8, "hkv": 2, "d": 128, "causal": True, **kw})


def _window(**kw):
    """FA4 d256 GQA 2, sliding window (63, 0) (a precompiled GPU config)."""
    return _dense(**{"hq": 4, "hkv": 2, "d": 256, "window_size": (63, 0), **kw})


def _change(make, fn):
    """``make`` with its ``(q, k, v), kwargs`` passed through ``fn``."""
    def changed(device):
        (q, k, v), kw = make(device)
        return fn(q, k, v, kw, device)
    return changed


def _expanded(shape_q, shape_k, d=512, hq_dim=2):
    """Zero-stride views of any size (no memory): the size checks must refuse them before allocating."""
    def make(device):
        q = torch.zeros(1, 1, 1, d, dtype=BF16, device=device).expand(*shape_q)
        k = torch.zeros(1, 1, 1, d, dtype=BF16, device=device).expand(*shape_k)
        return (q, k, k), {}
    return make


def _varlen(cu_q=(0, 4, 10), cu_k=(0, 6, 14), max_q=6, max_k=8, tq=None, tk=None, cu_dtype=torch.int32, **kw):
    """Packed ``[T, H, D]`` FA4 d128 GQA 4 causal (the precompiled varlen GPU config)."""
    def make(device):
        nq, nk = cu_q[-1] if tq is None else tq, cu_k[-1] if tk is None else tk
        q = randn(nq, 8, 128, device=device)
        k, v = randn(nk, 2, 128, device=device, seed=1), randn(nk, 2, 128, device=device, seed=2)
        cu = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=cu_dtype, device=device),
                  cu_seqlens_k=torch.tensor(cu_k, dtype=cu_dtype, device=device))
        return (q, k, v), {"causal": True, **cu, "max_seqlen_q": max_q, "max_seqlen_k": max_k, **kw}
    return make


def _noncontig_last(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


class _TorchOps(Ops):
    def cast(self, x, dtype):
        return x.to(getattr(torch, dtype))

    def tile_heads(self, x, n):
        return x.repeat(1, 1, n, 1)


def _named(make):
    """``make`` taking the table's dtype names (``dtype``, ``cu_dtype``) too."""
    def build(**kw):
        return make(**{n: getattr(torch, x) if n in ("dtype", "cu_dtype") and isinstance(x, str) else x
                       for n, x in kw.items()})
    return build


BUILD = {"dense": _named(_dense), "fa4": _named(_fa4), "window": _named(_window), "varlen": _named(_varlen),
         "shapes": lambda q, k: _expanded(q, k)}
SHARED = cases(TABLE, "torch", BUILD, lambda make, fn: _change(make, lambda q, k, v, kw, d: fn(q, k, v, kw)),
               _TorchOps(), "softmax_scale")
SHARED_VARLEN = cases(VARLEN_TABLE, "torch", BUILD,
                      lambda make, fn: _change(make, lambda q, k, v, kw, d: fn(q, k, v, kw)), _TorchOps(),
                      "softmax_scale")

DENSE = SHARED + [  # the torch-only cases; the shared ones are tests/bad_input_table.py's
    case("window-negative-left", _window(window_size=(-5, 0)), ValueError, "window_size", "left side"),
    case("window-fa2-unbounded-left", _window(window_size=(-1, 0))),  # FlashAttention's -1: causal, vs fp64
    case("window-on-ffpa", _dense(window_size=(63, 0)), NotImplementedError, "sliding-window"),
    case("causal-fa2-unbounded-on-ffpa", _dense(causal=True, window_size=(-1, -1))),  # plain causal, vs fp64
    case("fp64", _dense(dtype=torch.float64), TypeError, "q:", "float64"),
    case("q-rank-2", _change(_dense(), lambda q, k, v, kw, d: ((q[0, 0], k, v), kw)), ValueError, "q:", "rank 4"),
    case("kv-rank-3", _change(_dense(), lambda q, k, v, kw, d: ((q, k[0], v[0]), kw)), ValueError, "k:", "rank 4"),
    # strides: the last dim is made contiguous (as FlashAttention); other strided views run as they are
    case("q-non-contiguous-last-dim", _change(_dense(), lambda q, k, v, kw, d: ((_noncontig_last(q), k, v), kw))),
    case("kv-non-contiguous-last-dim",
         _change(_dense(), lambda q, k, v, kw, d: ((q, _noncontig_last(k), _noncontig_last(v)), kw))),
    case("q-sdpa-layout-view", _change(_dense(), lambda q, k, v, kw, d: ((q.transpose(1, 2).contiguous()
                                                                         .transpose(1, 2), k, v), kw))),
]

VARLEN = SHARED_VARLEN + [
    case("varlen-cu-only-q", _change(_varlen(), lambda q, k, v, kw, d: (
        (q, k, v), {**kw, "cu_seqlens_k": None})), ValueError, "cu_seqlens_q and cu_seqlens_k"),
    case("varlen-max-seqlen-missing", _varlen(max_seqlen_q=None), ValueError, "max_seqlen_q"),
    case("varlen-cu-non-contiguous", _change(_varlen(), lambda q, k, v, kw, d: (
        (q, k, v), {**kw, "cu_seqlens_q": torch.tensor([0, 9, 4, 9, 10, 9], dtype=torch.int32, device=d)[::2]})),
        ValueError, "cu_seqlens_q", "unit stride"),
    case("varlen-huge-tokens-2^31", _change(_varlen(), lambda q, k, v, kw, d: (
        (torch.zeros(1, 8, 128, dtype=BF16, device=d).expand(BIG, 8, 128), k, v), kw)), ValueError, "q:",
        "2147483648"),
]


# --- running a case -----------------------------------------------------------------------------

def _reference(q, k, v, kw):
    """fp64 ``(out, lse)`` of the call ``attention_with_lse(q, k, v, **kw)``."""
    scale = kw.get("softmax_scale") or 1.0 / math.sqrt(q.shape[-1])
    causal, left, right = canonical_mask(bool(kw.get("causal", False)), *kw.get("window_size", (None, None)))
    window = (None if left is None or left < 0 else left, None if right is None or right < 0 else right)
    if kw.get("cu_seqlens_q") is not None:
        return ref_varlen(q, k, v, kw["cu_seqlens_q"].cpu(), kw["cu_seqlens_k"].cpu(), scale=scale, causal=causal,
                          window=window)
    return ref_attention(q, k, v, scale=scale, causal=causal, window=window)


def close(got, want, tol=TOL, what="out"):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if want.numel():
        got, want = got.detach().cpu().double(), want.detach().cpu().double()
        assert torch.equal(torch.isneginf(got), torch.isneginf(want)), f"{what}: -inf rows differ"
        err = rel_err(got, want)
        assert err < tol, f"{what}: rel. err {err:.2e} >= {tol}"


def check_result(call, args, kw, bwd_error=None, reference=_reference, tol=TOL):
    """``call(q, k, v, **kw) -> out`` or ``(out, lse)``; out, lse and the gradients of q, k, v vs fp64."""
    q, k, v = (t.detach().requires_grad_() for t in args)
    res = call(q, k, v, **kw)
    out, lse = res if isinstance(res, tuple) else (res, None)
    ref_in = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*ref_in, kw)
    close(out, ref_out, tol)
    if lse is not None:
        close(lse, ref_lse, tol, "lse")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype).to(out.device)
    if bwd_error is not None:
        with pytest.raises(bwd_error):
            torch.autograd.grad(out, (q, k, v), dout)
        return
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref_out, ref_in, dout.cpu().double(), allow_unused=True) \
        if ref_out.requires_grad else (None, None, None)  # a reference without any row: no graph
    for name, g, w, t in zip(("dq", "dk", "dv"), grads, want, ref_in):
        close(g, torch.zeros_like(t) if w is None else w, tol, name)


def good_call(device="cpu"):
    """The same process must still compute right after any refused or failed call."""
    (q, k, v), kw = _dense(b=1, nq=16, nk=20)(device)
    check_result(xt.attention_with_lse, (q, k, v), kw)


def run(c, call, device, reference=_reference, tol=TOL):
    args, kw = c.make(device)
    if c.error is not None:
        with raises(c.error, *c.words):
            call(*args, **kw)
    else:
        check_result(call, args, kw, c.bwd_error, reference, tol)
    good_call(device)


@pytest.mark.parametrize("c", DENSE + VARLEN)
def test_attention(c, standin):
    run(c, xt.attention_with_lse, "cpu")


# --- the HF function (attn_implementation="ffpa") ----------------------------------------------------

class _Module(torch.nn.Module):
    is_causal = False


def hf_call(q, k, v, **kw):
    from xattn.torch.ffpa_attention import ffpa_attention_forward

    scaling = kw.pop("scaling", 0.05)
    out, weights = ffpa_attention_forward(_Module(), q, k, v, None, dropout=0.0, scaling=scaling, **kw)
    assert weights is None
    return out


def _hf_reference(q, k, v, kw):
    """HF layout in ``[B, H, N, D]``, out ``[B, N, H, Dv]``; non-causal (``_Module.is_causal``)."""
    t = [x.transpose(1, 2) for x in (q, k, v)]
    scale = kw.get("scaling", 0.05)
    if kw.get("cu_seq_lens_q") is not None:
        out, lse = ref_varlen(*(x[0] for x in t), kw["cu_seq_lens_q"].cpu(), kw["cu_seq_lens_k"].cpu(), scale=scale)
        return out[None], None
    return ref_attention(*t, scale=scale)[0], None


def _hf(b=2, nq=8, nk=12, hq=4, hkv=1, d=512, dv=None, dtype=BF16, **kw):
    """HF inputs ``[B, H, N, D]``, FFPA d512 GQA 4 non-causal."""
    return _change(_dense(b, nq, nk, hq, hkv, d, dv, dtype),
                   lambda q, k, v, _, device: (tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)), dict(kw)))


def _hf_packed(cu, dtype=torch.int64):
    def make(device):
        (q, k, v), _ = _hf(b=1, nq=10, nk=10)(device)
        c = torch.tensor(cu, dtype=dtype, device=device)
        return (q, k, v), dict(cu_seq_lens_q=c, cu_seq_lens_k=c, max_length_q=6, max_length_k=6)
    return make


HF = [
    case("hf-empty-batch", _hf(b=0)),
    case("hf-zero-q-len", _hf(nq=0)),
    case("hf-zero-k-len", _hf(nk=0)),
    case("hf-head-dim-72-runs-on-sdpa", _hf(d=72)),
    case("hf-head-dim-600-runs-on-sdpa", _hf(d=600)),
    case("hf-v-head-dim-384-runs-on-sdpa", _hf(dv=384)),
    case("hf-fp32-runs-on-sdpa", _hf(dtype=torch.float32)),
    case("hf-scaling-zero-runs-on-sdpa", _hf(scaling=0.0)),
    case("hf-scaling-negative-runs-on-sdpa", _hf(scaling=-0.05)),
    case("hf-scaling-nan", _hf(scaling=math.nan), ValueError, "scaling", "nan"),
    case("hf-scaling-inf", _hf(scaling=math.inf), ValueError, "scaling", "inf"),
    case("hf-int-dtype", _hf(dtype=torch.int32), TypeError, "query", "int32"),
    case("hf-v-len-mismatch", _change(_hf(), lambda q, k, v, kw, d: ((q, k, v[:, :, :11]), kw)), ValueError, "v:"),
    case("hf-k-dtype-mismatch", _change(_hf(), lambda q, k, v, kw, d: ((q, k.half(), v), kw)), TypeError, "k:"),
    case("hf-gqa-ratio-not-dividing", _hf(hkv=3), ValueError, "Hkv=3 must divide Hq=4"),
    case("hf-rank-3", _change(_hf(), lambda q, k, v, kw, d: ((q[0], k[0], v[0]), kw)), ValueError, "query",
         "4 dims"),
    case("hf-not-a-tensor", _change(_hf(b=1, nq=1, hq=2, hkv=1), lambda q, k, v, kw, d: ((q.tolist(), k, v), kw)),
         TypeError, "query", "list"),
    case("hf-non-contiguous-last-dim", _change(_hf(), lambda q, k, v, kw, d: ((_noncontig_last(q), k, v), kw))),
    case("hf-packed-cu-seq-lens-int64", _hf_packed((0, 4, 10)), gpu=False),
    case("hf-huge-k-len-2^31", _change(_expanded((1, 8, 8, 512), (1, BIG, 2, 512)),
                                       lambda q, k, v, kw, d: (tuple(t.transpose(1, 2) for t in (q, k, v)), kw)),
         ValueError, "k:", "2147483648"),
]


@pytest.fixture
def hf_kernels(standin, monkeypatch):
    pytest.importorskip("transformers")
    from xattn.torch import ffpa_attention as fa
    from xattn.torch.hf import support

    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


@pytest.mark.parametrize("c", HF)
def test_hf_function(c, hf_kernels):
    run(c, hf_call, "cpu", _hf_reference)


# --- the FA4 helpers (xattn.torch.fa4) ---------------------------------------------------------------

def _fa4_ref(q, k, v, kw):
    """``flash_attn_func`` layout ``[B, N, H, D]``, bottom-right causal."""
    return _reference(q, k, v, {"causal": kw.get("causal", False), "softmax_scale": kw.get("softmax_scale")})


def _causal_fa4_ref(q, k, v, kw):
    out, lse = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=kw["scale"], causal=True)
    return out.transpose(1, 2), None


def flash_attn_call(q, k, v, **kw):
    from xattn.torch.fa4_interface import flash_attn_func

    return flash_attn_func(q, k, v, **kw)[0]


def causal_fa4_call(q, k, v, **kw):
    from xattn.torch.fa4 import causal_fa4_attention

    return causal_fa4_attention(q, k, v, **kw)


def _sdpa_layout(make, **extra):
    return _change(make, lambda q, k, v, kw, d: (tuple(t.transpose(1, 2).contiguous() for t in (q, k, v)),
                                                 {"scale": 0.05, **extra}))


FA4_FUNC = [
    case("fa4-func-empty-batch", _fa4(b=0)),
    case("fa4-func-zero-k-len", _fa4(nk=0)),
    case("fa4-func-head-dim-512", _fa4(d=512, causal=False), NotImplementedError, "FA4", "512"),
    case("fa4-func-scale-nan", _fa4(softmax_scale=math.nan), ValueError, "softmax_scale"),
    case("fa4-func-fp32", _fa4(dtype=torch.float32), TypeError, "q:", "float32"),
    case("fa4-func-gqa-ratio-not-dividing", _fa4(hkv=3), ValueError, "Hkv=3"),
]
CAUSAL_FA4 = [
    case("causal-fa4-empty-batch", _sdpa_layout(_fa4(b=0, nk=8))),
    case("causal-fa4-zero-len", _sdpa_layout(_fa4(nq=0, nk=0))),
    case("causal-fa4-q-k-len-differ", _sdpa_layout(_fa4())),  # FA4's bottom-right causal, as NeMo passes it
    case("causal-fa4-scale-nan", _sdpa_layout(_fa4(nk=8), scale=math.nan), ValueError, "scale: expected"),
    case("causal-fa4-head-dim-72", _sdpa_layout(_fa4(d=72, nk=8)), NotImplementedError, "72"),
    case("causal-fa4-rank-3", _change(_sdpa_layout(_fa4(nk=8)), lambda q, k, v, kw, d: ((q[0], k, v), kw)),
         ValueError, "query", "4 dims"),
]


@pytest.mark.parametrize("c", FA4_FUNC)
def test_fa4_flash_attn_func(c, standin):
    run(c, flash_attn_call, "cpu", _fa4_ref)


@pytest.mark.parametrize("c", CAUSAL_FA4)
def test_fa4_causal_helper(c, standin):
    run(c, causal_fa4_call, "cpu", _causal_fa4_ref)


def test_bad_inputs_launch_nothing(standin):
    """Refused calls never reach a launcher; empty or key-less calls launch nothing either."""
    for c in (p.values[0] for p in DENSE + VARLEN):
        checked_core.LAUNCHES.clear()
        args, kw = c.make("cpu")
        try:
            out = xt.attention_with_lse(*args, **kw)[0]
        except (TypeError, ValueError, NotImplementedError):
            assert checked_core.LAUNCHES == []
            continue
        if out.numel() == 0 or args[1].numel() == 0:
            assert checked_core.LAUNCHES == [], checked_core.LAUNCHES
