"""Launchers of the packed (segmented) GEMM backward: one GEMM over every document of a row block.

The chunked-GEMM backward of :mod:`xattn.core.gemm_sm90` runs a dense batch. A packed batch under
``jit`` has traced document lengths, so these launchers take each document's rows and keys from
device tables instead (docs/design.md, "The packed GEMM backward under jit"). One launch of row
block c covers *pieces*: (KV head, document) pairs with rows in block c. They are quack's varlen
GEMMs with a ``VarlenManager`` subclass that reads per-piece offsets from a table
(``VarlenArguments.mCuTilesM``), put in place of quack's while a launcher compiles.

Every launcher takes, after its operands, ``tables`` (int32 ``[4, P + 1]``) and ``cu_rows`` (int32
``[P + 1]``, the prefix sum of the pieces' rows: a piece's rows in the block's scratch):

=====  ===========================================================================================
row    per piece p
=====  ===========================================================================================
0      its first row in the query-side buffers (q, dout, dq: ``(Mq, D)``, rows of one KV head's query
       heads stacked per token, as the dense route's blocks)
1      its document's first key row in the key-side buffers (k, v: ``(Mk, D)``); the launcher reads
       keys ``[row1[p], row1[p] + kend)`` through an overlapping view (batch stride one key row), so
       the buffers carry ``kend`` spare rows after the last document
2      its document's first row in the fp32 dK/dV accumulators (``(Macc, D)``); documents start at a
       multiple of 256 there (``SEGMENT_ACC_ALIGN``), so the last cluster of two 128-row tiles of a
       piece (stored whole) never reaches the next document's rows
3      prefix sum of the keys each piece writes (``min(kend, document length)``): the ``seg_acc``
       launch schedules exactly those tiles
=====  ===========================================================================================

=====================  ====================================================  ================================
kind                   parameters (inputs, then outputs)                     computes, per piece
=====================  ====================================================  ================================
``seg_probs``          q, k, tables, cu_rows, rowbias, rowpos, colpos        S = q_rows k_docᵀ; D = pf = P (the
                       -> D, pf                                              causal epilogue of ``probs_causal``)
``seg_grad_scores``    dout, v, tables, cu_rows, pf, delta -> D              dS = (dO v_docᵀ − δ) ⊙ pf · scale
``seg_mm_dq``          dS, k, tables, cu_rows, dq_in -> dq                   dq_rows = dS k_doc (in place: dq
                                                                             aliases dq_in; no other row written)
``seg_acc``            X, Y, tables, cu_rows, C -> D                         D_doc[:keys] = X_pieceᵀ Y_rows + C
                                                                             (fp32; C and D one buffer)
=====================  ====================================================  ================================

Scratch operands (D, pf, dS, X) are ``(rows, kend)`` with the pieces' rows packed at ``cu_rows``;
rowbias / rowpos / delta are fp32 ``(rows,)`` in that order; colpos fp32 ``(>= kend,)`` holds the
key positions 0, 1, ... (one vector for every piece: positions are per document). The masked keys
(past the row's causal limit, past the document: ``rowpos`` = length − 1 for non-causal) give
P = 0 exactly, so the keys the overlapping view reads past a document contribute nothing.
``seg_acc`` runs cooperative: a persistent CTA with no work would deadlock quack's pingpong
``cu_seqlens_k`` path (a warp group waits for a tile the scheduler never writes; seen on the H200
in session 10), and this grid is an upper bound of the work.
"""

from __future__ import annotations

import contextlib
import threading

from .symbolic import CUTE_DTYPES, compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402
from quack import copy_utils  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402
from quack.varlen_utils import VarlenArguments, VarlenManager  # noqa: E402

from .gemm_sm90_common import CLUSTER_MNK, epilogue_class, scheduler_options  # noqa: E402

__all__ = ["SEG_KINDS", "compile_segment_gemm"]

