"""Probe for the packed GEMM backward under ``jit`` (issue #23, docs/design.md "Open: the packed GEMM
backward under jit"): can one quack varlen-M GEMM read every document's keys in place?

The plan there indexes a launch's varlen entries by token position (``T`` entries, zero-length
except where a document starts) and passes K as an overlapping view whose batch stride is ONE key row,
so entry ``t``'s B operand starts at key ``t``: a document's scores ``S = Q_doc K_docᵀ`` come out of one
launch for all documents, with no per-document gather. Two things are unknown until a GPU runs this:

1. whether the TMA descriptor of such an aliased view (batch stride = row stride) loads the right rows;
2. what the tile scheduler's warp scan over ``T`` mostly empty entries costs, against the same GEMM with
   one entry per document and its keys gathered into padded slots (the standard varlen-M call);
3. whether A's rows can come from an offset table while D stays at ``cu_seqlens_m`` (the plan's P GEMM of
   row block c: rows ``[c·R, (c+1)·R)`` of every document read in place, their scores packed into a scratch
   that holds only that block's rows). quack's sm90 GEMM takes every per-entry offset from
   ``quack.varlen_utils.VarlenManager``; ``TableManager`` overrides A's, and is put in place of quack's
   while the launcher compiles (the table travels in ``VarlenArguments.mCuTilesM``, unused by these
   epilogues).

Prints, per document mix: the max error of each document's ``S[:, :L]`` vs torch (fp32 accumulate), and
the ms of the aliased call vs the gathered one (same tiles computed); then the same check for block c of
the table launcher. One GPU, bf16, d512, Hkv 1.

    python benchmarks/tools/aliased_varlen_gemm_probe.py [--docs mix16k,4096] [--keys 4096]

``entry_offsets`` / ``block_entries`` (the token-indexed ``cu_seqlens_m`` and A's offsets) are CPU-tested in
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
    from xattn.core.gemm_sm90 import CLUSTER_MNK, _scheduler
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.varlen_utils import VarlenArguments

    class VarlenMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, mCuM: cute.Tensor,
                     max_clusters: Int32, stream):
            self.gemm(mA, mB, mD, None, GemmDefaultSm90.EpilogueArguments(), _scheduler(max_clusters),
                      VarlenArguments(mCuSeqlensM=mCuM), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = GemmDefaultSm90(Float32, dt, TILE_MN, CLUSTER_MNK, pingpong=True, is_persistent=True, gather_A=False,
                           concat_layout=None)
    sym = cute.sym_int
    tm, n, k, lb, l1 = sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (tm, k), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (lb, n, k), leading_dim=2, divisibility=8),
               make_fake_tensor(dt, (tm, n), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (l1,), divisibility=1))
    return compile_launcher(VarlenMm(gemm), tensors, (Int32(1),))


def table_manager_class():
    """``VarlenManager`` whose A rows start at a per-entry offset table (``params.cu_tiles_m``, int32
    ``[L]``) instead of at ``cu_seqlens_m``; D, the scheduler and every length stay at ``cu_seqlens_m``."""
    import cutlass.cute as cute
    from cutlass import const_expr
    from quack.varlen_utils import VarlenManager

    class TableManager(VarlenManager):
        @staticmethod
        def create(params, len_m_static, len_k_static, len_n_static, *, loc=None, ip=None):
            return TableManager(params, len_m_static=len_m_static, len_k_static=len_k_static,
                                len_n_static=len_n_static)

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
    from xattn.core.gemm_sm90 import CLUSTER_MNK, _scheduler
    from xattn.core.symbolic import CUTE_DTYPES, compile_launcher

    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from quack.compile_utils import make_fake_tensor
    from quack.gemm_default_epi import GemmDefaultSm90
    from quack.varlen_utils import VarlenArguments

    class TableMm:
        def __init__(self, gemm):
            self.gemm = gemm

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mD: cute.Tensor, mCuM: cute.Tensor,
                     mOffA: cute.Tensor, max_clusters: Int32, stream):
            self.gemm(mA, mB, mD, None, GemmDefaultSm90.EpilogueArguments(), _scheduler(max_clusters),
                      VarlenArguments(mCuSeqlensM=mCuM, mCuTilesM=mOffA), stream)

    dt = CUTE_DTYPES[dtype]
    gemm = GemmDefaultSm90(Float32, dt, TILE_MN, CLUSTER_MNK, pingpong=True, is_persistent=True, gather_A=False,
                           concat_layout=None)
    sym = cute.sym_int
    ta, td, n, k, lb, l1 = sym(), sym(), sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dt, (ta, k), leading_dim=1, divisibility=8),
               make_fake_tensor(dt, (lb, n, k), leading_dim=2, divisibility=8),
               make_fake_tensor(dt, (td, n), leading_dim=1, divisibility=8),
               make_fake_tensor(Int32, (l1,), divisibility=1),
               make_fake_tensor(Int32, (lb,), divisibility=1))
    with quack_manager(table_manager_class()):
        return compile_launcher(TableMm(gemm), tensors, (Int32(1),))


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", default="mix16k,mix64k,4096")
    ap.add_argument("--keys", type=int, default=4096, help="the launch's N (static), capped at the longest document")
    ap.add_argument("--rows", type=int, default=1024, help="row block of the table launcher's check")
    ap.add_argument("--compile-only", action="store_true", help="compile the launcher (works on a CPU machine)")
    args = ap.parse_args()
    fn = compile_varlen_mm()
    table_fn = compile_table_mm()
    print("[aliased] launchers compiled", flush=True)
    if args.compile_only:
        return
    import torch

    from xattn.core.gemm_sm90 import max_active_clusters

    clusters = max_active_clusters(torch.cuda.get_device_properties(0).multi_processor_count)
    for spec in args.docs.split(","):
        run(spec, args.keys, fn, clusters)
    for spec in args.docs.split(","):
        for block in (0, 1):
            run_table(spec, 0, args.rows, block, table_fn, clusters)


if __name__ == "__main__":
    main()
