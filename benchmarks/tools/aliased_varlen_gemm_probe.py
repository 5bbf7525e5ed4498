"""Probe for the packed GEMM backward under ``jit`` (issue #23, docs/design.md "The packed GEMM backward
under jit"): can quack's varlen GEMMs address every document's rows and keys in place?

Session 10 on the H200: checks 1 (aliased), 3 (table) and 5 (dq) pass; token-indexed entries cost 0.36 ms
where one entry per document takes 0.10 ms (so the built route indexes keys by a table instead); check 4
hung with pingpong (quack's pingpong ``cu_seqlens_k`` path deadlocks a CTA with no work), so its GEMM now
runs cooperative, as the built ``seg_acc`` launcher does. The built launchers are
:mod:`xattn.core.gemm_segments_sm90`.

The plan there indexes a launch's varlen entries by token position (``T`` entries, zero-length
except where a document starts) and passes K as an overlapping view whose batch stride is ONE key row,
so entry ``t``'s B operand starts at key ``t``: a document's scores ``S = Q_doc K_docᵀ`` come out of one
launch for all documents, with no per-document gather. Four things are unknown until a GPU runs this:

1. whether the TMA descriptor of such an aliased view (batch stride = row stride) loads the right rows;
2. what the tile scheduler's warp scan over ``T`` mostly empty entries costs, against the same GEMM with
   one entry per document and its keys gathered into padded slots (the standard varlen-M call);
3. whether A's rows can come from an offset table while D stays at ``cu_seqlens_m`` (the plan's P GEMM of
   row block c: rows ``[c·R, (c+1)·R)`` of every document read in place, their scores packed into a scratch
   that holds only that block's rows). quack's sm90 GEMM takes every per-entry offset from
   ``quack.varlen_utils.VarlenManager``; ``TableManager`` overrides A's, and is put in place of quack's
   while the launcher compiles (the table travels in ``VarlenArguments.mCuTilesM``, unused by these
   epilogues);
4. the plan's dK/dV GEMM of row block c in quack's ``cu_seqlens_k`` mode: one entry per piece (K = its rows,
   packed in the scratch at ``cu_seqlens_k``), ``Pᵀ`` from the scratch times the piece's q rows read in place
   (B's offsets from a table), written to an accumulator where each document starts at a multiple of the
   block rows (D's offsets from a table), on quack's ``VarlenMTileScheduler`` counting each piece's own key
   tiles (``KeysManager``, ``keys_gemm_class``);
5. the plan's dQ GEMM of row block c: the dS scratch at ``cu_seqlens_m`` times the document's keys (the
   aliased view again, now as K), written to the piece's dq rows in place (D's offsets from a table,
   ``DqManager``).

Prints, per document mix: the max error of each document's ``S[:, :L]`` vs torch (fp32 accumulate), and
the ms of the aliased call vs the gathered one (same tiles computed); then the same check for block c of
the table, keys and dq launchers. One GPU, bf16, d512, Hkv 1.

    python benchmarks/tools/aliased_varlen_gemm_probe.py [--docs mix16k,4096] [--keys 4096]

``entry_offsets`` / ``block_entries`` / ``block_pieces`` (the entries and their tables) are CPU-tested in
tests/test_benchmarks.py; the launchers compile on the CPU (``--compile-only``).
"""
# no `from __future__ import annotations`: the launcher class below is defined inside a function and
# CuTeDSL reads its annotations (cute.Tensor) by name
import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

D = 512
TILE_MN = (128, 192)


def entry_offsets(lens) -> np.ndarray:
    """Token-indexed ``cu_seqlens_m`` (int32 ``[T + 1]``) of documents ``lens`` packed in order:
    entry ``t`` holds the rows of the document that starts at token ``t`` (its ``L`` rows), every other
    entry none. Entry t's offset is the first document start ``>= t``, so the rows stay contiguous."""
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    t = np.arange(int(starts[-1]) + 1)
    return starts[np.searchsorted(starts, t, side="left")].astype(np.int32)


