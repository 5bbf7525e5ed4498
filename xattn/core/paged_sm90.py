"""Paged-KV forward launchers (issue #44): dense queries against a pool of pages, one sequence (or one split
entry, :mod:`xattn.core.paged`) per batch row. Compiled once per :class:`KernelSpec` with ``page_size`` set.

Launcher signatures (glossary of :mod:`xattn.core.paged`; NP pages of PS rows, P page-table columns)::

  ffpa dense : q[B,Nq,Hq,D] k[NP*PS,Hkv,D] v[NP*PS,Hkv,D] kv_meta[B,1+P] i32, out[B,Nq,Hq,D] lse[B,Hq,Nq] f32, scale
  fa4  dense : q[B,Nq,Hq,D] k[NP,PS,Hkv,D] v[NP,PS,Hkv,Dv] kv_meta[B,1+P] i32, out lse, scale
  varlen     : q[Tq,Hq,D] k v cu_q[B+1] i32 kv_meta[B,1+P] i32, out[Tq,Hq,Dv] lse[Hq,Tq], scale  (prefill over
               the pages: sequence b's queries are rows cu_q[b]..cu_q[b+1], bottom-right aligned on its keys)

With ``kv_heads_first`` (JAX Pallas' layout) the pools are ``[Hkv, NP*PS, D]`` (FFPA) / ``[Hkv, NP, PS, D]``
(FA4) and the launcher reads them through a permuted layout (no copy).

``kv_meta`` row b: column 0 the keys of row b (``seqused_k``), then its page table. FFPA reads the pool as one
flat ``[NP*PS, Hkv, D]`` view (pages contiguous in the pool); FA4 as its own paged layout. FFPA's output needs
the pre-fill (0, -inf) of :meth:`KernelSpec.output_fill` (it skips a row without keys); FA4 writes every row.

How each family pages:

* **FA4**: flash_attn.cute's sm90 forward takes ``mSeqUsedK`` and ``mPageTable`` itself (TMA per page when PS
  equals its key tile, cp.async otherwise); the launcher hands it the two views of ``kv_meta``. A
  :class:`~xattn.core.split_kv.SplitFwdSpec` (the split launch of d128 over pages of 64 rows) is built with its
  decode tile, as :mod:`xattn.core.fa4_sm90` builds the contiguous one.
* **FFPA**: its forward has no page table. It loads each 64-row key tile n by TMA at a coordinate the
  producer computes from the varlen key offset; two of its module-level names stand in while a launcher
  compiles (the compiled code keeps them; one compile at a time holds them, as in
  :mod:`xattn.core.gemm_segments_sm90`): ``SeqlenInfoQK`` (key length ``kv_meta[b, 0]``, key offset 0) and
  ``copy_utils``, whose K and V copies map tile n to pool tile ``kv_meta[b, 1 + n // r] * r + n % r``,
  r = PS / 64 (a tile never crosses a page). Nothing of FFPA's kernel is copied; a CPU test counts the
  copies the stand-in maps (K and V only).

A tile past a row's keys is loaded whole and masked: rows past ``seqused_k`` in its last page must hold finite
values (0 x NaN is NaN in the P V product), as for FlashAttention's own paged kernels.
"""

from __future__ import annotations

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import contextlib  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import cutlass.cute as cute  # noqa: E402
import ffpa_attn.cute._fwd_d512_sm90 as ffpa_fwd_module  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from ffpa_attn.cute.utils.seqlen_info import SeqlenInfoQK  # noqa: E402
from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90  # noqa: E402
from flash_attn.cute.interface import _tile_size_fwd_sm90  # noqa: E402
from flash_attn.cute.utils import AuxData  # noqa: E402
from quack import copy_utils as quack_copy_utils  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from . import ffpa_sm90  # noqa: E402
from .spec import PAGED_FFPA_TILE, KernelSpec  # noqa: E402
from .split_kv import SplitFwdSpec  # noqa: E402
from .symbolic import CUTE_DTYPES, compile_launcher  # noqa: E402

__all__ = ["compile_paged"]

_names_lock = threading.Lock()
# flash_attn.cute's sm90 paged forward (cp.async loads) gave wrong results with its 144-row key tile (d96 without a
# mask) at every page size tried, 16 and 128, where the 128-row tile of the same head dim's causal config is right
# (contract fuzz, session 18; benchmarks/tools/paged_tile_probe.py, session 19): xattn builds that kernel with 128
_FA4_PAGED_BAD_TILE = 144


