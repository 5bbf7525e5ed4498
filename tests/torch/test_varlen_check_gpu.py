"""Checked varlen inputs on the GPU with the real kernels (FA4 forward, bf16, d 128/128, Hq 8 / Hkv 2
(GQA 4), causal, varlen; the config of test_fa4_helpers_gpu's varlen test): the unchecked call does not
synchronise, the checked call synchronises exactly once and gives the same bits, and a decreasing
cu_seqlens on the GPU is refused by name (one sync) with the CUDA context still usable afterwards."""

import warnings

import pytest
import torch

import xattn.torch as xt

pytestmark = pytest.mark.gpu


def _syncs(fn):
    """``(fn()'s result or the ValueError it raised, number of synchronising CUDA operations torch saw)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        except ValueError as exc:
            result = exc
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return result, sum("synchroniz" in str(w.message) for w in caught)


def test_checked_mode_one_sync_and_decreasing_cu_seqlens_refused():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(197, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(197, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 60, 67, 197], dtype=torch.int32, device="cuda")
    bad = torch.tensor([0, 67, 60, 197], dtype=torch.int32, device="cuda")
    kw = dict(causal=True, max_seqlen_q=130, max_seqlen_k=130, softmax_scale=0.08)

    def run(cu_q, check):
        return xt.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_q, check_inputs=check, **kw)

    run(cu, False)  # compile / load the launcher outside the measured calls
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising torch op raises
    try:
        unchecked = run(cu, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    checked, syncs = _syncs(lambda: run(cu, True))
    assert syncs == 1 and torch.equal(checked, unchecked)
    err, syncs = _syncs(lambda: run(bad, True))
    assert isinstance(err, ValueError) and syncs == 1
    assert "cu_seqlens_q[2] = 60 < cu_seqlens_q[1] = 67: must be non-decreasing" in str(err)
    torch.testing.assert_close(run(cu, False), unchecked, rtol=0, atol=0)  # the context is still healthy