def block_entries(lens, rows: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Row block ``block`` (``rows`` rows each) of documents ``lens``, token-indexed like
    :func:`entry_offsets`: ``(cu_seqlens_m int32 [T + 1], a_offsets int32 [T])``. The entry of the document
    starting at token t holds its rows ``[block·rows, min((block+1)·rows, L))``, packed one document after the
    other from 0 (the scratch's rows); ``a_offsets[t]`` is the first of them in the packed q (0 elsewhere)."""
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    total = int(starts[-1])
    count = np.zeros(total + 1, np.int64)
    a_off = np.zeros(total, np.int64)
    for s, n in zip(starts[:-1], lens):
        m = min(max(n - block * rows, 0), rows)
        if m:
            count[s] = m
            a_off[s] = s + block * rows
    cu = np.concatenate([[0], np.cumsum(count[:-1])])
    return cu.astype(np.int32), a_off.astype(np.int32)


def compile_varlen_mm(dtype: str = "bfloat16"):
    """``D[rows of entry e] = A[rows of entry e] @ B[e]ᵀ`` (varlen M), A ``(total_m, K)``, B ``(L, N, K)``
    (any strides: the aliased view crosses as it is), D ``(total_m, N)``, cu_seqlens_m int32 ``(L + 1,)``."""
    from xattn.core.gemm_sm90 import scheduler_options
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Int32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.varlen_utils import VarlenArguments

    class VarlenMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, mCuM: cute.Tensor,
                     max_clusters: Int32, stream):
            self.gemm(mA, mB, mD, None, GemmDefaultSm90.EpilogueArguments(), scheduler_options(max_clusters),
                      VarlenArguments(mCuSeqlensM=mCuM), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = _gemm(GemmDefaultSm90, dt, TILE_MN)
    sym = cute.sym_int
    tm, n, k, lb, l1 = sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (tm, k), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (lb, n, k), leading_dim=2, divisibility=8),
               make_fake_tensor(dt, (tm, n), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (l1,), divisibility=1))
    return compile_launcher(VarlenMm(gemm), tensors, (Int32(1),))


def _manager_base():
    """quack's ``VarlenManager`` with a ``create`` that builds the subclass it is called on (quack's own
    builds a ``VarlenManager``): the base of the probe's managers."""
    from quack.varlen_utils import VarlenManager

    class OwnCreate(VarlenManager):
        @classmethod
        def create(cls, params, len_m_static, len_k_static, len_n_static, *, loc=None, ip=None):
            return cls(params, len_m_static=len_m_static, len_k_static=len_k_static, len_n_static=len_n_static)

    return OwnCreate


def _gemm(cls, dtype, tile, pingpong=True):
    """An instance of quack GEMM class ``cls`` (16-bit ``dtype`` operands, fp32 accumulate) with the
    launchers' settings (:mod:`xattn.core.gemm_sm90`): cluster, pingpong, static persistent schedule."""
    from xattn.core.gemm_sm90 import CLUSTER_MNK

    from cutlass import Float32

    return cls(Float32, dtype, tile, CLUSTER_MNK, pingpong=pingpong, is_persistent=True, gather_A=False,
               concat_layout=None)


def table_manager_class():
    """``VarlenManager`` whose A rows start at a per-entry offset table (``params.cu_tiles_m``, int32
    ``[L]``) instead of at ``cu_seqlens_m``; D, the scheduler and every length stay at ``cu_seqlens_m``."""
    import cutlass.cute as cute
    from cutlass import const_expr
    class TableManager(_manager_base()):
        def offset_batch_A(self, mA_mkl, batch_idx):
            if const_expr(self.varlen_m and cute.rank(mA_mkl) == 2):
                return cute.domain_offset((self.params.cu_tiles_m[batch_idx], None), mA_mkl)
            return super().offset_batch_A(mA_mkl, batch_idx)

    return TableManager


@contextlib.contextmanager
def quack_manager(cls):
    """quack's sm90 GEMM builds its varlen manager by module-level name: ``cls`` stands in while a
    launcher compiles (the compiled code keeps it; nothing else sees it)."""
    import quack.gemm_sm90 as sm90

    old = sm90.VarlenManager
    sm90.VarlenManager = cls
    try:
        yield
    finally:
        sm90.VarlenManager = old