SEG_KINDS = ("seg_probs", "seg_grad_scores", "seg_mm_dq", "seg_acc")
_patch_lock = threading.Lock()


class _TableManager(VarlenManager):
    """quack's ``VarlenManager`` with the per-piece offsets of the table in ``params.cu_tiles_m``
    (int32 ``[4, P + 1]``, rows as in the module doc) for the operands ``ROLE`` names. Without a
    table (any other GEMM compiled while it stands in) it is quack's own."""

    ROLE = ""  # "rows": A and B from the table; "dq": B and D; "keys": B and D of a cu_seqlens_k call

    @classmethod
    def create(cls, params, len_m_static, len_k_static, len_n_static, *, loc=None, ip=None):
        return cls(params, len_m_static=len_m_static, len_k_static=len_k_static, len_n_static=len_n_static)

    def _table(self, row, batch_idx):
        return self.params.cu_tiles_m[row, batch_idx]

    def offset_batch_A(self, mA_mkl, batch_idx):
        if const_expr(self.params.cu_tiles_m is not None and self.ROLE == "rows" and cute.rank(mA_mkl) == 2):
            return cute.domain_offset((self._table(0, batch_idx), None), mA_mkl)
        return super().offset_batch_A(mA_mkl, batch_idx)

    def offset_batch_B(self, mB_nkl, batch_idx):
        if const_expr(self.params.cu_tiles_m is None):
            return super().offset_batch_B(mB_nkl, batch_idx)
        if const_expr(self.ROLE == "keys"):  # q rows of a cu_seqlens_k piece: K ragged, from row 0
            offset = self._table(0, batch_idx)
            rank = const_expr(cute.rank(mB_nkl))
            if const_expr(rank == 2):
                return cute.domain_offset((None, offset), mB_nkl)
            length = self.params.cu_seqlens_k[batch_idx + 1] - self.params.cu_seqlens_k[batch_idx]
            return copy_utils.offset_ragged_tensor(mB_nkl, offset, length, ragged_dim=1, ptr_shift=rank == 3)
        return mB_nkl[None, None, self._table(1, batch_idx)]  # the document's keys in the overlapping view

    def offset_batch_epi(self, mD_mnl, batch_idx):
        if const_expr(self.params.cu_tiles_m is None or self.ROLE == "rows"):
            return super().offset_batch_epi(mD_mnl, batch_idx)
        if const_expr(self.ROLE == "keys"):
            return cute.domain_offset((self._table(2, batch_idx), None), mD_mnl[None, None, 0])
        offset = self._table(0, batch_idx)  # "dq": the piece's own dq rows
        rank = const_expr(cute.rank(mD_mnl))
        if const_expr(rank == 2):
            return cute.domain_offset((offset, None), mD_mnl)
        return copy_utils.offset_ragged_tensor(mD_mnl, offset, self.len_m(batch_idx), ragged_dim=0,
                                               ptr_shift=rank == 3)


def _manager(role: str):
    return type(f"TableManager_{role}", (_TableManager,), {"ROLE": role})


@contextlib.contextmanager
def _standing_in(manager):
    """quack's sm90 GEMM builds its varlen manager by module-level name: ``manager`` stands in while a
    launcher compiles (the compiled code keeps it). One compile at a time holds the name."""
    import quack.gemm_sm90 as sm90

    with _patch_lock:
        old = sm90.VarlenManager
        sm90.VarlenManager = manager
        try:
            yield
        finally:
            sm90.VarlenManager = old


