"""The GPU HF tests' shared fixture: skip without the sm90 kernels on a GPU, clear "ffpa"'s fallback warnings."""

import pytest
import torch

from xattn.torch import ffpa_attention as fa
from xattn.torch.hf import support


@pytest.fixture(autouse=True)
def hf_gpu():
    if not torch.cuda.is_available() or support.kernels_available() is not None:
        pytest.skip(f"needs the sm90 kernels on a GPU: {support.kernels_available()}")
    fa._FALLBACK_WARNED.clear()
