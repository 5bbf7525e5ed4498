"""The hot-path check (quick_check) never accepts what the full validation refuses, and agrees
with it on the compile key and sizes when both accept. CPU tensors stand in for CUDA ones."""

import pytest
import torch

from xattn.core import checks

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def cpu_counts_as_cuda(monkeypatch):
    monkeypatch.setattr(checks, "_KDLCUDA", 1)


def _dense(B=2, N=64, M=80, H=8, HK=2, D=128, DV=None, dtype=BF16):
    DV = DV or D
    return dict(q=torch.randn(B, N, H, D, dtype=dtype), k=torch.randn(B, M, HK, D, dtype=dtype),
                v=torch.randn(B, M, HK, DV, dtype=dtype), out=torch.empty(B, N, H, DV, dtype=dtype),
                lse=torch.empty(B, H, N))


CU = dict(cu_seqlens_q=torch.tensor([0, 5, 5, 30], dtype=torch.int32),
          cu_seqlens_k=torch.tensor([0, 7, 9, 40], dtype=torch.int32), max_seqlen_q=25, max_seqlen_k=31)


def _varlen():
    return dict(q=torch.randn(30, 8, 128, dtype=BF16), k=torch.randn(40, 2, 128, dtype=BF16),
                v=torch.randn(40, 2, 128, dtype=BF16), out=torch.empty(30, 8, 128, dtype=BF16),
                lse=torch.empty(8, 30))


# (family, buffers, options, left to the launcher's C entry): per-buffer facts such as
# out's dtype or lse's shape are not read on the hot path; the compiled TVM-FFI entry refuses
# them before any launch (GPU tests prove it) and the full check then names them.
CASES = [
    pytest.param("fa4", _dense(), {}, False, id="fa4-dense"),
    pytest.param("fa4", _dense(D=192, DV=128), {}, False, id="fa4-192-128"),
    pytest.param("ffpa", _dense(D=512), dict(causal=True), False, id="ffpa-causal"),
    pytest.param("fa4", _varlen(), CU, False, id="fa4-varlen"),
    pytest.param("fa4", _dense(dtype=torch.float32), {}, False, id="fp32"),
    pytest.param("fa4", _dense(HK=3), {}, False, id="gqa-bad"),
    pytest.param("fa4", _dense(D=512), {}, False, id="fa4-d512"),
    pytest.param("ffpa", _dense(D=128), {}, False, id="ffpa-d128"),
    pytest.param("fa4", {**_dense(), "k": torch.randn(3, 80, 2, 128, dtype=BF16)}, {}, False, id="k-batch"),
    pytest.param("fa4", _dense(M=0), {}, False, id="no-keys"),
    pytest.param("fa4", _varlen(), {**CU, "max_seqlen_q": None}, False, id="varlen-no-max"),
    pytest.param("fa4", _varlen(), {k: v for k, v in CU.items() if k != "cu_seqlens_k"}, False, id="varlen-one-cu"),
    pytest.param("fa4", _dense(), dict(causal=1), False, id="causal-int"),
    pytest.param("fa4", {**_dense(), "lse": torch.empty(2, 64, 8)}, {}, True, id="lse-shape"),
    pytest.param("fa4", {**_dense(), "out": torch.empty(2, 64, 8, 128, dtype=torch.float16)}, {}, True, id="out-dtype"),
]


@pytest.mark.parametrize("family, bufs, kw, c_checked", CASES)
def test_quick_is_a_subset_of_full(family, bufs, kw, c_checked):
    args = dict(causal=False, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                window=(None, None))
    args.update(kw)
    quick = checks.quick_check(family, "fwd", bufs, *args.values())
    try:
        spec, problem, _ = checks.check_attention(family, "fwd", bufs, *args.values())
        full = (spec, problem)
    except (TypeError, ValueError, NotImplementedError):
        full = None
    if c_checked:
        assert quick is not None and full is None
    elif full is None:
        assert quick is None
    else:
        assert quick == full


def test_memo_hits_and_misses_by_metadata():
    args = (False, None, None, None, None, (None, None))
    a = checks.quick_check("fa4", "fwd", _dense(), *args)
    b = checks.quick_check("fa4", "fwd", _dense(), *args)  # new tensors, same metadata: memo hit
    assert a is b
    c = checks.quick_check("fa4", "fwd", _dense(M=96), *args)  # other key length: recomputed
    assert c is not None and c[1].seqlen_k == 96 and c[0] == a[0]
    assert checks.quick_check("fa4", "fwd", _dense(HK=3), *args) is None  # refusals are not memoised as hits
    d = checks.quick_check("fa4", "fwd", _dense(dtype=torch.float16), *args)
    assert d[0].dtype == "float16"