def _keys_gemm_class(base, row: int = 3):
    """``base`` (a quack sm90 GEMM class) scheduled by ``VarlenMTileScheduler`` over table row ``row`` (the
    keys' prefix sum): each piece's own key tiles (quack's ``cu_seqlens_k`` calls otherwise schedule a
    static M)."""
    from quack.tile_scheduler import PersistenceMode, VarlenMTileScheduler, VarlenMTileSchedulerArguments

    class KeysGemm(base):
        def get_scheduler_class(self, varlen_m: bool = False):
            return VarlenMTileScheduler

        def get_scheduler_arguments(self, mA, mB, mD, scheduler_args, varlen_args, epilogue_args):
            pieces = varlen_args.mCuSeqlensK.shape[0] - 1
            return VarlenMTileSchedulerArguments(
                problem_shape_ntile_mnl=(None, cute.ceil_div(cute.size(mB, mode=[0]), self.cta_tile_shape_mnk[1]),
                                         pieces),
                total_m=pieces * cute.size(mA, mode=[0]),  # a piece writes at most A's M (kend) keys
                cu_seqlens_m=varlen_args.mCuTilesM[row, None],
                raster_order=scheduler_args.raster_order,
                group_size=scheduler_args.max_swizzle_size,
                tile_shape_mn=self.cta_tile_shape_mnk[:2],
                cluster_shape_mnk=self.cluster_shape_mnk,
                tile_count_semaphore=None,
                persistence_mode=PersistenceMode.STATIC,
            )

    return KeysGemm


def _doc_view(mK: cute.Tensor, kend):
    """The overlapping ``(Mk − kend + 1, kend, D)`` view of the key rows ``mK (Mk, D)``: entry e holds
    keys ``[e, e + kend)``."""
    return cute.make_tensor(mK.iterator, cute.make_layout((mK.shape[0] - kend + 1, kend, mK.shape[1]),
                                                          stride=(mK.stride[0], mK.stride[0], 1)))


def _transposed(t: cute.Tensor):
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[1], t.shape[0]),
                                                         stride=(t.stride[1], t.stride[0])))


def _batched(t: cute.Tensor):
    """``(M, N)`` -> ``(1, M, N)``: a cu_seqlens_k call's D/C (one batch; pieces offset from the table)."""
    return cute.make_tensor(t.iterator, cute.make_layout((1, t.shape[0], t.shape[1]), stride=(0, t.stride[0], 1)))


def _prefix1(t: cute.Tensor, extent):
    return cute.make_tensor(t.iterator, cute.make_layout((extent,), stride=t.stride))


class _SegLauncher:
    """A quack GEMM, its epilogue-arguments class and the scheduler options, behind one typed ``__call__``
    per kind (CuTeDSL reads the parameter annotations)."""

    def __init__(self, gemm, args_cls, scheduler):
        self.gemm, self.args_cls, self.scheduler = gemm, args_cls, scheduler


class _SegProbs(_SegLauncher):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mTables: cute.Tensor, mCu: cute.Tensor,
                 mRowBias: cute.Tensor, mRowPos: cute.Tensor, mColPos: cute.Tensor, mD: cute.Tensor,
                 mPf: cute.Tensor, scale_log2: Float32, max_clusters: Int32, stream):
        kend = mD.shape[1]
        epi = self.args_cls(rowbias=mRowBias, rowpos=mRowPos, colpos=_prefix1(mColPos, kend), scale_log2=scale_log2,
                            p_fine=mPf)
        self.gemm(mQ, _doc_view(mK, kend), mD, None, epi, self.scheduler(max_clusters),
                  VarlenArguments(mCuSeqlensM=mCu, mCuTilesM=mTables), stream)


class _SegGradScores(_SegLauncher):
    @cute.jit
    def __call__(self, mDo: cute.Tensor, mV: cute.Tensor, mTables: cute.Tensor, mCu: cute.Tensor,
                 mPf: cute.Tensor, mDelta: cute.Tensor, mD: cute.Tensor, scale: Float32, max_clusters: Int32,
                 stream):
        epi = self.args_cls(p_fine=mPf, delta=mDelta, scale=scale)
        self.gemm(mDo, _doc_view(mV, mD.shape[1]), mD, None, epi, self.scheduler(max_clusters),
                  VarlenArguments(mCuSeqlensM=mCu, mCuTilesM=mTables), stream)