@dataclass(frozen=True)
class _PagedSeqlen(SeqlenInfoQK):
    """FFPA's per-row lengths with the key side from ``kv_meta`` (passed in the cu_seqlens_k slot): length
    ``kv_meta[b, 0]``, offset 0 (the pool is not offset per row; the copies map each tile)."""

    kv_meta: cute.Tensor = None
    row: Int32 = None

    @staticmethod
    def create(batch_idx, seqlen_q_static, seqlen_k_static, mCuSeqlensQ=None, mCuSeqlensK=None, tile_m=128,
               tile_n=128):
        base = SeqlenInfoQK.create(batch_idx, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, None, tile_m,
                                   tile_n)
        return _PagedSeqlen(offset_q=base.offset_q, offset_k=0, padded_offset_q=base.padded_offset_q,
                            padded_offset_k=0, seqlen_q=base.seqlen_q, seqlen_k=mCuSeqlensK[batch_idx, 0],
                            has_cu_seqlens_q=base.has_cu_seqlens_q, has_cu_seqlens_k=True, kv_meta=mCuSeqlensK,
                            row=batch_idx)

    def offset_batch_K(self, mK, batch_idx, dim, padded=False, ragged=False, multiple=1):
        _tracing().seqlen = self  # the producer asks right before it builds the K and V copies of this row
        return mK

    def pool_tile(self, n_block):
        r = _tracing().tiles_per_page
        return self.kv_meta[self.row, 1 + n_block // r] * r + n_block % r


class _PagedCopyUtils(types.ModuleType):
    """quack's ``copy_utils`` with the K and V TMA copies mapped through the page table (tracing state of
    the one compile that holds the names: the atoms, the row's lengths, tiles per page)."""

    def __init__(self, tiles_per_page: int):
        super().__init__("xattn_paged_copy_utils")
        self.tiles_per_page, self.kv_atoms, self.seqlen, self.mapped = tiles_per_page, (), None, 0

    def __getattr__(self, name):
        return getattr(quack_copy_utils, name)

    def tma_get_copy_fn(self, atom, *args, **kwargs):
        copy, s, g = quack_copy_utils.tma_get_copy_fn(atom, *args, **kwargs)
        if not any(atom is a for a in self.kv_atoms):
            return copy, s, g
        seqlen = self.seqlen
        self.mapped += 1

        def paged_copy(src_idx, dst_idx, **kw):
            return copy(src_idx=seqlen.pool_tile(src_idx), dst_idx=dst_idx, **kw)
        return paged_copy, s, g


def _tracing() -> _PagedCopyUtils:
    return ffpa_fwd_module.copy_utils


class _PagedProducer:
    """Records which TMA atoms load K and V, for the stand-in ``copy_utils`` (a plain method: traced inline)."""

    def producer(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, *rest):
        tracing = _tracing()
        tracing.kv_atoms = (tma_atom_K, tma_atom_V)
        super().producer(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, *rest)
        tracing.kv_atoms = ()


@contextlib.contextmanager
def _paged_names(tiles_per_page: int):
    """FFPA's forward module with the stand-ins while a launcher compiles; yields the tracing state."""
    with _names_lock:
        old = ffpa_fwd_module.SeqlenInfoQK, ffpa_fwd_module.copy_utils
        tracing = _PagedCopyUtils(tiles_per_page)
        ffpa_fwd_module.SeqlenInfoQK, ffpa_fwd_module.copy_utils = _PagedSeqlen, tracing
        try:
            yield tracing
        finally:
            ffpa_fwd_module.SeqlenInfoQK, ffpa_fwd_module.copy_utils = old


def _pool_view(mPool, heads_first: bool):
    """The pool as the kernel reads it: heads-first storage seen through a permuted layout (traced inline)."""
    if not heads_first:
        return mPool
    order = [1, 0, 2] if cute.rank(mPool) == 3 else [1, 2, 0, 3]  # FFPA [H, R, D] -> [R, H, D]; FA4 -> [NP, PS, H, D]
    return cute.make_tensor(mPool.iterator, cute.select(mPool.layout, mode=order))


class _FfpaPaged:
    def __init__(self, kernel, spec: KernelSpec):
        self.kernel, self.heads_first = kernel, spec.kv_heads_first

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKVMeta: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self.kernel(mQ, _pool_view(mK, self.heads_first), _pool_view(mV, self.heads_first), mO, mLSE, softmax_scale,
                    None, mKVMeta, None, None, None, stream)


class _FfpaPagedVarlen(_FfpaPaged):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mKVMeta: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self.kernel(mQ, _pool_view(mK, self.heads_first), _pool_view(mV, self.heads_first), mO, mLSE, softmax_scale,
                    mCuSeqlensQ, mKVMeta, None, None, None, stream)


class _Fa4Paged:
    def __init__(self, kernel, spec: KernelSpec):
        self.kernel, self.wl, self.wr = kernel, spec.window_left, spec.window_right
        self.heads_first = spec.kv_heads_first

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mKVMeta: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, None, mKVMeta, mO, mLSE, softmax_scale, stream)

    def _run(self, mQ, mK, mV, mCuSeqlensQ, mKVMeta, mO, mLSE, softmax_scale, stream):  # traced inline
        rows, cols = mKVMeta.shape
        seqused = cute.make_tensor(mKVMeta.iterator, cute.make_layout((rows,), stride=(mKVMeta.stride[0],)))
        table = cute.make_tensor(mKVMeta.iterator + 1,
                                 cute.make_layout((rows, cols - 1), stride=(mKVMeta.stride[0], 1)))
        wl = None if self.wl is None else Int32(self.wl)
        wr = None if self.wr is None else Int32(self.wr)
        self.kernel(mQ, _pool_view(mK, self.heads_first), _pool_view(mV, self.heads_first), mO, mLSE, softmax_scale,
                    mCuSeqlensQ, None, None, seqused, table, wl, wr, None, None, AuxData(), None, None, stream)


