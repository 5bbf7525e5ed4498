"""quack GEMM epilogues of the chunked-GEMM backward (:mod:`xattn.core.gemm_bwd_plan`).

Each is a quack ``@gemm_epilogue`` function over the fp32 accumulator, fused into a quack sm90
GEMM: no elementwise pass over the scores ever touches global memory on its own. They are
module globals so quack's compile cache keys them by import path across processes.

- :data:`probs_causal` / :data:`probs_full`: ``acc = Q Kᵀ`` of a block ->
  ``P = exp2(acc · scale_log2 + rowbias)`` with ``rowbias = −lse·log2e`` per row (``−inf`` for
  padded rows and rows that saw no key, so P is 0 there, never NaN); the causal one subtracts
  ``2^100 · relu(colpos − rowpos)`` from the exponent (query/key positions as fp32 vectors),
  which sends every masked entry to exactly 0. Writes D (q's dtype, the dV GEMM's operand) and
  ``p_fine``, the copy dS is formed from: fp16 by default (11 significant bits where bf16 has 8;
  :class:`xattn.core.gemm_sm90.GemmSpec` ``p_dtype``), the output tensor's dtype decides.
- :data:`grad_scores`: ``acc = dO Vᵀ`` -> ``dS = (acc − δ) · p_fine · scale`` (D, q's dtype).

Importing this module imports quack (which imports torch); :mod:`xattn.core` does so lazily.
"""

from __future__ import annotations

from quack.activation import relu
from quack.epilogue.frontend import gemm_epilogue
from quack.epilogue.math import pexp2
from quack.epilogue.ops import ColVecLoad, RowVecLoad, Scalar, TileLoad

__all__ = ["probs_causal", "probs_full", "grad_scores", "MASK_PENALTY"]

MASK_PENALTY = 2.0 ** 100  # times relu(key pos - query pos) >= 1 on masked entries: exp2 -> 0


@gemm_epilogue(outputs=("p_fine",), ops={"rowbias": ColVecLoad("rowbias"), "rowpos": ColVecLoad("rowpos"),
                                      "colpos": RowVecLoad("colpos"), "scale_log2": Scalar("scale_log2")})
def probs_causal(acc, rowbias, rowpos, colpos, scale_log2):
    p = pexp2(acc * scale_log2 + rowbias - relu(colpos - rowpos) * MASK_PENALTY)
    return {"D": p, "p_fine": p}


@gemm_epilogue(outputs=("p_fine",), ops={"rowbias": ColVecLoad("rowbias"), "scale_log2": Scalar("scale_log2")})
def probs_full(acc, rowbias, scale_log2):
    p = pexp2(acc * scale_log2 + rowbias)
    return {"D": p, "p_fine": p}


@gemm_epilogue(ops={"p_fine": TileLoad("p_fine"), "delta": ColVecLoad("delta"), "scale": Scalar("scale")})
def grad_scores(acc, p_fine, delta, scale):
    return {"D": (acc - delta) * p_fine * scale}
