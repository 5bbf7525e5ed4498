"""Host cost of the torch front end per call, on any machine (issue #25): the core's kernel calls are
replaced by a no-op, so what is timed is xattn's own Python between the caller and the core (checks,
planning, allocation of out/lse), at a decode-sized call (B 1, H 8, N 128; HF: one query over 4096 keys).

The core itself (DLPack conversion, its checks, the launch) is not in these numbers: measure it on a GPU
with ``benchmarks/tools/host_overhead_probe.py``. Each row: the best of 7 loops of 2000 calls, no_grad.

    python benchmarks/tools/host_cost_cpu.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def us_per_call(fn, n: int = 2000, loops: int = 7) -> float:
    """Best µs per call of ``loops`` loops of ``n`` calls (nothing to wait for: the core is a no-op)."""
    from benchmarks.tools.host_cost import us_per_call as timed

    return timed(fn, lambda: None, n=n, loops=loops)


def rows() -> dict:
    import torch
    from transformers import masking_utils as mu

    import xattn.torch as xt
    from xattn.torch import ffpa_attention as fa, ops
    from xattn.torch.hf import support

    ops.LAUNCH["fwd"] = ops.LAUNCH["combine"] = ops.LAUNCH["slot_call"] = lambda *args, **kwargs: None  # split-KV, #43
    support.kernels_available = lambda: None

    class Layer(torch.nn.Module):
        is_causal = True

    layer, nk = Layer(), 4096
    q = torch.randn(1, 128, 8, 128, dtype=torch.bfloat16)
    q5 = torch.randn(1, 128, 8, 512, dtype=torch.bfloat16)
    hq = torch.randn(1, 32, 1, 512, dtype=torch.bfloat16)
    hk = torch.randn(1, 4, nk, 512, dtype=torch.bfloat16)
    sq = torch.randn(1, 32, 1, 256, dtype=torch.bfloat16)
    sk = torch.randn(1, 16, 1024, 256, dtype=torch.bfloat16)
    dq = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)  # decode steps: one query over 8k keys (split-KV)
    dk = torch.randn(1, 8192, 8, 128, dtype=torch.bfloat16)
    dq5 = torch.randn(1, 1, 32, 512, dtype=torch.bfloat16)
    dk5 = torch.randn(1, 8192, 4, 512, dtype=torch.bfloat16)
    pad = torch.ones(1, nk, dtype=torch.bool)
    window = mu.sliding_window_causal_mask_function(1024)
    full_mask = fa.ffpa_mask(1, 1, nk, q_offset=nk - 1, mask_function=mu.causal_mask_function, attention_mask=pad)
    sliding_mask = fa.ffpa_mask(1, 1, 1024, q_offset=nk - 1, kv_offset=nk - 1024, mask_function=window,
                                attention_mask=pad)
    cases = {
        "xattn.torch.attention d128 (FA4)": lambda: xt.attention(q, q, q, softmax_scale=0.1),
        "xattn.torch.attention d512 (FFPA)": lambda: xt.attention(q5, q5, q5, softmax_scale=0.1),
        "xattn.torch.attention d128 decode B1 8k (split-kv)": lambda: xt.attention(dq, dk, dk, causal=True),
        "xattn.torch.attention d512 decode B1 8k (split-kv)": lambda: xt.attention(dq5, dk5, dk5, causal=True),
        "HF ffpa_mask, full layer (dynamic cache)": lambda: fa.ffpa_mask(
            1, 1, nk, q_offset=nk - 1, mask_function=mu.causal_mask_function, attention_mask=pad),
        "HF ffpa_attention_forward, d512 decode": lambda: fa.ffpa_attention_forward(layer, hq, hk, hk, full_mask,
                                                                                    scaling=1.0),
        "HF ffpa_attention_forward, d256 sliding decode": lambda: fa.ffpa_attention_forward(
            layer, sq, sk, sk, sliding_mask, scaling=1.0),
    }
    with torch.no_grad():
        return {name: round(us_per_call(fn), 1) for name, fn in cases.items()}


def main():
    for name, us in rows().items():
        print(f"{us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
