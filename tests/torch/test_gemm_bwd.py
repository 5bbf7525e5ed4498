"""The torch driver of the chunked-GEMM backward on the CPU, with fp32 reference GEMMs in place of
quack's: the block logic (row stacking, padding, causal limits, accumulation) vs fp64."""

import pytest
import torch

from tests.reference import attention, attention_bwd
from xattn.torch import gemm_bwd as gb


@pytest.mark.parametrize("b, nq, nk, hq, hkv, causal, rows", [
    (2, 200, 200, 4, 2, True, 64),    # several blocks, GQA 2
    (1, 130, 190, 6, 2, True, 64),    # Nq < Nk, padded last block
    (1, 190, 130, 3, 3, True, 64),    # Nq > Nk: rows before the first key
    (2, 150, 170, 8, 1, False, 64),   # GQA 8, not causal
    (1, 300, 40, 2, 1, True, 64),     # whole blocks without keys
    (1, 77, 77, 4, 4, True, None),    # one block from the budget
])
def test_block_logic_vs_fp64(b, nq, nk, hq, hkv, causal, rows):
    g = torch.Generator().manual_seed(nq * 7 + nk)
    d = 32
    q, dout = (torch.randn(b, nq, hq, d, generator=g) for _ in range(2))
    k, v = (torch.randn(b, nk, hkv, d, generator=g) for _ in range(2))
    scale = d ** -0.5
    out, lse = attention(q, k, v, scale=scale, causal=causal)
    want = attention_bwd(dout, q, k, v, out, lse, scale=scale, causal=causal)
    got = gb.gemm_backward(dout, q, k, v, out.float(), lse.float(), softmax_scale=scale, causal=causal,
                           gemms=gb.TorchGemms(), rows=rows)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        assert x.shape == r.shape and x.is_contiguous(), name
        assert (x.double() - r).abs().max() < 1e-4, name


def test_row_blocks_round_trip():
    x = torch.randn(2, 150, 6, 8)
    xp = gb._rows_to_blocks(x, 2, 64, 192)
    assert xp.shape == (4, 3, 3 * 64, 8)
    x6 = xp.view(2, 2, 3, 64, 3, 8)  # [B, Hkv, block, row, head in group, D]
    assert x6[:, :, 2, 150 - 128:].abs().sum() == 0  # padded rows are zero
    assert torch.equal(x6[1, 1, 0, 5, 2], x[1, 5, 1 * 3 + 2])  # row 5 of head 5 = kv head 1, 3rd of its group
    back = torch.empty_like(x)
    gb._blocks_to_rows(xp, back, 64)
    assert torch.equal(back, x)


@pytest.mark.parametrize("g", [1, 4])
def test_row_vectors_are_row_contiguous_without_padding(g):
    """delta arrives transposed ([B, Hq, N] view of [B, N, Hq]); with no padding to copy it and
    g == 1 a reshape would keep its strides, which quack's TMA refuses (a stride-1 batch mode)."""
    x = torch.randn(1, 128, 2 * g).transpose(1, 2)
    xp = gb._vec_to_blocks(x, 2, 64, 128, 0.0)
    assert xp.shape == (2, 2, g * 64) and xp.is_contiguous()
    assert torch.equal(xp.view(1, 2, 2, 64, g).permute(0, 1, 4, 2, 3).reshape(1, 2 * g, 128), x)