def compile_table_mm(dtype: str = "bfloat16"):
    """:func:`compile_varlen_mm` with A's rows at ``a_offsets[e]`` (int32 ``(L,)``, the last argument
    before ``max_clusters``): ``D[cu_m[e]:cu_m[e+1]] = A[a_off[e]:a_off[e] + len] @ B[e]ᵀ``."""
    from xattn.core.gemm_sm90 import scheduler_options
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Int32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.varlen_utils import VarlenArguments

    class TableMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, mCuM: cute.Tensor,
                     mOffA: cute.Tensor, max_clusters: Int32, stream):
            self.gemm(mA, mB, mD, None, GemmDefaultSm90.EpilogueArguments(), scheduler_options(max_clusters),
                      VarlenArguments(mCuSeqlensM=mCuM, mCuTilesM=mOffA), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = _gemm(GemmDefaultSm90, dt, TILE_MN)
    sym = cute.sym_int
    ta, td, n, k, lb, l1 = sym(), sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (ta, k), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (lb, n, k), leading_dim=2, divisibility=8),
               make_fake_tensor(dt, (td, n), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (l1,), divisibility=1),
               make_fake_tensor(Int32, (lb,), divisibility=1))
    with quack_manager(table_manager_class()):
        return compile_launcher(TableMm(gemm), tensors, (Int32(1),))


def dq_manager_class():
    """``VarlenManager`` whose D (and C) rows start at a per-entry table (``params.cu_tiles_m``, int32
    ``[L]``) instead of at ``cu_seqlens_m``; A, the scheduler and every length stay at ``cu_seqlens_m``."""
    import cutlass.cute as cute
    from cutlass import const_expr
    from quack import copy_utils
    class DqManager(_manager_base()):
        def offset_batch_epi(self, mD_mnl, batch_idx):
            if const_expr(not self.varlen_m):
                return super().offset_batch_epi(mD_mnl, batch_idx)
            offset = self.params.cu_tiles_m[batch_idx]
            rank = const_expr(cute.rank(mD_mnl))
            if const_expr(rank == 2):
                return cute.domain_offset((offset, None), mD_mnl)
            return copy_utils.offset_ragged_tensor(mD_mnl, offset, self.len_m(batch_idx), ragged_dim=0,
                                                   ptr_shift=rank == 3)

    return DqManager


def compile_dq_mm(dtype: str = "bfloat16"):
    """``dq[d_off[e] + r] = dS[cu_m[e] + r] @ K[e : e + kend]`` (varlen M over token-indexed entries): dS the
    block's scratch ``(rows, kend)``, K the aliased key view ``(L, Kb >= kend, D)``, dq ``(T, D)``, cu_m int32
    ``(L + 1,)``, d_off int32 ``(L,)``."""
    from xattn.core.gemm_sm90 import KIND_TILES, scheduler_options
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Int32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.varlen_utils import VarlenArguments

    class DqMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mDs: cute.Tensor, mKeys: cute.Tensor, mDq: cute.Tensor, mCuM: cute.Tensor,
                     mOffD: cute.Tensor, max_clusters: Int32, stream):
            kend = mDs.shape[1]  # the keys this block's scores span: a prefix of each entry's view
            keys = cute.make_tensor(mKeys.iterator, cute.make_layout(
                (mKeys.shape[0], kend, mKeys.shape[2]), stride=mKeys.stride))
            self.gemm(mDs, keys, mDq, None, GemmDefaultSm90.EpilogueArguments(), scheduler_options(max_clusters),
                      VarlenArguments(mCuSeqlensM=mCuM, mCuTilesM=mOffD), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = _gemm(GemmDefaultSm90, dt, KIND_TILES["mm_dq"])
    gemm.b_transposed = True  # the keys cross as (L, K = keys, N = D)
    sym = cute.sym_int
    rows, kend, lb, kb, d, t, l1 = sym(), sym(), sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (rows, kend), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (lb, kb, d), leading_dim=2, divisibility=8),
               make_fake_tensor(dt, (t, d), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (l1,), divisibility=1),
               make_fake_tensor(Int32, (lb,), divisibility=1))
    with quack_manager(dq_manager_class()):
        return compile_launcher(DqMm(gemm), tensors, (Int32(1),))


