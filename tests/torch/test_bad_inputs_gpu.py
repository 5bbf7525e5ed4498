"""The torch bad-input battery on the GPU: the CPU tables (``test_bad_inputs.py``) against the real kernels
(so the launcher's C-side refusals and the core's by-name diagnosis run), plus what the CPU cannot
build: q/k/v and cu_seqlens on different devices.

Kernel configs (precompiled on the GPU machine): FFPA bf16 d512 GQA 4 dense (causal or not), FA4 bf16
d128 GQA 4 causal dense and varlen, FA4 bf16 d256 GQA 2 window (63, 0). Each case is followed by a
good call, and the CUDA context must be healthy afterwards."""

from __future__ import annotations

import pytest
import torch

import xattn.torch as xt
from tests.battery import case, gpu_cases

from .test_bad_inputs import (CAUSAL_FA4, DENSE, FA4_FUNC, HF, VARLEN, _causal_fa4_ref, _change, _dense, _fa4_ref,
                              _hf_reference, _varlen, causal_fa4_call, flash_attn_call, hf_call, run)

pytestmark = pytest.mark.gpu

DEVICES = [
    case("k-on-cpu", _change(_dense(), lambda q, k, v, kw, d: ((q, k.cpu(), v), kw)), ValueError, "k:", "CUDA"),
    case("v-on-cpu", _change(_dense(), lambda q, k, v, kw, d: ((q, k, v.cpu()), kw)), ValueError, "v:", "CUDA"),
    case("varlen-cu-seqlens-on-cpu", _change(_varlen(), lambda q, k, v, kw, d: (
        (q, k, v), {**kw, "cu_seqlens_q": kw["cu_seqlens_q"].cpu(), "cu_seqlens_k": kw["cu_seqlens_k"].cpu()})),
        ValueError, "cu_seqlens_q", "CUDA"),
    case("varlen-cu-seqlens-k-on-cpu", _change(_varlen(), lambda q, k, v, kw, d: (
        (q, k, v), {**kw, "cu_seqlens_k": kw["cu_seqlens_k"].cpu()})), ValueError, "cu_seqlens_k", "CUDA"),
    case("varlen-cu-seqlens-int64-on-gpu", _varlen(cu_dtype=torch.int64), TypeError, "cu_seqlens_q", "int64"),
]


def _healthy():
    torch.cuda.synchronize()  # a bad input never reached a kernel: no sticky CUDA error


@pytest.mark.parametrize("c", gpu_cases(DENSE + VARLEN) + gpu_cases(DEVICES))
def test_attention_gpu(c):
    run(c, xt.attention_with_lse, "cuda")
    _healthy()


@pytest.mark.parametrize("c", gpu_cases(HF))
def test_hf_function_gpu(c):
    pytest.importorskip("transformers")
    run(c, hf_call, "cuda", _hf_reference)
    _healthy()


@pytest.mark.parametrize("c", gpu_cases(FA4_FUNC))
def test_fa4_flash_attn_func_gpu(c):
    run(c, flash_attn_call, "cuda", _fa4_ref)
    _healthy()


@pytest.mark.parametrize("c", gpu_cases(CAUSAL_FA4))
def test_fa4_causal_helper_gpu(c):
    run(c, causal_fa4_call, "cuda", _causal_fa4_ref)
    _healthy()
