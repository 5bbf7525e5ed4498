"""Probe for the packed GEMM backward under ``jit`` (issue #23, docs/design.md "Open: the packed GEMM
backward under jit"): can one quack varlen-M GEMM read every document's keys in place?

The plan there indexes a launch's varlen entries by token position (``T`` entries, zero-length
except where a document starts) and passes K as an overlapping view whose batch stride is ONE key row,
so entry ``t``'s B operand starts at key ``t``: a document's scores ``S = Q_doc K_docᵀ`` come out of one
launch for all documents, with no per-document gather. Two things are unknown until a GPU runs this:

1. whether the TMA descriptor of such an aliased view (batch stride = row stride) loads the right rows;
2. what the tile scheduler's warp scan over ``T`` mostly empty entries costs, against the same GEMM with
   one entry per document and its keys gathered into padded slots (the standard varlen-M call).

Prints, per document mix: the max error of each document's ``S[:, :L]`` vs torch (fp32 accumulate), and
the ms of the aliased call vs the gathered one (same tiles computed). One GPU, bf16, d512, Hkv 1.

    python benchmarks/tools/aliased_varlen_gemm_probe.py [--docs mix16k,4096] [--keys 4096]

``entry_offsets`` (the token-indexed ``cu_seqlens_m``) is CPU-tested in tests/test_benchmarks.py; the
launcher compiles on the CPU (``--compile-only``).
"""
# no `from __future__ import annotations`: the launcher class below is defined inside a function and
# CuTeDSL reads its annotations (cute.Tensor) by name
import argparse
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
    ap.add_argument("--compile-only", action="store_true", help="compile the launcher (works on a CPU machine)")
    args = ap.parse_args()
    fn = compile_varlen_mm()
    print("[aliased] launcher compiled", flush=True)
    if args.compile_only:
        return
    import torch

    from xattn.core.gemm_sm90 import max_active_clusters

    clusters = max_active_clusters(torch.cuda.get_device_properties(0).multi_processor_count)
    for spec in args.docs.split(","):
        run(spec, args.keys, fn, clusters)


if __name__ == "__main__":
    main()