def run_dq(spec: str, rows: int, block: int, fn, clusters: int) -> None:
    """Block ``block``'s dQ-type GEMM through :func:`compile_dq_mm`, checked against torch; every dq row
    outside the block's pieces must stay untouched (NaN)."""
    import torch

    from benchmarks.packed import documents

    lens = documents(spec)
    t = sum(lens)
    kend = (block + 1) * rows
    g = torch.Generator(device="cuda").manual_seed(3)
    kbuf = torch.zeros(t + kend, D, device="cuda", dtype=torch.bfloat16)
    kbuf[:t] = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    aliased = kbuf.as_strided((t, kend, D), (D, D, 1))
    cu, d_off = block_entries(lens, rows, block)  # the same rows as the P GEMM's: dq rows = q rows
    ds = torch.randn(max(int(cu[-1]), 1), kend, device="cuda", dtype=torch.bfloat16, generator=g)
    dq = torch.full((t, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn(ds, aliased, dq, torch.from_numpy(cu).cuda(), torch.from_numpy(d_off).cuda(), clusters)
    torch.cuda.synchronize()
    starts = np.concatenate([[0], np.cumsum(lens)])
    worst, written = 0.0, torch.zeros(t, dtype=torch.bool, device="cuda")
    for s, length in zip(starts[:-1], lens):
        e0, e1 = int(cu[s]), int(cu[s + 1]) if s + 1 < len(cu) else int(cu[-1])
        if e1 == e0 or length == 0:
            continue
        r0 = s + block * rows
        ref = ds[e0:e1].float() @ kbuf[s:s + kend].float()
        err = (dq[r0:r0 + e1 - e0].float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        worst = max(worst, err if err == err else float("inf"))
        written[r0:r0 + e1 - e0] = True
    stray = int((~dq[~written].isnan().all(dim=1)).sum().item()) if (~written).any() else 0
    ok = worst < 2e-2 and stray == 0
    print(f"[dq] {spec}: block {block} of {rows} rows, kend {kend}: max rel error {worst:.2e}, rows written "
          f"outside the pieces {stray} ({'OK' if ok else 'WRONG'})", flush=True)


def run_table(spec: str, keys: int, rows: int, block: int, fn, clusters: int) -> None:
    """Block ``block`` of every document through :func:`compile_table_mm`, checked against torch."""
    import torch

    from benchmarks.packed import documents

    lens = documents(spec)
    t = sum(lens)
    n = -(-min((block + 1) * rows, max(lens)) // 8) * 8  # the block's causal key limit, as the plan's kend
    n = min(n, -(-keys // 8) * 8) if keys else n
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kbuf = torch.zeros(t + n, D, device="cuda", dtype=torch.bfloat16)
    kbuf[:t] = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    aliased = kbuf.as_strided((t, n, D), (D, D, 1))
    cu, a_off = block_entries(lens, rows, block)
    scratch = torch.full((max(int(cu[-1]), 1), n), float("nan"), device="cuda", dtype=torch.bfloat16)
    fn(q, aliased, scratch, torch.from_numpy(cu).cuda(), torch.from_numpy(a_off).cuda(), clusters)
    torch.cuda.synchronize()
    starts = np.concatenate([[0], np.cumsum(lens)])
    worst, pieces = 0.0, 0
    for s, length in zip(starts[:-1], lens):
        e0, e1 = int(cu[s]), int(cu[s + 1]) if s + 1 < len(cu) else int(cu[-1])
        if e1 == e0 or length == 0:  # no rows in this block (a zero-length document shares its start)
            continue
        pieces += 1
        r0 = s + block * rows
        m = min(length, n)
        ref = q[r0:r0 + (e1 - e0)].float() @ kbuf[s:s + m].float().T
        got = scratch[e0:e1, :m].float()
        err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        worst = max(worst, err if err == err else float("inf"))
    print(f"[table] {spec}: block {block} of {rows} rows, {pieces} pieces, {int(cu[-1])} rows, N {n}: "
          f"max rel error {worst:.2e} ({'OK' if worst < 2e-2 else 'WRONG'})", flush=True)


def block_pieces(lens, rows: int, block: int, align: int) -> dict:
    """Row block ``block`` of documents ``lens`` as pieces (one per document with rows in it, in order):
    ``cu_k`` int32 ``[P + 1]`` (their rows packed from 0, the scratch's rows), ``b_off`` (first q row of
    each), ``d_off`` (each document's first row in an accumulator that starts every document at a multiple
    of ``align``), ``keys`` (the keys each piece writes: ``min(kend, L)``, kend = ``(block + 1)·rows``),
    ``cu_keys`` (their prefix sum), ``acc_rows`` (the accumulator's length) and ``docs`` (document index
    of each piece)."""
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    aligned = np.concatenate([[0], np.cumsum([-(-n // align) * align for n in lens])]).astype(np.int64)
    kend = (block + 1) * rows
    docs, piece_rows, b_off, d_off, keys = [], [], [], [], []
    for i, n in enumerate(lens):
        m = min(max(n - block * rows, 0), rows)
        if m:
            docs.append(i)
            piece_rows.append(m)
            b_off.append(starts[i] + block * rows)
            d_off.append(aligned[i])
            keys.append(min(kend, n))
    i32 = lambda x: np.asarray(x, np.int64).astype(np.int32)  # noqa: E731
    return dict(cu_k=i32(np.concatenate([[0], np.cumsum(piece_rows)])), b_off=i32(b_off), d_off=i32(d_off),
                keys=i32(keys), cu_keys=i32(np.concatenate([[0], np.cumsum(keys)])), acc_rows=int(aligned[-1]),
                docs=docs)


def keys_gemm_class():
    """quack's default-epilogue sm90 GEMM scheduled by ``VarlenMTileScheduler`` over the prefix sum in row 2
    of the table tensor (``VarlenArguments.mCuTilesM``, int32 ``[3, P + 1]``): each piece's own M tiles
    (the built route's, :mod:`xattn.core.gemm_segments_sm90`, with this probe's table row)."""
    from quack.gemm_default_epi import GemmDefaultSm90

    from xattn.core.gemm_segments_sm90 import _keys_gemm_class

    return _keys_gemm_class(GemmDefaultSm90, row=2)


def keys_manager_class():
    """``VarlenManager`` for ``cu_seqlens_k`` calls whose B rows start at a per-entry table (row 0 of
    ``params.cu_tiles_m``) and whose D/C start at another (row 1): A stays at ``cu_seqlens_k``."""
    import cutlass.cute as cute
    from cutlass import const_expr
    from quack import copy_utils
    class KeysManager(_manager_base()):
        def offset_batch_B(self, mB_nkl, batch_idx):
            offset = self.params.cu_tiles_m[0, batch_idx]
            rank = const_expr(cute.rank(mB_nkl))
            if const_expr(rank == 2):
                return cute.domain_offset((None, offset), mB_nkl)
            length = self.params.cu_seqlens_k[batch_idx + 1] - self.params.cu_seqlens_k[batch_idx]
            return copy_utils.offset_ragged_tensor(mB_nkl, offset, length, ragged_dim=1, ptr_shift=rank == 3)

        def offset_batch_epi(self, mD_mnl, batch_idx):
            return cute.domain_offset((self.params.cu_tiles_m[1, batch_idx], None), mD_mnl[None, None, 0])

    return KeysManager


def compile_keys_mm(dtype: str = "bfloat16"):
    """``acc[d_off[p] + i] = sum_r P[cu_k[p] + r, i] · Q[b_off[p] + r]`` for keys ``i < keys[p]``: P the block's
    scratch ``(rows, kend)``, Q ``(T, D)``, acc ``(acc_rows, D)`` 16-bit (the fp32 accumulate of the plan adds C;
    this checks the addressing), cu_k int32 ``(P + 1,)``, tables int32 ``(3, P + 1)``: b_off, d_off, cu_keys."""
    from xattn.core.gemm_sm90 import KIND_TILES, scheduler_options
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Int32
    from quack.compile_utils import make_fake_tensor
    from quack.varlen_utils import VarlenArguments

    def transposed(t):  # (rows, cols) -> its (cols, rows) view
        layout = cute.make_layout((t.shape[1], t.shape[0]), stride=(t.stride[1], t.stride[0]))
        return cute.make_tensor(t.iterator, layout)

    class KeysMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mP: cute.Tensor, mQ: cute.Tensor, mAcc: cute.Tensor, mCuK: cute.Tensor,
                     mTables: cute.Tensor, max_clusters: Int32, stream):
            acc = cute.make_tensor(mAcc.iterator, cute.make_layout((1, mAcc.shape[0], mAcc.shape[1]),
                                                                   stride=(0, mAcc.stride[0], 1)))
            self.gemm(transposed(mP), transposed(mQ), acc, None, self.gemm.EpilogueArguments(),
                      scheduler_options(max_clusters), VarlenArguments(mCuSeqlensK=mCuK, mCuTilesM=mTables), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = _gemm(keys_gemm_class(), dt, KIND_TILES["acc"], pingpong=False)  # pingpong deadlocks (module doc)
    sym = cute.sym_int
    rows, kend, t, d, acc_rows, p1 = sym(), sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (rows, kend), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (t, d), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (acc_rows, d), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (p1,), divisibility=1),
               make_fake_tensor(Int32, (3, p1), leading_dim=1, divisibility=1))
    with quack_manager(keys_manager_class()):
        return compile_launcher(KeysMm(gemm), tensors, (Int32(1),))


def run(spec: str, keys: int, fn, clusters: int) -> None:
    import torch

    from benchmarks.bench import bench_ms
    from benchmarks.packed import documents

    lens = documents(spec)
    t = sum(lens)
    n = min(keys, max(lens))
    n = -(-n // 8) * 8
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    kbuf = torch.zeros(t + n, D, device="cuda", dtype=torch.bfloat16)  # n spare rows: the last entries' view
    kbuf[:t] = torch.randn(t, D, device="cuda", dtype=torch.bfloat16, generator=g)
    aliased = kbuf.as_strided((t, n, D), (D, D, 1))  # entry e: keys [e, e + n)
    cu_tok = torch.from_numpy(entry_offsets(lens)).cuda()
    s_alias = torch.empty(t, n, device="cuda", dtype=torch.bfloat16)
    # the standard call: one entry per document, its first n keys gathered into a padded slot
    starts = np.concatenate([[0], np.cumsum(lens)])
    slots = torch.stack([kbuf[s:s + n] for s in starts[:-1]])
    cu_doc = torch.tensor(starts, dtype=torch.int32, device="cuda")
    s_slot = torch.empty_like(s_alias)
    fn(q, aliased, s_alias, cu_tok, clusters)
    fn(q, slots, s_slot, cu_doc, clusters)
    torch.cuda.synchronize()
    worst = 0.0
    for s, length in zip(starts[:-1], lens):
        m = min(length, n)  # keys of the document within the launch's n
        ref = (q[s:s + length].float() @ kbuf[s:s + m].float().T)
        err = (s_alias[s:s + length, :m].float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        worst = max(worst, err)
    same = torch.equal(s_alias, s_slot)
    ms_alias = bench_ms(lambda: fn(q, aliased, s_alias, cu_tok, clusters))
    ms_slot = bench_ms(lambda: fn(q, slots, s_slot, cu_doc, clusters))
    print(f"[aliased] {spec}: {len(lens)} documents, T {t}, N {n}: max rel error {worst:.2e} "
          f"({'OK' if worst < 2e-2 else 'WRONG'}), equal to the gathered call: {same}; "
          f"aliased {ms_alias:.3f} ms ({t + 1} entries) vs gathered {ms_slot:.3f} ms ({len(lens)} entries)",
          flush=True)


def run_keys(spec: str, rows: int, block: int, fn, clusters: int) -> None:
    """Block ``block``'s dK-type GEMM through :func:`compile_keys_mm`, checked against torch; every
    accumulator row outside the pieces' key ranges must stay untouched (NaN)."""
    import torch

    from benchmarks.packed import documents

    lens = documents(spec)
    pc = block_pieces(lens, rows, block, align=max(rows, 256))
    kend = (block + 1) * rows
    if not pc["docs"]:
        print(f"[keys] {spec}: block {block} has no rows", flush=True)
        return
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(sum(lens), D, device="cuda", dtype=torch.bfloat16, generator=g)
    scratch = torch.randn(int(pc["cu_k"][-1]), kend, device="cuda", dtype=torch.bfloat16, generator=g)
    acc = torch.full((pc["acc_rows"], D), float("nan"), device="cuda", dtype=torch.bfloat16)
    tables = np.stack([np.append(pc["b_off"], 0), np.append(pc["d_off"], 0), pc["cu_keys"]]).astype(np.int32)
    tables = torch.from_numpy(tables).cuda()
    fn(scratch, q, acc, torch.from_numpy(pc["cu_k"]).cuda(), tables.contiguous(), clusters)
    torch.cuda.synchronize()
    worst, touched = 0.0, torch.zeros(pc["acc_rows"], dtype=torch.bool, device="cuda")
    for i in range(len(pc["docs"])):
        r0, r1, keys = int(pc["cu_k"][i]), int(pc["cu_k"][i + 1]), int(pc["keys"][i])
        b, d = int(pc["b_off"][i]), int(pc["d_off"][i])
        ref = scratch[r0:r1, :keys].float().T @ q[b:b + r1 - r0].float()
        got = acc[d:d + keys].float()
        err = (got - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        worst = max(worst, err if err == err else float("inf"))
        touched[d:d + -(-keys // 256) * 256] = True  # a piece's last cluster (2 x 128 rows) is stored whole
    stray = int((~acc[~touched].isnan().all(dim=1)).sum().item()) if (~touched).any() else 0
    ok = worst < 2e-2 and stray == 0
    print(f"[keys] {spec}: block {block} of {rows} rows, {len(pc['docs'])} pieces, kend {kend}: max rel error "
          f"{worst:.2e}, rows written outside the pieces {stray} ({'OK' if ok else 'WRONG'})", flush=True)


CHECKS = ("aliased", "table", "keys", "dq")


def main():
    import faulthandler
    import time

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="mix16k,mix64k,4096")
    ap.add_argument("--keys", type=int, default=4096, help="the launch's N (static), capped at the longest document")
    ap.add_argument("--rows", type=int, default=1024, help="row block of the table launcher's check")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"which of {', '.join(CHECKS)} (their launchers only)")
    ap.add_argument("--compile-only", action="store_true", help="compile the launcher (works on a CPU machine)")
    args = ap.parse_args()
    checks = args.checks.split(",")
    if unknown := set(checks) - set(CHECKS):
        ap.error(f"--checks: unknown {sorted(unknown)}; choose from {', '.join(CHECKS)}")
    t0 = time.perf_counter()
    say = lambda msg: print(f"[{time.perf_counter() - t0:6.1f} s] {msg}", flush=True)  # noqa: E731
    faulthandler.dump_traceback_later(60, repeat=True)  # a hung kernel shows where the host waits
    compilers = dict(aliased=compile_varlen_mm, table=compile_table_mm, keys=compile_keys_mm, dq=compile_dq_mm)
    fns = {}
    for name in checks:
        fns[name] = compilers[name]()
        say(f"{name}: launcher compiled")
    if args.compile_only:
        return
    import torch

    from xattn.core.gemm_sm90 import max_active_clusters

    clusters = max_active_clusters(torch.cuda.get_device_properties(0).multi_processor_count)
    for spec in args.docs.split(","):
        if "aliased" in fns:
            run(spec, args.keys, fns["aliased"], clusters)
        for block in (0, 1):
            if "table" in fns:
                run_table(spec, 0, args.rows, block, fns["table"], clusters)
            if "keys" in fns:
                run_keys(spec, args.rows, block, fns["keys"], clusters)
            if "dq" in fns:
                run_dq(spec, args.rows, block, fns["dq"], clusters)
        say(f"{spec} done")


if __name__ == "__main__":
    main()
