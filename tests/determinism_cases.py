"""The determinism GPU tests' shared table (torch and JAX): the alert text and the precompiled bf16 configs."""

import pytest

ALERT = r"xattn backward \(FA4 sm90 .* does not have a deterministic implementation"

# (head dim, GQA ratio, causal, window, varlen): the bf16 configs the GPU kit precompiles.
FFPA = [pytest.param(512, g, causal, (None, None), False, id=f"ffpa-d512-gqa{g}-{'causal' if causal else 'full'}")
        for g in (4, 8) for causal in (False, True)]
FA4 = [pytest.param(128, 4, True, (None, None), False, id="fa4-d128-gqa4-causal"),
       pytest.param(128, 4, True, (None, None), True, id="fa4-d128-gqa4-causal-varlen"),
       pytest.param(256, 2, False, (63, 0), False, id="fa4-d256-gqa2-window63")]
