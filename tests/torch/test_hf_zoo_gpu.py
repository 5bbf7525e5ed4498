"""attn_implementation="ffpa" across HF model families on the GPU with the real kernels (bf16): the
same cases as test_hf_zoo.py (tests/torch/hf_zoo.py), each vs fp32 "sdpa"/"eager" of the same
weights, with the route asserted. ``pytest -s`` prints the table."""

import pytest
import torch

pytest.importorskip("transformers")

from . import hf_zoo  # noqa: E402

pytestmark = pytest.mark.gpu
ROWS = []


@pytest.fixture(scope="module", autouse=True)
def _table():
    yield
    if ROWS:
        print("\nffpa vs fp32 reference, bf16, CUDA kernels\n" + hf_zoo.table(ROWS))


@pytest.mark.parametrize("case", hf_zoo.pytest_params())
def test_zoo_case_gpu(case):
    row = hf_zoo.compare(case, "cuda", torch.bfloat16)
    ROWS.append(row)
    hf_zoo.assert_case(case, row)
