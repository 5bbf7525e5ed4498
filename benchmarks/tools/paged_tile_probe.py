"""FA4 paged forward against fp64 where the key tile and the page size do or do not nest (GPU machine).

d96 non-causal runs FA4's sm90 forward with a 144-row key tile; the contract fuzz found a wrong paged result there
(session 18), and this probe (session 19, H100) found it wrong at pages of 16 and 128 alike (errors 0.13-0.64),
with the causal config's 128-row tile right (1e-4): xattn.core.paged_sm90 now builds that kernel with 128 rows.
Random pools of shuffled pages, three sequences of 1066 keys; prints the max error against fp64 per case.

    python benchmarks/tools/paged_tile_probe.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import xattn.torch as xt  # noqa: E402
from xattn.core.fa4_sm90 import _tile_size_fwd_sm90  # noqa: E402


def case(d: int, causal: bool, ps: int, nq: int, splits: int, b: int = 3, nk: int = 1066, hq: int = 8, hkv: int = 4):
    g = torch.Generator(device="cuda").manual_seed(d + ps + nq)
    per = -(-nk // ps)
    pages = b * per + 3
    kp = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.float16, generator=g)
    vp = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.float16, generator=g)
    table = torch.randperm(pages, device="cuda", generator=g)[:b * per].view(b, per).to(torch.int32)
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.float16, generator=g)
    lengths = torch.full((b,), nk, dtype=torch.int32, device="cuda")
    out = xt.paged_attention(q, kp, vp, table, lengths, causal=causal, num_splits=splits)
    k = kp[table.long()].flatten(1, 2)[:, :nk].double()
    v = vp[table.long()].flatten(1, 2)[:, :nk].double()
    k, v = k.repeat_interleave(hq // hkv, 2), v.repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * d ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device="cuda").triu(nk - nq + 1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    tile = _tile_size_fwd_sm90(d, d, causal, False).n_block_size  # flash_attn's own (xattn's paged d96: 128)
    err = (out.double() - want).abs().amax(dim=(1, 2, 3)).tolist()
    print(f"d{d} causal={causal} page={ps} tile_n={tile} nq={nq} num_splits={splits}: max err per sequence "
          f"{[round(e, 4) for e in err]}", flush=True)


for args in [(96, True, 128, 3, 0), (96, True, 128, 3, 1), (96, True, 128, 1, 1), (96, False, 128, 1, 1),
             (96, False, 128, 3, 0), (96, False, 128, 1, 0), (96, True, 128, 2, 0), (96, False, 16, 1, 1)]:
    try:
        case(*args)
    except Exception as exc:  # a case says why, the probe goes on
        print(args, f"error: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
