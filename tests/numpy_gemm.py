"""NumPy stand-ins for the chunked backward's GEMM launchers (xattn.core.gemm_sm90): the same
parameter order, math and extents (the key-length operands may be longer than the block: only their
first rows are read, and ``acc`` writes only D's first rows). Registered on the CPU platform through
jax_tvm_ffi they run the JAX driver's blocks, padding, aliasing and FFI plumbing without a GPU;
handed to :class:`xattn.torch.gemm_bwd.CoreGemms` they take the torch driver's views (strided,
in place) through TVM-FFI the same way."""

from __future__ import annotations

import numpy as np
import tvm_ffi

from xattn.core.gemm_bwd_epilogues import MASK_PENALTY
from xattn.core.gemm_sm90 import GemmSpec

CALLS: list[str] = []


def _f(x):
    return np.from_dlpack(x).astype(np.float32)


def _check_layouts(kind, args) -> None:
    """What the compiled launchers refuse (TVM-FFI's argument checks) or TMA cannot take: a tensor
    whose last stride is not 1 (row vectors included), one whose start or other strides are not
    16-byte aligned (views at an offset: the diagonal pieces), and acc's C and D of different lengths."""
    arrays = [np.from_dlpack(a) for a in args if hasattr(a, "__dlpack__")]
    for n, x in enumerate(arrays):
        if x.dtype == np.int32:  # the packed route's tables: plain loads, any stride
            continue
        if x.size and x.strides[-1] != x.itemsize:
            raise ValueError(f"{kind}: tensor #{n} has last stride {x.strides[-1] // x.itemsize}, expected 1")
        if x.size and (x.ctypes.data % 16 or any(st % 16 for st, e in zip(x.strides[:-1], x.shape[:-1]) if e > 1)):
            raise ValueError(f"{kind}: tensor #{n} starts or strides off 16 bytes ({x.ctypes.data % 16}, "
                             f"{x.strides})")
    if kind == "acc" and arrays[2].shape[1] != arrays[3].shape[1]:
        raise ValueError(f"{kind}: C has {arrays[2].shape[1]} rows, D {arrays[3].shape[1]}: expected to match")


SEG_TILE_ROWS = 256  # seg_acc stores whole clusters of two 128-row tiles (xattn.core.gemm_segments_sm90)


def _pieces(tables, cu_rows):
    """``(p, first scratch row, rows, table column)`` of the pieces with rows."""
    t, cu = np.from_dlpack(tables), np.from_dlpack(cu_rows)
    return [(p, int(cu[p]), int(cu[p + 1] - cu[p]), t[:, p]) for p in range(len(cu) - 1) if cu[p + 1] > cu[p]]


def _doc_keys(keys, start, kend):
    k = np.from_dlpack(keys)
    if start + kend > k.shape[0]:
        raise ValueError(f"the key view reads rows [{start}, {start + kend}) of {k.shape[0]}: no spare rows")
    return k[start:start + kend].astype(np.float32)


