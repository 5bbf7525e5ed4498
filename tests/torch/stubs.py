"""Test-only stand-ins for the core calls: the same destination-passing contract, computed by the
fp64 reference on any device. ``install(monkeypatch)`` swaps them into xattn.torch.ops."""

import dataclasses

import torch

from tests.reference import attention as ref_attention, attention_bwd as ref_bwd, varlen_attention as ref_varlen
from xattn.core.checks import check_window
from xattn.core.spec import canonical_mask, supports
from xattn.torch import ops

CALLS = []


def _spec(direction, family, q, k, v, causal, window_size, varlen):
    """``(spec, causal, window)`` as the core keys the call: the mask in its one canonical spelling (FA2's
    -1 read as unbounded; bad sides raise as in the core), a window refused where the core refuses it
    (FFPA has none). The stand-ins run any dtype and head dim (fp64, d16 in the CPU tests), so only
    what the window adds to the support check is judged here."""
    causal, left, right = canonical_mask(causal, *check_window(window_size))
    spec = ops._spec(direction, family, q, k, v, causal, -1 if left is None else left,
                     -1 if right is None else right, varlen)
    as_bf16 = dataclasses.replace(spec, dtype="bfloat16")
    reason = supports(as_bf16)
    if reason is not None and supports(dataclasses.replace(as_bf16, window_left=None, window_right=None)) is None:
        raise NotImplementedError(reason)
    return spec, causal, (left, right)


def _stub_fwd(family):
    def run(q, k, v, out, lse, *, softmax_scale, causal, window_size=(None, None), cu_seqlens_q=None,
            cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, stream=None, check_inputs=None):
        spec, causal, window_size = _spec("fwd", family, q, k, v, causal, window_size, cu_seqlens_q is not None)
        for name, value in spec.output_fill().items():  # the op applied the documented pre-fill
            assert torch.all(dict(out=out, lse=lse)[name] == value), name
        if cu_seqlens_q is None:
            o, l_ = ref_attention(q, k, v, scale=softmax_scale, causal=causal, window=window_size)
        else:
            o, l_ = ref_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=softmax_scale, causal=causal,
                                window=window_size)
        out.copy_(o)
        lse.copy_(l_)
        CALLS.append(("fwd", family))
    return run


def _stub_bwd(family):
    def run(dout, q, k, v, out, lse, dq, dk, dv, *, workspace, softmax_scale, causal, window_size=(None, None),
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, stream=None,
            check_inputs=None):
        _, causal, window_size = _spec("bwd", family, q, k, v, causal, window_size, cu_seqlens_q is not None)
        assert len(workspace) >= 2 and all(w.dtype == torch.float32 for w in workspace)
        if cu_seqlens_q is None:
            grads = ref_bwd(dout, q, k, v, out, lse, scale=softmax_scale, causal=causal, window=window_size)
        else:  # per segment, on [1, len, H, D] slices
            grads = [torch.zeros_like(t, dtype=torch.float64) for t in (q, k, v)]
            cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
            for s in range(len(cq) - 1):
                a, b, c, d = cq[s], cq[s + 1], ck[s], ck[s + 1]
                if b > a and d > c:
                    part = ref_bwd(dout[None, a:b], q[None, a:b], k[None, c:d], v[None, c:d], out[None, a:b],
                                   lse[None, :, a:b], scale=softmax_scale, causal=causal, window=window_size)
                    grads[0][a:b] += part[0][0]
                    grads[1][c:d] += part[1][0]
                    grads[2][c:d] += part[2][0]
        for dst, g in zip((dq, dk, dv), grads):
            dst.copy_(g)
        CALLS.append(("bwd", family))
    return run


def install(monkeypatch):
    for fam in ("ffpa", "fa4"):
        monkeypatch.setitem(ops._FWD, fam, _stub_fwd(fam))
        monkeypatch.setitem(ops._BWD, fam, _stub_bwd(fam))
    CALLS.clear()
