"""attn_implementation="ffpa" across HF model families on the CPU (kernels = the fp64 stand-in, bf16
inputs): the route each pattern takes (kernels or a named exact fallback) and parity with fp32
"sdpa"/"eager" of the same weights (tests/torch/hf_zoo.py). ``pytest -s`` prints the table."""

import pytest
import torch

pytest.importorskip("transformers")

from xattn.torch.hf import support  # noqa: E402

from . import hf_zoo, stubs  # noqa: E402

ROWS = []


@pytest.fixture(scope="module", autouse=True)
def _table():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: threads only add contention
    yield
    torch.set_num_threads(threads)
    if ROWS:
        print("\nffpa vs fp32 reference, bf16, CPU stand-in kernels\n" + hf_zoo.table(ROWS))


@pytest.mark.parametrize("case", hf_zoo.pytest_params())
def test_zoo_case(case, monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    row = hf_zoo.compare(case, "cpu", torch.bfloat16)
    ROWS.append(row)
    # every launch reached the (stand-in) kernels; a training step's backward runs on the same families
    assert [c for c in stubs.CALLS if c[0] == "fwd"] == [("fwd", f) for f, _ in row.calls]
    backward = {f for d, f in stubs.CALLS if d == "bwd"}
    assert backward == ({f for f, _ in row.calls} if case.grad else set()), stubs.CALLS
    hf_zoo.assert_case(case, row)
