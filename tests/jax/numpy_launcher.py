"""A pure-NumPy stand-in for the compiled launchers (dense), registered through jax_tvm_ffi on the
CPU platform, so CI exercises the real FFI plumbing: argument order, aliasing of pre-filled
outputs, workspace, vmap folding. It checks the documented pre-fills on entry."""

from __future__ import annotations

import numpy as np
import tvm_ffi

from tests.shared_queries import shared_query_rows
from xattn.core.spec import KernelSpec

CALLS: list[str] = []
FAIL_NEXT: list[BaseException] = []  # the next launch raises this (a failed launch or allocation), once


def _mask(nq, nk, spec: KernelSpec):
    i = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    left, right = spec.window_left, (0 if spec.causal else spec.window_right)
    m = np.ones((nq, nk), bool)
    if right is not None:
        m &= j <= i + right
    if left is not None:
        m &= j >= i - left
    return m


def _scores(spec, q, k, scale):
    g = spec.qhead_per_kvhead
    kk = np.repeat(k.astype(np.float32), g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float32), kk) * scale
    m = _mask(q.shape[1], k.shape[1], spec)
    return np.where(m, s, -np.inf), m


def _fwd(spec, q, k, v, out, lse, scale):
    s, m = _scores(spec, q, k, scale)
    mx = np.max(s, -1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0.0)
    p = np.exp(s - mx)
    den = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bkhd->bqhd", p / np.where(den > 0, den, 1.0),
                  np.repeat(v.astype(np.float32), spec.qhead_per_kvhead, axis=2))
    out[...] = o.astype(out.dtype)
    lse[...] = np.where(den[..., 0] > 0, np.log(np.where(den[..., 0] > 0, den[..., 0], 1.0)) + mx[..., 0], -np.inf)


def _bwd(spec, dout, q, k, v, out, lse, dq, dk, dv, scale):
    g = spec.qhead_per_kvhead
    s, m = _scores(spec, q, k, scale)
    fin = np.isfinite(lse)[..., None]
    p = np.where(m & fin, np.exp(np.where(m, s, 0.0) - np.where(fin, lse[..., None], 0.0)), 0.0)
    do = dout.astype(np.float32)
    vv = np.repeat(v.astype(np.float32), g, axis=2)
    kk = np.repeat(k.astype(np.float32), g, axis=2)
    dvh = np.einsum("bhqk,bqhd->bkhd", p, do)
    dp = np.einsum("bqhd,bkhd->bhqk", do, vv)
    delta = np.einsum("bqhd,bqhd->bhq", do, out.astype(np.float32))[..., None]
    ds = p * (dp - delta)
    dq[...] = (np.einsum("bhqk,bkhd->bqhd", ds, kk) * scale).astype(dq.dtype)
    dkh = np.einsum("bhqk,bqhd->bkhd", ds, q.astype(np.float32)) * scale
    b, nk, hkv, _ = k.shape
    dk[...] = dkh.reshape(b, nk, hkv, g, -1).sum(3).astype(dk.dtype)
    dv[...] = dvh.reshape(b, nk, hkv, g, -1).sum(3).astype(dv.dtype)


def _varlen(spec, named, scale):
    """Run the dense math per segment on [1, len, H, D] slices (bottom-right per segment)."""
    cu_q, cu_k = named["cu_seqlens_q"], named["cu_seqlens_k"]
    tq, tk = int(cu_q[-1]), int(cu_k[-1])  # as the kernels: no row past cu[-1] is written
    if spec.direction == "fwd":
        named["out"][:tq] = 0
        named["lse"][:, :tq] = -np.inf
    else:
        for n, rows in (("dq", tq), ("dk", tk), ("dv", tk)):
            named[n][:rows] = 0
    for s in range(len(cu_q) - 1):
        qs, qe, ks, ke = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        if qe == qs or ke == ks:
            continue
        sl = {n: named[n][None, qs:qe] for n in ("q", "out", "dout", "dq") if n in named}
        sl.update({n: named[n][None, ks:ke] for n in ("k", "v", "dk", "dv") if n in named})
        lse = named["lse"][:, qs:qe][None]
        if spec.direction == "fwd":
            lse_out = np.empty_like(lse)
            _fwd(spec, sl["q"], sl["k"], sl["v"], sl["out"], lse_out, scale)
            named["lse"][:, qs:qe] = lse_out[0]
        else:
            _bwd(spec, sl["dout"], sl["q"], sl["k"], sl["v"], sl["out"], lse, sl["dq"], sl["dk"], sl["dv"], scale)