class _SegMmDq(_SegLauncher):
    @cute.jit
    def __call__(self, mDs: cute.Tensor, mK: cute.Tensor, mTables: cute.Tensor, mCu: cute.Tensor,
                 mDqIn: cute.Tensor, mDq: cute.Tensor, max_clusters: Int32, stream):
        # mDqIn is mDq (XLA aliases them): the launch writes only the pieces' rows
        self.gemm(mDs, _doc_view(mK, mDs.shape[1]), mDq, None, self.args_cls(), self.scheduler(max_clusters),
                  VarlenArguments(mCuSeqlensM=mCu, mCuTilesM=mTables), stream)


class _SegAcc(_SegLauncher):
    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, mTables: cute.Tensor, mCu: cute.Tensor,
                 mC: cute.Tensor, mD: cute.Tensor, max_clusters: Int32, stream):
        self.gemm(_transposed(mX), _transposed(mY), _batched(mD), _batched(mC), self.args_cls(),
                  self.scheduler(max_clusters), VarlenArguments(mCuSeqlensK=mCu, mCuTilesM=mTables), stream)


def compile_segment_gemm(spec):
    """Compile the launcher of ``spec`` (a :class:`xattn.core.gemm_sm90.GemmSpec` whose kind is in
    :data:`SEG_KINDS`); returns the compiled TVM-FFI function."""
    base_kind = {"seg_probs": "probs_causal", "seg_grad_scores": "grad_scores", "seg_mm_dq": "mm_dq",
                 "seg_acc": "acc"}[spec.kind]
    cls = epilogue_class(base_kind)
    if spec.kind == "seg_acc":
        cls = _keys_gemm_class(cls)
    dt = CUTE_DTYPES[spec.dtype]
    pingpong = spec.kind != "seg_acc"
    gemm = cls(Float32, dt, spec.tile, CLUSTER_MNK, pingpong=pingpong, is_persistent=True, gather_A=False,
               concat_layout=None)
    gemm.a_transposed = gemm.cd_transposed = False
    gemm.b_transposed = spec.kind == "seg_mm_dq"  # the keys cross as (L, K = keys, N = D)
    gemm.cd_packed = None
    sym = cute.sym_int
    rows, kend, mq, mk, d, p1, long = sym(), sym(), sym(), sym(), sym(), sym(), sym()
    half = lambda x, y, e=dt: make_fake_tensor(e, (x, y), leading_dim=1, divisibility=8)  # noqa: E731
    f32 = lambda *s: make_fake_tensor(Float32, s, leading_dim=len(s) - 1, divisibility=4)  # noqa: E731
    pf = f32 if spec.p_dtype == "float32" else (lambda x, y: half(x, y, CUTE_DTYPES[spec.p_dtype]))
    tables = (make_fake_tensor(Int32, (4, p1), leading_dim=1, divisibility=1),
              make_fake_tensor(Int32, (p1,), divisibility=1))
    if spec.kind == "seg_probs":
        launcher, role = _SegProbs, "rows"
        tensors = (half(mq, d), half(mk, d), *tables, f32(rows), f32(rows), f32(long), half(rows, kend),
                   pf(rows, kend))
    elif spec.kind == "seg_grad_scores":
        launcher, role = _SegGradScores, "rows"
        tensors = (half(mq, d), half(mk, d), *tables, pf(rows, kend), f32(rows), half(rows, kend))
    elif spec.kind == "seg_mm_dq":
        launcher, role = _SegMmDq, "dq"
        tensors = (half(rows, kend), half(mk, d), *tables, half(mq, d), half(mq, d))
    else:
        launcher, role = _SegAcc, "keys"
        tensors = (half(rows, kend), half(mq, d), *tables, f32(long, d), f32(long, d))
    scalars = (Int32(1),) if spec.kind in ("seg_mm_dq", "seg_acc") else (Float32(1.0), Int32(1))
    with _standing_in(_manager(role)):
        return compile_launcher(launcher(gemm, cls.EpilogueArguments, scheduler_options), tensors, scalars)