def _segment(kind, args) -> None:
    """The packed route's launchers (xattn.core.gemm_segments_sm90): per piece, what the kernels compute,
    including the whole 256-row tiles seg_acc stores past a piece's keys (C + 0 there)."""
    if kind == "seg_probs":
        q, k, tables, cu, rowbias, rowpos, colpos, d, pf, scale_log2, _ = args
        kend = d.shape[1]
        for _, r0, n, col in _pieces(tables, cu):
            s = _f(q)[col[0]:col[0] + n] @ _doc_keys(k, col[1], kend).T * float(scale_log2)
            s += _f(rowbias)[r0:r0 + n, None]
            s -= MASK_PENALTY * np.maximum(_f(colpos)[None, :kend] - _f(rowpos)[r0:r0 + n, None], 0)
            np.from_dlpack(d)[r0:r0 + n] = np.from_dlpack(pf)[r0:r0 + n] = np.exp2(s)
    elif kind == "seg_grad_scores":
        do, v, tables, cu, pf, delta, d, scale, _ = args
        kend = d.shape[1]
        for _, r0, n, col in _pieces(tables, cu):
            dp = _f(do)[col[0]:col[0] + n] @ _doc_keys(v, col[1], kend).T
            np.from_dlpack(d)[r0:r0 + n] = (dp - _f(delta)[r0:r0 + n, None]) * _f(pf)[r0:r0 + n] * float(scale)
    elif kind == "seg_mm_dq":
        ds, k, tables, cu, dq_in, dq, _ = args
        for _, r0, n, col in _pieces(tables, cu):
            np.from_dlpack(dq)[col[0]:col[0] + n] = _f(ds)[r0:r0 + n] @ _doc_keys(k, col[1], ds.shape[1])
    else:  # seg_acc
        x, y, tables, cu, c, d, _ = args
        kend, t = x.shape[1], np.from_dlpack(tables)
        for p, r0, n, col in _pieces(tables, cu):
            keys = int(t[3, p + 1] - t[3, p])
            if keys == 0:
                continue
            m = -(-keys // SEG_TILE_ROWS) * SEG_TILE_ROWS
            xt = np.zeros((m, n), np.float32)
            xt[:min(m, kend)] = _f(x)[r0:r0 + n, :m].T
            acc = np.from_dlpack(d)
            stop = min(col[2] + m, acc.shape[0])
            acc[col[2]:stop] = (xt @ _f(y)[col[0]:col[0] + n] + _f(c)[col[2]:col[2] + m])[:stop - col[2]]


def make(spec: GemmSpec):
    def launcher(*args):
        CALLS.append(spec.kind)
        _check_layouts(spec.kind, args)
        if spec.kind.startswith("seg_"):
            _segment(spec.kind, args)
        elif spec.kind == "probs_causal":
            a, b, rowbias, rowpos, colpos, d, pf, scale_log2, _ = args
            n = d.shape[2]
            x = np.einsum("lmk,lnk->lmn", _f(a), _f(b)[:, :n]) * float(scale_log2) + _f(rowbias)[:, :, None]
            x = x - MASK_PENALTY * np.maximum(_f(colpos)[:, None, :n] - _f(rowpos)[:, :, None], 0)
            p = np.exp2(x)
            np.from_dlpack(pf)[...] = p
            np.from_dlpack(d)[...] = p
        elif spec.kind == "probs_full":
            a, b, rowbias, d, pf, scale_log2, _ = args
            s = np.einsum("lmk,lnk->lmn", _f(a), _f(b)[:, : d.shape[2]])
            p = np.exp2(s * float(scale_log2) + _f(rowbias)[:, :, None])
            np.from_dlpack(pf)[...] = p
            np.from_dlpack(d)[...] = p
        elif spec.kind == "grad_scores":
            a, b, pf, delta, d, scale, _ = args
            dp = np.einsum("lmk,lnk->lmn", _f(a), _f(b)[:, : d.shape[2]])
            np.from_dlpack(d)[...] = (dp - _f(delta)[:, :, None]) * _f(pf) * float(scale)
        elif spec.kind == "acc":
            x, y, c, d, c_rows, _ = args
            m = x.shape[2]
            if not 1 <= c_rows <= m:
                raise ValueError(f"acc: c_rows {c_rows} outside [1, {m}]")
            added = np.zeros((c.shape[0], m, c.shape[2]), np.float32)
            added[:, :c_rows] = _f(c)[:, :c_rows]  # the launcher's TMA box ends at c_rows: zeros past it
            np.from_dlpack(d)[:, :m] = np.einsum("lkm,lkn->lmn", _f(x), _f(y)) + added
        elif spec.kind == "mm_dq":
            x, y, d, _ = args
            np.from_dlpack(d)[...] = np.einsum("lmk,lkn->lmn", _f(x), _f(y)[:, : x.shape[2]])
        else:
            x, y, d, _ = args
            np.from_dlpack(d)[:, : x.shape[2]] = np.einsum("lkm,lkn->lmn", _f(x), _f(y))

    return tvm_ffi.convert(launcher)


def provider(fallback):
    """A launcher provider: GEMM specs get these stand-ins, everything else ``fallback(spec)``."""
    def get(spec):
        if isinstance(spec, GemmSpec):
            return make(spec), "cpu"
        return fallback(spec)
    return get