class _Fa4PagedVarlen(_Fa4Paged):
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 mKVMeta: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale: Float32, stream):
        self._run(mQ, mK, mV, mCuSeqlensQ, mKVMeta, mO, mLSE, softmax_scale, stream)


def _fakes(spec: KernelSpec):
    """Fake tensors in launcher order (symbolic sizes shared across arguments)."""
    dtype, sym = CUTE_DTYPES[spec.dtype], cute.sym_int
    div = 128 // dtype.width
    b, nq, hq, hkv, cols = sym(), sym(), sym(), sym(), sym()
    if spec.family == "ffpa":
        rows = sym()
        shape = (hkv, rows) if spec.kv_heads_first else (rows, hkv)
    else:
        pages, page_rows = sym(), sym()
        shape = (hkv, pages, page_rows) if spec.kv_heads_first else (pages, page_rows, hkv)
    pool = lambda d: make_fake_tensor(dtype, (*shape, d), divisibility=div)  # noqa: E731
    d, dv = spec.head_dim, spec.head_dim_v
    meta = make_fake_tensor(Int32, (b, cols), divisibility=1)
    if spec.varlen:  # q/out [Tq, H, D], lse [Hq, Tq], cu_seqlens_q [B + 1]
        tq, b1 = sym(), sym()
        return (make_fake_tensor(dtype, (tq, hq, d), divisibility=div), pool(d), pool(dv),
                make_fake_tensor(Int32, (b1,), divisibility=1), meta,
                make_fake_tensor(dtype, (tq, hq, dv), divisibility=div),
                make_fake_tensor(Float32, (hq, tq), divisibility=1))
    return (make_fake_tensor(dtype, (b, nq, hq, d), divisibility=div), pool(d), pool(dv), meta,
            make_fake_tensor(dtype, (b, nq, hq, dv), divisibility=div),
            make_fake_tensor(Float32, (b, hq, nq), divisibility=1))


def compile_paged(spec: KernelSpec, trace: list | None = None):
    """Compile the paged forward launcher of ``spec`` (``page_size`` set); returns a TVM-FFI function.
    ``trace`` (tests): receives the number of FFPA copies the stand-in mapped to the page table."""
    if spec.family == "ffpa":
        base = ffpa_sm90.fwd_class(spec.head_dim)
        kernel = ffpa_sm90._fwd_kernel(spec, type(f"Paged{base.__name__}", (_PagedProducer, base), {}))
        if kernel.tile_n != PAGED_FFPA_TILE or spec.page_size % kernel.tile_n:
            raise NotImplementedError(f"{spec.short_name()}: FFPA's key tile is {kernel.tile_n} rows, "
                                      f"page_size {spec.page_size} must hold whole tiles")
        with _paged_names(spec.page_size // kernel.tile_n) as tracing:
            fn = compile_launcher((_FfpaPagedVarlen if spec.varlen else _FfpaPaged)(kernel, spec), _fakes(spec))
        if trace is not None:
            trace.append(tracing.mapped)
        return fn
    cfg = _tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    if cfg.n_block_size == _FA4_PAGED_BAD_TILE:  # d96 unmasked: the causal config's 128-row key tile instead
        cfg = _tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, True, spec.is_local)
    tile_m, tile_n, threads = cfg.m_block_size, cfg.n_block_size, 384
    if isinstance(spec, SplitFwdSpec):  # the paged split launch's decode tile (pages of exactly tile_n rows)
        tile_m, tile_n, threads = spec.tile_m, spec.tile_n, spec.num_threads
    kernel = FlashAttentionForwardSm90(
        CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, spec.qhead_per_kvhead,
        is_causal=spec.causal, is_local=spec.is_local, pack_gqa=spec.qhead_per_kvhead > 1,
        tile_m=tile_m, tile_n=tile_n, num_stages=2, num_threads=threads, Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs,
        paged_kv_non_tma=spec.page_size != tile_n)
    return compile_launcher((_Fa4PagedVarlen if spec.varlen else _Fa4Paged)(kernel, spec), _fakes(spec))
