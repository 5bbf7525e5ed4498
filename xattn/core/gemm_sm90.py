"""Fixed-signature launchers of the chunked-GEMM backward's GEMMs (quack sm90), for DLPack callers.

:mod:`xattn.torch` (torch views through TVM-FFI) and :mod:`xattn.jax` (XLA FFI targets) both
call these; so can DLPack users. They need functions with a flat, fixed signature, which this
module compiles from quack's kernel classes and the epilogues of
:mod:`xattn.core.gemm_bwd_epilogues`. Each launcher is one batched GEMM ``D[l] = A[l] @ B[l]ᵀ``
(+ its epilogue) with the shapes of one step of :mod:`xattn.core.gemm_bwd`:

================  ===========================================  ============================================
kind              parameters (inputs, then outputs)            computes
================  ===========================================  ============================================
``probs_causal``  A, B, rowbias, rowpos, colpos -> D, pf       ``S = A B[:, :N]ᵀ``; D = pf = P (masked)
``probs_full``    A, B, rowbias -> D, pf                       the same without the mask
``grad_scores``   A, B, pf, delta -> D                         ``D = (A B[:, :N]ᵀ − δ) ⊙ pf · scale``
``acc``           X, Y, C -> D                                 ``D[:, :M] = Xᵀ Y + C[:, :M]`` (C fp32; its rows
                                                               from ``c_rows`` on are read as 0)
``mm_dq``         X, Y -> D                                    ``D = X Y[:, :K]``
``mm_kv``         X, Y -> D                                    ``D[:, :M] = Xᵀ Y``
``seg_*``         the packed route's four (:mod:`xattn.core.gemm_segments_sm90`, compiled there)
================  ===========================================  ============================================

All tensors are batched over a leading L and cross in their natural row-major form (last dim
contiguous, 16-byte aligned rows): A ``(L, M, K)``, B ``(L, Nb, K)``, X ``(L, K, M)`` or
``(L, M, K)`` (``mm_dq``), Y ``(L, K, N)`` (``mm_dq``: ``(L, Kb, N)``), D/pf ``(L, M, N)``,
row vectors ``(L, M)``, colpos ``(L, Nb)``; ``acc``'s C and D and ``mm_kv``'s D are ``(L, Mc, N)``.
The extents come from the block's own buffers (N from D, M from X, K from X), and the
key-length operands (B, colpos, ``mm_dq``'s Y, ``acc``'s C/D, ``mm_kv``'s D) may be longer (``Nb, Kb, Mc >=``
the extent; the launcher does not check that, a shorter one is read past its end, so callers go
through the drivers :mod:`xattn.torch.gemm_bwd` / :mod:`xattn.jax.gemm_bwd` or keep to it): the launcher reads their first rows in place, so a caller passes whole K/V and
whole fp32 accumulators instead of copying prefixes out for every block (XLA would). ``acc``
writes only D's first M rows, so C and D may be one buffer (JAX aliases them); it reads only C's
first ``c_rows`` (``1 <= c_rows <= M``; TMA fills the rest with zeros), so a causal block's new key
rows need no zeroed accumulator (and ``mm_kv`` with ``d32`` starts one). After the tensors
come the scalar (``scale_log2`` / ``scale``, fp32; ``acc``: ``c_rows``, Int32; none for the others) and
``max_active_clusters`` (Int32, :func:`max_active_clusters`); they run on the TVM-FFI
environment stream. D is 16-bit (q's dtype) except for ``acc`` / ``mm_kv`` with ``d32``; pf, the copy of P that
dS is formed from, is ``GemmSpec.p_dtype`` (fp16 by default: the score traffic was the P and dS
GEMMs' limit, and fp16 keeps 11 significant bits of P where the bf16 D keeps 8).
Compile key: :class:`GemmSpec`; tile 128x192 (128x128 for the N = head-dim kinds), cluster 2x1,
pingpong, static persistent schedule.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from .spec import library_versions
from .symbolic import CUTE_DTYPES, compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .gemm_sm90_common import CLUSTER_MNK, epilogue_class, scheduler_options  # noqa: E402

__all__ = ["GemmSpec", "KINDS", "P_KINDS", "P_DTYPES", "D32_KINDS", "compile_gemm", "max_active_clusters",
           "source_digest"]

# the dense route's kinds, then the packed route's (xattn.core.gemm_segments_sm90)
KINDS = ("probs_causal", "probs_full", "grad_scores", "acc", "mm_dq", "mm_kv",
         "seg_probs", "seg_grad_scores", "seg_mm_dq", "seg_acc")
TILE_MN = (128, 192)
# The GEMMs whose N is the head dim (dK/dV, dq): 512 on 192-wide tiles computes 576 columns. H200, torch
# backward TFLOP/s, default -> (128, 128) (benchmarks/tools/diag_pieces_probe.py,
# results/logs/diag_tiles_probe_h200.log): Hq16/Hkv16 causal 8k 375.7 -> 377.5, 16k 392.7 -> 409.4;
# Hq32/Hkv4 causal 8k 379.9 -> 390.1, 16k 429.1 -> 440.9 ((64, 256) and (128, 256) were slower).
KIND_TILES = {"acc": (128, 128), "mm_dq": (128, 128), "mm_kv": (128, 128), "seg_mm_dq": (128, 128),
              "seg_acc": (128, 128)}
P_KINDS = ("probs_causal", "probs_full", "grad_scores")  # the kinds that write or read pf
D32_KINDS = ("acc", "mm_kv")  # the kinds that may write an fp32 accumulator (d32)
# pf's dtype: dS = (dP − δ) ⊙ pf is rounded to 16 bits anyway, so fp16's 2^-11 relative error adds
# little to it (bf16's 2^-8 took the gradient error vs fp64 to 1.86x FFPA's); fp32 is kept for A/Bs.
P_DTYPES = ("float16", "float32")


@functools.cache
def source_digest() -> str:
    """Digest of the sources that shape these launchers (this file, the shared pieces, the epilogues, the
    packed route's)."""
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for name in ("gemm_sm90.py", "gemm_sm90_common.py", "gemm_bwd_epilogues.py", "gemm_segments_sm90.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class GemmSpec:
    """Compile key of one GEMM launcher: ``kind`` (:data:`KINDS`), 16-bit ``dtype`` of A/B,
    ``d32`` (``acc`` / ``mm_kv`` only: D in fp32, an accumulator; else D in ``dtype``), ``tile`` (M, N)
    (default: the kind's, :data:`KIND_TILES` or :data:`TILE_MN`; pingpong up to :data:`TILE_MN`'s
    area, cooperative above), ``p_dtype`` (:data:`P_KINDS` only: pf's dtype, :data:`P_DTYPES`).
    Goes through the same launcher and disk caches as :class:`~xattn.core.spec.KernelSpec`."""

    kind: str
    dtype: str
    d32: bool = False
    tile: tuple[int, int] | None = None  # None: the kind's (KIND_TILES, else TILE_MN)
    p_dtype: str = P_DTYPES[0]
    arch: str = "sm_90a"
    source: str = field(default_factory=source_digest)
    versions: tuple[tuple[str, str], ...] = field(default_factory=library_versions)

    def __post_init__(self):
        if self.tile is None:
            object.__setattr__(self, "tile", KIND_TILES.get(self.kind, TILE_MN))
        object.__setattr__(self, "tile", tuple(self.tile))
        if self.p_dtype not in P_DTYPES:
            raise ValueError(f"p_dtype={self.p_dtype!r}: expected one of {P_DTYPES}")
        if self.p_dtype != P_DTYPES[0] and self.kind not in P_KINDS:
            raise ValueError(f"p_dtype is for the {P_KINDS} launchers, not {self.kind!r}")

    def short_name(self) -> str:
        # "ffpa_bwd_" prefix: the disk cache's own-file pattern, so `cache clear` removes these too
        tile = "" if self.tile == KIND_TILES.get(self.kind, TILE_MN) else f"_t{self.tile[0]}x{self.tile[1]}"
        pf = "" if self.p_dtype == P_DTYPES[0] else "_p32"
        return f"ffpa_bwd_gemm_{self.kind}_{self.dtype}{'_d32' if self.d32 else ''}{tile}{pf}_{self.arch}"

    def target_name(self) -> str:
        digest = hashlib.sha256(repr((self.versions, self.source)).encode()).hexdigest()[:10]
        return f"xattn_{self.short_name()}_{digest}"


def max_active_clusters(num_sms: int) -> int:
    """The ``max_active_clusters`` argument for a GPU with ``num_sms`` SMs (one CTA per SM)."""
    return max(1, num_sms // (CLUSTER_MNK[0] * CLUSTER_MNK[1]))


def _prefix(t: cute.Tensor, dim: int, extent):
    """The first ``extent`` entries of the rank-``len(t.shape)`` tensor ``t`` along ``dim``: a view
    (same memory, same strides), traced inline."""
    shape = tuple(extent if i == dim else t.shape[i] for i in range(len(t.shape)))
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=t.stride))


class _Probs:
    def __init__(self, gemm, args_cls):
        self.gemm, self.args_cls = gemm, args_cls

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mRowBias: cute.Tensor, mRowPos: cute.Tensor,
                 mColPos: cute.Tensor, mD: cute.Tensor, mPf: cute.Tensor, scale_log2: Float32,
                 max_clusters: Int32, stream):
        n = mD.shape[2]
        epi = self.args_cls(rowbias=mRowBias, rowpos=mRowPos, colpos=_prefix(mColPos, 1, n), scale_log2=scale_log2,
                            p_fine=mPf)
        self.gemm(mA, _prefix(mB, 1, n), mD, None, epi, scheduler_options(max_clusters), None, stream, None, None)


