"""Validation errors of the core API: every bad input is refused before any launch, by name.

CPU torch tensors serve as DLPack producers; no kernel is compiled or launched here."""

import math
import re

import pytest
import torch

import xattn.core as xc
from xattn.core.checks import check_workspace

BF16 = torch.bfloat16


def dense(B=2, N=64, M=64, H=8, HK=2, D=512, DV=None, dtype=BF16):
    DV = DV or D
    q = torch.randn(B, N, H, D, dtype=dtype)
    k = torch.randn(B, M, HK, D, dtype=dtype)
    v = torch.randn(B, M, HK, DV, dtype=dtype)
    return dict(q=q, k=k, v=v, out=torch.empty(B, N, H, DV, dtype=dtype), lse=torch.empty(B, H, N))


def varlen(T=96, TK=80, H=8, HK=2, D=512, B=3):
    return dict(q=torch.randn(T, H, D, dtype=BF16), k=torch.randn(TK, HK, D, dtype=BF16),
                v=torch.randn(TK, HK, D, dtype=BF16), out=torch.empty(T, H, D, dtype=BF16),
                lse=torch.empty(H, T)), dict(cu_seqlens_q=torch.tensor([0, 40, 40, T], dtype=torch.int32)[: B + 1],
                                            cu_seqlens_k=torch.tensor([0, 30, 50, TK], dtype=torch.int32)[: B + 1],
                                            max_seqlen_q=56, max_seqlen_k=30)


def fwd(bufs, fn=xc.ffpa_fwd, **kw):
    kw.setdefault("softmax_scale", 0.05)
    fn(bufs["q"], bufs["k"], bufs["v"], bufs["out"], bufs["lse"], **kw)


def raises(exc, *words):
    """pytest.raises that also requires every word in the message (any order)."""
    return pytest.raises(exc, match="".join(rf"(?=[\s\S]*{re.escape(w)})" for w in words))


def test_valid_call_on_cpu_says_no_gpu():
    with raises(ValueError, "q: expected a CUDA tensor", "cpu"):
        fwd(dense())


def test_not_a_tensor():
    b = dense()
    b["k"] = [[1.0]]
    with raises(TypeError, "k: expected a DLPack tensor", "list"):
        fwd(b)


def test_jax_array_refused_as_output():
    jnp = pytest.importorskip("jax.numpy")
    b = dense(B=1, N=8, M=8, H=1, HK=1)
    b["out"] = jnp.zeros((1, 8, 1, 512), dtype=jnp.bfloat16)
    with raises(TypeError, "out: JAX arrays are immutable", "xattn.jax"):
        fwd(b)


@pytest.mark.parametrize("name, value, exc, words", [
    pytest.param("q", torch.randn(2, 64, 8, 512), TypeError, ["q: expected dtype float16 or bfloat16", "float32"],
                 id="q-fp32"),
    pytest.param("k", torch.randn(2, 64, 2, 512, dtype=torch.float16), TypeError,
                 ["k: expected dtype bfloat16", "float16"], id="k-fp16"),
    pytest.param("lse", torch.empty(2, 8, 64, dtype=BF16), TypeError, ["lse: expected dtype float32"], id="lse-bf16"),
    pytest.param("q", torch.randn(64, 8, 512, dtype=BF16), ValueError, ["q: expected rank 4", "[B, N, H, D]"],
                 id="q-rank"),
    pytest.param("k", torch.randn(3, 64, 2, 512, dtype=BF16), ValueError, ["k: expected batch 2"], id="k-batch"),
    pytest.param("k", torch.randn(2, 64, 3, 512, dtype=BF16), ValueError, ["Hkv=3 must divide Hq=8"], id="gqa"),
    pytest.param("v", torch.randn(2, 64, 2, 384, dtype=BF16), NotImplementedError, ["equal", "512 and 384"],
                 id="v-dim"),
    pytest.param("v", torch.randn(2, 63, 2, 512, dtype=BF16), ValueError,
                 ["v: expected shape (2, 64, 2, 512)", "[B, N, Hkv, Dv]"], id="v-len"),
    pytest.param("out", torch.empty(2, 64, 8, 256, dtype=BF16), ValueError, ["out: expected shape (2, 64, 8, 512)"],
                 id="out-shape"),
    pytest.param("lse", torch.empty(2, 64, 8), ValueError, ["lse: expected shape (2, 8, 64)", "[B, Hq, Nq]"],
                 id="lse-shape"),
    pytest.param("q", torch.randn(2, 64, 8, 1024, dtype=BF16)[..., ::2], ValueError, ["q: needs unit stride"],
                 id="q-stride"),
    pytest.param("q", torch.randn(2 * 64 * 8 * 512 + 1, dtype=BF16)[1:].view(2, 64, 8, 512), ValueError,
                 ["q: data pointer must be 16-byte aligned"], id="q-misaligned"),
])
def test_bad_buffer(name, value, exc, words):
    b = dense()
    b[name] = value
    with raises(exc, *words):
        fwd(b)


def test_unsupported_head_dim_names_range():
    with raises(NotImplementedError, "FFPA supports head_dim 320-512", "256"):
        fwd(dense(D=256))
    with raises(NotImplementedError, "FA4 on sm90 supports", "512/512"):
        fwd(dense(), fn=xc.fa4_fwd)


def test_sdpa_layout_view_is_accepted_up_to_the_device_check():
    b = dense()
    b["q"] = torch.randn(2, 8, 64, 512, dtype=BF16).transpose(1, 2)  # [B,H,N,D] storage seen as [B,N,H,D]
    with raises(ValueError, "expected a CUDA tensor"):
        fwd(b)


