"""The core's bad-input battery on the GPU: the CPU tables (``test_bad_inputs.py``) against the real
launchers, where the hot path accepts what only the launcher's C-side checks refuse (out/lse/k/v
dtypes and shapes, alignment, int64 cu_seqlens) and the core must then name the argument, plus
what the CPU cannot build: buffers and cu_seqlens on the wrong device.

Kernel configs (precompiled on the GPU machine): FFPA bf16 d512 GQA 4 dense, FA4 bf16 d128 GQA 4
causal dense and varlen. Every case is followed by a good call."""

from __future__ import annotations

import pytest
import torch

from tests.battery import case, gpu_cases

from .test_bad_inputs import BWD, FWD, VARLEN, _bwd, _fwd, _set, _varlen, _change, run

pytestmark = pytest.mark.gpu

DEVICES = [
    case("k-on-cpu", _set(_fwd(), k=lambda b, d: b["k"].cpu()), ValueError, "k:", "CUDA"),
    case("out-on-cpu", _set(_fwd(), out=lambda b, d: b["out"].cpu()), ValueError, "out:", "CUDA"),
    case("lse-on-cpu", _set(_fwd(), lse=lambda b, d: b["lse"].cpu()), ValueError, "lse:", "CUDA"),
    case("q-on-cpu", _set(_fwd(), q=lambda b, d: b["q"].cpu()), ValueError, "q:", "CUDA"),
    case("varlen-cu-seqlens-q-on-cpu", _change(_varlen(), lambda b, kw, d: (
        b, {**kw, "cu_seqlens_q": kw["cu_seqlens_q"].cpu()})), ValueError, "cu_seqlens_q", "CUDA"),
    case("varlen-cu-seqlens-k-on-cpu", _change(_varlen(), lambda b, kw, d: (
        b, {**kw, "cu_seqlens_k": kw["cu_seqlens_k"].cpu()})), ValueError, "cu_seqlens_k", "CUDA"),
    case("bwd-dk-on-cpu", _set(_bwd(_fwd()), dk=lambda b, d: b["dk"].cpu()), ValueError, "dk:", "CUDA"),
    case("bwd-workspace-on-cpu", _change(_bwd(_fwd()), lambda b, kw, d: (
        b, {**kw, "workspace": [w.cpu() for w in kw["workspace"]]})), ValueError, "workspace[dpsum]", "CUDA"),
]


@pytest.mark.parametrize("c", gpu_cases(FWD + VARLEN + BWD) + gpu_cases(DEVICES))
def test_core_gpu(c):
    run(c, "cuda")
    torch.cuda.synchronize()  # a bad input must never have reached a kernel: the context is healthy