class _ProbsFull:
    def __init__(self, gemm, args_cls):
        self.gemm, self.args_cls = gemm, args_cls

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mRowBias: cute.Tensor, mD: cute.Tensor,
                 mPf: cute.Tensor, scale_log2: Float32, max_clusters: Int32, stream):
        epi = self.args_cls(rowbias=mRowBias, scale_log2=scale_log2, p_fine=mPf)
        self.gemm(mA, _prefix(mB, 1, mD.shape[2]), mD, None, epi, scheduler_options(max_clusters), None, stream, None, None)


class _GradScores:
    def __init__(self, gemm, args_cls):
        self.gemm, self.args_cls = gemm, args_cls

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mPf: cute.Tensor, mDelta: cute.Tensor,
                 mD: cute.Tensor, scale: Float32, max_clusters: Int32, stream):
        epi = self.args_cls(p_fine=mPf, delta=mDelta, scale=scale)
        self.gemm(mA, _prefix(mB, 1, mD.shape[2]), mD, None, epi, scheduler_options(max_clusters), None, stream, None, None)


class _Acc:
    def __init__(self, gemm, args_cls):
        self.gemm, self.args_cls = gemm, args_cls

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mC: cute.Tensor, mD: cute.Tensor, c_rows: Int32,
                 max_clusters: Int32, stream):
        # C's rows from c_rows on are out of its TMA box: they load as zeros
        self.gemm(mX, mY, _prefix(mD, 1, mX.shape[2]), _prefix(mC, 1, c_rows), self.args_cls(),
                  scheduler_options(max_clusters), None, stream, None, None)