def _paged_keys(spec, pool, pages, n):
    """A row's first ``n`` keys ``[1, n, Hkv, D]`` through its page-table entries (any pool layout the launchers
    take: FFPA flat ``[R, H, D]`` / ``[H, R, D]``, FA4 ``[NP, PS, H, D]`` / ``[H, NP, PS, D]``)."""
    ps = spec.page_size
    if spec.kv_heads_first:
        pool = np.moveaxis(pool, 0, -2)  # [R, H, D] or [NP, PS, H, D]
    if pool.ndim == 3:
        pool = pool.reshape(-1, ps, *pool.shape[-2:])
    return pool[np.asarray(pages, dtype=np.int64)].reshape(-1, *pool.shape[-2:])[:n][None]


def _paged(spec, named, scale):
    """Each row's queries on its kv_meta keys (dense: batch rows; varlen: cu_seqlens_q segments)."""
    meta = named["kv_meta"]
    ps = spec.page_size
    for b in range(meta.shape[0]):
        n = int(meta[b, 0])
        if spec.varlen:
            a, z = int(named["cu_seqlens_q"][b]), int(named["cu_seqlens_q"][b + 1])
            q, out, lse = named["q"][None, a:z], named["out"][None, a:z], named["lse"][:, a:z][None]
        else:
            q, out, lse = named["q"][b:b + 1], named["out"][b:b + 1], named["lse"][b:b + 1]
        if n == 0 or q.shape[1] == 0:
            out[...] = 0
            lse[...] = -np.inf
            continue
        pages = meta[b, 1:1 + -(-n // ps)]
        k, v = (_paged_keys(spec, named[x], pages, n) for x in ("k_pages", "v_pages"))
        lse_out = np.empty(lse.shape, np.float32)
        _fwd(spec, q, k, v, out, lse_out, scale)
        lse[...] = lse_out


def make(spec: KernelSpec):
    """A tvm_ffi function with the launcher's signature for ``spec``."""
    fills = spec.output_fill()
    if spec.page_size is not None:
        names = ["q", "k_pages", "v_pages"] + (["cu_seqlens_q"] if spec.varlen else []) + ["kv_meta", "out", "lse"]
    elif spec.direction == "fwd":
        names = ["q", "k", "v"] + (["cu_seqlens_q", "cu_seqlens_k"] if spec.varlen else []) + ["out", "lse"]
    else:
        names = (["dout", "q", "k", "v", "out", "lse"] + (["cu_seqlens_q", "cu_seqlens_k"] if spec.varlen else [])
                 + ["dq", "dk", "dv"])

    def launcher(*args):
        if FAIL_NEXT:
            raise FAIL_NEXT.pop(0)
        *tensors, scale = args
        named = dict(zip(names, [np.from_dlpack(t) for t in tensors]))
        for name, value in fills.items():  # the documented pre-fill must have happened (aliasing)
            assert np.all(named[name] == value), f"{name} was not pre-filled with {value}"
        CALLS.append(f"{spec.direction}:{named['q'].shape}" + (":paged" if spec.page_size else "")
                     + (":shared-q" if getattr(spec, "shared_q", False) else ""))
        if getattr(spec, "shared_q", False):  # the split launch reading q's own rows: as one q per slot
            named["q"] = named["q"][shared_query_rows(named["cu_seqlens_q"].tolist(), named["q"].shape[0])]
        if spec.page_size is not None:
            _paged(spec, named, float(scale))
        elif spec.varlen:
            _varlen(spec, named, float(scale))
        elif spec.direction == "fwd":
            _fwd(spec, *(named[n] for n in names), float(scale))
        else:
            _bwd(spec, *(named[n] for n in names), float(scale))

    return tvm_ffi.convert(launcher)


def provider(spec: KernelSpec):
    return make(spec), "cpu"