@pytest.mark.parametrize("scale, exc", [(None, TypeError), (math.nan, ValueError), (-1.0, ValueError),
                                        (True, TypeError), ("0.1", TypeError)])
def test_bad_softmax_scale(scale, exc):
    with raises(exc, "softmax_scale"):
        xc.checks.check_scale(scale)


def test_one_scale_check_for_every_front_end():
    """The core's check under each ecosystem's name: None -> 1/sqrt(D) where a head dim is given,
    NumPy scalars are numbers, torch's front end also takes what float() takes."""
    import numpy as np

    assert xc.checks.check_scale(None, head_dim=64) == 0.125
    assert xc.checks.check_scale(np.float32(0.5)) == 0.5
    with raises(ValueError, "scale: expected a finite positive float"):
        xc.checks.check_scale(0.0, name="scale")
    with raises(TypeError, "scale: expected a Python float, got list"):
        xc.checks.check_scale([0.5], name="scale")
    import torch

    assert xc.checks.check_scale(torch.tensor(0.25), convert=True) == 0.25
    with raises(TypeError, "softmax_scale"):
        xc.checks.check_scale(torch.tensor(0.25))


def test_bad_causal_and_stream():
    with raises(TypeError, "causal: expected a bool"):
        fwd(dense(), causal=1)
    with raises(TypeError, "stream: expected None or an int"):
        fwd(dense(), stream="s")


def test_varlen_checks():
    b, cu = varlen()
    with raises(ValueError, "q: expected a CUDA tensor"):
        fwd(b, **cu)
    with raises(ValueError, "give both"):
        fwd(b, cu_seqlens_q=cu["cu_seqlens_q"])
    with raises(ValueError, "max_seqlen_q: required"):
        fwd(b, **{**cu, "max_seqlen_q": None})
    with raises(ValueError, "max_seqlen_k: expected a non-negative int"):
        fwd(b, **{**cu, "max_seqlen_k": -3})
    with raises(TypeError, "cu_seqlens_k: expected dtype int32", "int64"):
        fwd(b, **{**cu, "cu_seqlens_k": cu["cu_seqlens_k"].long()})
    with raises(ValueError, "cu_seqlens_k: expected shape (4,)"):
        fwd(b, **{**cu, "cu_seqlens_k": cu["cu_seqlens_k"][:3]})
    with raises(ValueError, "q: expected rank 3", "varlen"):
        fwd(dense(), **cu)
    with raises(ValueError, "lse: expected shape (8, 96)", "[Hq, Tq]"):
        fwd({**b, "lse": torch.empty(1, 8, 96)}, **cu)


def test_backward_checks():
    b = dense()
    grads = dict(dq=torch.empty_like(b["q"]), dk=torch.empty_like(b["k"]), dv=torch.empty(2, 64, 2, 256, dtype=BF16))
    with raises(ValueError, "dv: expected shape (2, 64, 2, 512)"):
        xc.ffpa_bwd(b["out"], b["q"], b["k"], b["v"], b["out"], b["lse"], grads["dq"], grads["dk"], grads["dv"],
                    softmax_scale=0.1, workspace=[])


def test_workspace_layout_and_checks():
    lay = xc.bwd_workspace("ffpa", (2, 100, 8, 512), (2, 90, 2, 512))
    assert lay == [("dpsum", (2, 8, 128), "float32", None), ("lse_log2", (2, 8, 128), "float32", None)]
    lay_v = xc.bwd_workspace("ffpa", (300, 8, 512), (200, 2, 512), num_seqs=3)
    assert lay_v[0][1] == (8, (300 + 4 * 64 - 1) // 64 * 64)
    with raises(ValueError, "workspace: required", "bwd_workspace"):
        check_workspace(None, lay, 0)
    with raises(ValueError, "workspace: expected 2 buffers"):
        check_workspace([torch.empty(2, 8, 128)], lay, 0)
    with raises(ValueError, "workspace[lse_log2]: expected shape (2, 8, 128)"):
        check_workspace([torch.empty(2, 8, 128), torch.empty(2, 8, 100)], lay, 0)
    with raises(ValueError, "workspace[dpsum]: expected a CUDA tensor"):
        check_workspace([torch.empty(2, 8, 128), torch.empty(2, 8, 128)], lay, 0)
    with raises(ValueError, "num_seqs"):
        xc.bwd_workspace("ffpa", (300, 8, 512), (300, 8, 512))
    with raises(NotImplementedError, "320-512"):
        xc.bwd_workspace("ffpa", (2, 100, 8, 128), (2, 90, 2, 128))


@pytest.mark.parametrize("causal, tile_m", [(False, 80), (True, 64)])
def test_fa4_workspace_follows_its_tiles(causal, tile_m):
    """d128 tiles: 80x128 non-causal, 64x128 causal; GQA adds zero-filled dK/dV accumulators."""
    lay = {n: (shape, fill) for n, shape, _, fill in
           xc.bwd_workspace("fa4", (2, 100, 8, 128), (2, 300, 2, 128), causal=causal)}
    rows = -(-100 // tile_m) * tile_m
    assert lay["dq_accum"] == ((2, 8, rows * 128), None)
    assert lay["dpsum"] == ((2, 8, rows), None) == lay["lse_log2"]
    assert lay["dk_accum"] == ((2, 2, 384 * 128), 0.0) == lay["dv_accum"]
    mha = xc.bwd_workspace("fa4", (2, 100, 8, 128), (2, 300, 8, 128), causal=causal)
    assert [n for n, *_ in mha] == ["dq_accum", "dpsum", "lse_log2"]


def test_empty_key_set_is_refused():
    with raises(ValueError, "k: no keys at all"):
        fwd(dense(M=0))