class _Mm:
    def __init__(self, gemm, args_cls):
        self.gemm, self.args_cls = gemm, args_cls


class _MmKv(_Mm):
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor, max_clusters: Int32, stream):
        # D may be a longer accumulator; X (L, K, M) says how many rows this block writes
        self.gemm(mX, mY, _prefix(mD, 1, mX.shape[2]), None, self.args_cls(), scheduler_options(max_clusters), None,
                  stream, None, None)


class _MmDq(_Mm):
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mD: cute.Tensor, max_clusters: Int32, stream):
        # Y holds every key; X (L, M, K) says how many this block uses
        self.gemm(mX, _prefix(mY, 1, mX.shape[2]), mD, None, self.args_cls(), scheduler_options(max_clusters), None,
                  stream, None, None)


def compile_gemm(spec: GemmSpec):
    """Compile the launcher of ``spec``; returns the compiled TVM-FFI function."""
    if spec.kind not in KINDS:
        raise ValueError(f"unknown GEMM launcher kind {spec.kind!r}; expected one of {KINDS}")
    if spec.d32 and spec.kind not in D32_KINDS:
        raise ValueError(f"d32 is for the {D32_KINDS} launchers only, not {spec.kind!r}")
    if spec.kind.startswith("seg_"):
        from .gemm_segments_sm90 import compile_segment_gemm

        return compile_segment_gemm(spec)
    cls = epilogue_class(spec.kind)
    dt = CUTE_DTYPES[spec.dtype]
    pingpong = spec.tile[0] * spec.tile[1] <= TILE_MN[0] * TILE_MN[1]  # larger tiles: cooperative (registers)
    gemm = partial(cls, pingpong=pingpong, is_persistent=True)(Float32, dt, spec.tile, CLUSTER_MNK, gather_A=False,
                                                              concat_layout=None)
    # every operand crosses in its natural row-major form; transposed operands are relabelled here
    gemm.a_transposed = spec.kind in ("acc", "mm_kv")  # X (L, K, M) -> A (L, M, K)
    gemm.b_transposed = spec.kind in ("acc", "mm_kv", "mm_dq")  # Y (L, K, N) -> B (L, N, K)
    gemm.cd_transposed = False
    gemm.cd_packed = None
    sym = cute.sym_int
    l, m, n, k = sym(), sym(), sym(), sym()
    long = sym()  # the longer extent of B / colpos / mm_dq's Y / acc's C and D (a prefix is used)
    half = lambda x, y, e=dt: make_fake_tensor(e, (l, x, y), leading_dim=2, divisibility=8)  # noqa: E731
    f32 = lambda *shape: make_fake_tensor(Float32, (l, *shape), leading_dim=len(shape), divisibility=4)  # noqa: E731
    pf = f32 if spec.p_dtype == "float32" else partial(half, e=CUTE_DTYPES[spec.p_dtype])  # P as dS reads it
    if spec.kind == "probs_causal":
        launcher = _Probs(gemm, cls.EpilogueArguments)
        tensors = (half(m, k), half(long, k), f32(m), f32(m), f32(long), half(m, n), pf(m, n))
    elif spec.kind == "probs_full":
        launcher = _ProbsFull(gemm, cls.EpilogueArguments)
        tensors = (half(m, k), half(long, k), f32(m), half(m, n), pf(m, n))
    elif spec.kind == "grad_scores":
        launcher = _GradScores(gemm, cls.EpilogueArguments)
        tensors = (half(m, k), half(long, k), pf(m, n), f32(m), half(m, n))
    elif spec.kind == "acc":
        launcher = _Acc(gemm, cls.EpilogueArguments)
        tensors = (half(k, m), half(k, n), f32(long, n), f32(long, n) if spec.d32 else half(long, n))
    elif spec.kind == "mm_dq":
        launcher = _MmDq(gemm, cls.EpilogueArguments)
        tensors = (half(m, k), half(long, n), half(m, n))
    else:
        launcher = _MmKv(gemm, cls.EpilogueArguments)
        tensors = (half(k, m), half(k, n), f32(long, n) if spec.d32 else half(long, n))
    scalars = {"acc": (Int32(1), Int32(1)), "mm_dq": (Int32(1),), "mm_kv": (Int32(1),)}.get(spec.kind,
                                                                                          (Float32(1.0), Int32(1)))
    return compile_launcher(launcher, tensors, scalars)
