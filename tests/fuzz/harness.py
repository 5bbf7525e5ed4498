"""Run one fuzz configuration through a front end and judge it against fp64.

Front ends (``Config.front_end``):

* ``core``: ``xattn.core`` ffpa/fa4 fwd + bwd on torch buffers the harness allocates (outputs in the
  drawn layouts, NaN-poisoned except the documented pre-fills; workspace from ``bwd_workspace``,
  NaN-poisoned except its ``fill``), on the current or an explicit stream;
* ``core-jax``: the same core calls with every read-only buffer a JAX array through DLPack (q, k, v,
  dout, out and lse of the backward, cu_seqlens) and torch outputs, passed as torch tensors or as raw
  ``tvm_ffi.Tensor`` views (the core refuses JAX arrays as outputs: they are immutable);
* ``torch``: ``xattn.torch.attention_with_lse`` (or, for FA4, ``xattn.torch.fa4_interface.flash_attn_func`` /
  ``flash_attn_varlen_func``) with autograd;
* ``jax``: ``xattn.jax.ffpa_attention`` / ``flash_attention`` / ``varlen_attention`` under ``jax.vjp``
  (eagerly or under ``jax.jit``), lse from ``ffpa_fwd`` / ``fa4_fwd`` / ``varlen_fwd``; the kernels, or
  with the option ``backend="reference"`` (the CPU slice) xattn.jax's own pure-jnp path.

Buffer layouts (``Config.layout``): ``contiguous``; ``swapped`` (``[B, H, N, D]`` / ``[H, T, D]``
storage viewed as ``[B, N, H, D]`` / ``[T, H, D]``, what Hugging Face hands over); ``padded:P`` (head
dim stored with P extra elements, NaN); ``wide:E:O`` (heads O..O+H of storage with H+E heads, NaN
around). JAX arrays are compact: for ``jax``, ``swapped`` means the function is given
``[B, H, N, D]`` arrays and transposes them itself.

Routes: for ``torch`` draws also ``paged`` (the same keys in shuffled pages, ``xt.paged_attention``, out and
lse only; packed draws as vLLM's varlen call) and ``kvcache:fused`` / ``kvcache:split-kv`` (FlashAttention's
``flash_attn_with_kvcache`` call, ``xt.attention_with_kvcache`` with per-sequence device lengths and appended keys,
each forward route forced where it can serve; out and lse only); for ``jax`` decoding draws (one query, no
window) ``paged`` as Pallas' ``paged_attention`` call (out only); for ``torch`` and ``jax`` every backward route
that can serve the configuration (:func:`xattn.core.routes.serving_routes` of the problem as that front end
describes it: host lengths for torch, traced ones for JAX) runs forced, one after the other, each judged on its
own (checks named ``dq@gemm-padded``); ``core`` and ``core-jax`` call the fused kernels directly (route ``fused``).

``CORE`` holds the core entry points; the CPU tests swap in the fp64 stand-ins of
``tests/torch/stubs.py`` to run the whole harness without a GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import torch

import xattn.core as xc
from tests.reference import attention as ref_attention, varlen_attention as ref_varlen

from .space import FORM_FRONT_ENDS, Config
from .tolerance import Check, compare, lowprec_attention, lowprec_varlen_attention

__all__ = ["CORE", "RUNNERS", "Inputs", "make_inputs", "place", "evaluate", "run_one", "QUANTITIES", "routes_of",
           "quantities_of"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTITIES = ("out", "lse", "dq", "dk", "dv")
CORE = {"ffpa_fwd": xc.ffpa_fwd, "ffpa_bwd": xc.ffpa_bwd, "fa4_fwd": xc.fa4_fwd, "fa4_bwd": xc.fa4_bwd}
NAN = float("nan")


@dataclass
class Inputs:
    """Logical tensors (dense ``[B, N, H, D]`` or varlen ``[T, H, D]``) in their drawn layouts."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None


def place(t: torch.Tensor, layout: str, fill: float = NAN) -> torch.Tensor:
    """A view equal to ``t`` whose storage is laid out as ``layout`` says (module docstring)."""
    kind, *args = layout.split(":")
    if kind == "contiguous":
        return t.contiguous()
    if kind == "swapped":
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)
    if kind == "padded":
        d = t.shape[-1]
        buf = torch.full((*t.shape[:-1], d + int(args[0])), fill, dtype=t.dtype, device=t.device)
        buf[..., :d] = t
        return buf[..., :d]
    if kind == "wide":
        extra, off = int(args[0]), int(args[1])
        h = t.shape[-2]
        buf = torch.full((*t.shape[:-2], h + extra, t.shape[-1]), fill, dtype=t.dtype, device=t.device)
        buf[..., off:off + h, :] = t
        return buf[..., off:off + h, :]
    raise ValueError(f"unknown layout {layout!r}")


def _cu(lengths, device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def shapes(cfg: Config) -> dict[str, tuple]:
    e = cfg.entry
    lead_q = (cfg.total_q,) if cfg.varlen else (cfg.batch, cfg.seqlen_q)
    lead_k = (cfg.total_k,) if cfg.varlen else (cfg.batch, cfg.seqlen_k)
    lse = (cfg.heads_q, cfg.total_q) if cfg.varlen else (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    return {"q": (*lead_q, cfg.heads_q, e.head_dim), "k": (*lead_k, cfg.heads_kv, e.head_dim),
            "v": (*lead_k, cfg.heads_kv, e.head_dim_v), "out": (*lead_q, cfg.heads_q, e.head_dim_v),
            "dout": (*lead_q, cfg.heads_q, e.head_dim_v), "lse": lse}


def make_inputs(cfg: Config, device) -> Inputs:
    """Seeded ``randn`` q, k, v, dout (from ``cfg.seed``) in the drawn layouts, and cu_seqlens."""
    dt = DTYPES[cfg.entry.dtype]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    sh = shapes(cfg)
    fresh = {n: torch.randn(sh[n], generator=gen, device=device, dtype=dt) for n in ("q", "k", "v", "dout")}
    placed = {n: place(t, cfg.layout(n)) if cfg.front_end != "jax" else t for n, t in fresh.items()}
    cu = (None, None)
    if cfg.varlen:
        cu_q = _cu(cfg.lens_q, device)
        cu = (cu_q, cu_q if cfg.opt("same_cu") else _cu(cfg.lens_k, device))  # one object, or two
    return Inputs(placed["q"], placed["k"], placed["v"], placed["dout"], *cu)


def _mask_args(cfg: Config):
    """``(causal, window)`` as the front end is called: the entry's canonical form, or the drawn spelling
    of the same mask (``space.spellings``), or the refused form being tried (``space.refusals``)."""
    form = cfg.opt("refuse") or cfg.opt("spelling")
    return (form[0], form[1]) if form else (cfg.entry.causal, cfg.entry.window)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --- front ends: each returns {out, lse, dq, dk, dv} as torch tensors in the logical layout ------------

def _core_kwargs(cfg: Config, inp_cu, device) -> dict:
    causal, window = _mask_args(cfg)
    kw = dict(softmax_scale=cfg.scale, causal=causal, window_size=window)
    if cfg.varlen:
        kw.update(cu_seqlens_q=inp_cu[0], cu_seqlens_k=inp_cu[1], max_seqlen_q=cfg.seqlen_q,
                  max_seqlen_k=cfg.seqlen_k)
    if cfg.opt("stream") == "explicit" and torch.device(device).type == "cuda":
        kw["stream"] = torch.cuda.current_stream().cuda_stream
    return kw


def _core_buffers(cfg: Config, direction: str, device) -> dict:
    spec = cfg.specs()[0 if direction == "fwd" else 1]
    fills = spec.output_fill()
    names = ("out", "lse") if direction == "fwd" else ("dq", "dk", "dv")
    src = {"out": "out", "lse": "lse", "dq": "q", "dk": "k", "dv": "v"}
    sh = shapes(cfg)
    out = {}
    for n in names:
        dtype = torch.float32 if n == "lse" else DTYPES[cfg.entry.dtype]
        t = torch.full(sh[src[n]], fills.get(n, NAN), dtype=dtype, device=device)
        out[n] = place(t, cfg.layout(n), fill=fills.get(n, NAN))
    return out


def _workspace(cfg: Config, q_shape, k_shape, device) -> list[torch.Tensor]:
    causal, window = _mask_args(cfg)
    layout = xc.bwd_workspace(cfg.entry.family, q_shape, k_shape, head_dim_v=cfg.entry.head_dim_v,
                              causal=causal, window_size=window, num_seqs=cfg.batch if cfg.varlen else None)
    return [torch.full(shape, NAN if fill is None else fill, dtype=torch.float32, device=device)
            for _, shape, _, fill in layout]


def run_core(cfg: Config, inp: Inputs, device) -> dict:
    fam = cfg.entry.family
    kw = _core_kwargs(cfg, (inp.cu_q, inp.cu_k), device)
    fwd = _core_buffers(cfg, "fwd", device)
    CORE[f"{fam}_fwd"](inp.q, inp.k, inp.v, fwd["out"], fwd["lse"], **kw)
    bwd = _core_buffers(cfg, "bwd", device)
    ws = _workspace(cfg, inp.q.shape, inp.k.shape, device)
    CORE[f"{fam}_bwd"](inp.dout, inp.q, inp.k, inp.v, fwd["out"], fwd["lse"], bwd["dq"], bwd["dk"], bwd["dv"],
                       workspace=ws, **kw)
    return {**fwd, **bwd}


def _to_jax(t: torch.Tensor):
    import jax.numpy as jnp

    return jnp.from_dlpack(t.contiguous())


def run_core_jax(cfg: Config, inp: Inputs, device) -> dict:
    """Core calls with JAX arrays for every input; outputs torch (or raw tvm_ffi views of torch)."""
    import jax
    import tvm_ffi

    fam = cfg.entry.family
    _sync(device)
    jq, jk, jv, jdo = (_to_jax(t) for t in (inp.q, inp.k, inp.v, inp.dout))
    cu = (_to_jax(inp.cu_q), _to_jax(inp.cu_k)) if cfg.varlen else (None, None)
    jax.block_until_ready([x for x in (jq, jk, jv, jdo, *cu) if x is not None])
    kw = _core_kwargs(cfg, cu, device)
    view = tvm_ffi.from_dlpack if cfg.opt("outputs") == "tvm_ffi" else (lambda t: t)
    fwd = _core_buffers(cfg, "fwd", device)
    CORE[f"{fam}_fwd"](jq, jk, jv, view(fwd["out"]), view(fwd["lse"]), **kw)
    _sync(device)
    jout, jlse = _to_jax(fwd["out"]), _to_jax(fwd["lse"])
    jax.block_until_ready([jout, jlse])
    bwd = _core_buffers(cfg, "bwd", device)
    ws = [view(w) for w in _workspace(cfg, inp.q.shape, inp.k.shape, device)]
    CORE[f"{fam}_bwd"](jdo, jq, jk, jv, jout, jlse, view(bwd["dq"]), view(bwd["dk"]), view(bwd["dv"]),
                       workspace=ws, **kw)
    _sync(device)
    return {**fwd, **bwd}


def run_torch(cfg: Config, inp: Inputs, device) -> dict:
    import xattn.torch as xt

    e = cfg.entry
    q, k, v = (t.detach().requires_grad_() for t in (inp.q, inp.k, inp.v))  # same strides as drawn
    causal, window = _mask_args(cfg)
    loose = _loose(cfg)
    if cfg.opt("entry") == "flash_attn_func":
        from xattn.torch.fa4_interface import flash_attn_func, flash_attn_varlen_func

        if cfg.varlen:  # loose: let the helper find the longest document itself (a host read)
            out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=inp.cu_q, cu_seqlens_k=inp.cu_k,
                                              max_seqlen_q=None if loose else cfg.seqlen_q,
                                              max_seqlen_k=None if loose else cfg.seqlen_k,
                                              softmax_scale=cfg.scale, causal=causal, window_size=window)
        else:
            out, lse = flash_attn_func(q, k, v, softmax_scale=cfg.scale, causal=causal, window_size=window)
    else:
        kw = {}
        if cfg.varlen:  # loose: an upper bound larger than the longest document (allowed)
            kw = dict(cu_seqlens_q=inp.cu_q, cu_seqlens_k=inp.cu_k, max_seqlen_q=_torch_max_seqlen(cfg)[0],
                      max_seqlen_k=_torch_max_seqlen(cfg)[1])
        default_scale = cfg.scale == 1.0 / math.sqrt(e.head_dim)
        out, lse = xt.attention_with_lse(q, k, v, softmax_scale=None if default_scale else cfg.scale,
                                         causal=causal, window_size=window,
                                         family=e.family if cfg.opt("family") == "explicit" else None, **kw)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inp.dout)
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _loose(cfg: Config) -> bool:
    return cfg.opt("max_seqlen") == "loose"


def _torch_max_seqlen(cfg: Config) -> tuple[int, int]:
    """The max_seqlen_q/k a torch varlen call passes (the kernels see): the drawn ones, with the option "loose" a
    bound larger still (``attention_with_lse``) or none, the helper finding the longest documents (FA4's spelling)."""
    if not _loose(cfg):
        return cfg.seqlen_q, cfg.seqlen_k
    if cfg.opt("entry") == "flash_attn_func":
        return max(cfg.lens_q), max(cfg.lens_k)
    return cfg.seqlen_q + 13, cfg.seqlen_k + 7


def run_jax(cfg: Config, inp: Inputs, device) -> dict:
    import jax
    import jax.numpy as jnp

    import xattn.jax as xj

    e = cfg.entry
    swapped = [n for n in ("q", "k", "v") if cfg.layout(n) == "swapped" and not cfg.varlen]
    _sync(device)
    arrays = {n: _to_jax(getattr(inp, n)) for n in ("q", "k", "v", "dout")}
    for n in swapped:  # the caller holds [B, H, N, D]; the differentiated function transposes
        arrays[n] = jnp.swapaxes(arrays[n], 1, 2)
    causal, window = _mask_args(cfg)
    kw = dict(scale=cfg.scale, causal=causal, backend=cfg.opt("backend", "kernel"))
    if cfg.varlen:
        cu_q = _to_jax(inp.cu_q)
        cu_k = cu_q if inp.cu_k is inp.cu_q else _to_jax(inp.cu_k)  # one object: the self-attention routes
        vkw = dict(kw, max_seqlen_q=cfg.seqlen_q, max_seqlen_k=cfg.seqlen_k, family=e.family, window_size=window)

        def attn(q, k, v):
            return xj.varlen_attention(q, k, v, cu_q, cu_k, **vkw)

        def lse_of(q, k, v):
            return xj.varlen_fwd(q, k, v, cu_q, cu_k, **vkw)[1]
    else:
        dense = xj.ffpa_attention if e.family == "ffpa" else xj.flash_attention
        low = xj.ffpa_fwd if e.family == "ffpa" else xj.fa4_fwd
        wkw = {} if e.family == "ffpa" else dict(window_size=window)

        def unswap(q, k, v):
            return [jnp.swapaxes(x, 1, 2) if n in swapped else x for n, x in zip("qkv", (q, k, v))]

        def attn(q, k, v):
            return dense(*unswap(q, k, v), **kw, **wkw)

        def lse_of(q, k, v):
            return low(*unswap(q, k, v), **kw, **wkw)[1]

    def step(q, k, v, dout):
        out, pull = jax.vjp(attn, q, k, v)
        return (out, lse_of(q, k, v), *pull(dout))

    if cfg.opt("jit"):
        step = jax.jit(step)
    res = jax.block_until_ready(step(arrays["q"], arrays["k"], arrays["v"], arrays["dout"]))
    got = dict(zip(QUANTITIES, res))
    for n in swapped:
        got["d" + n] = jnp.swapaxes(got["d" + n], 1, 2)
    return {n: torch.from_dlpack(jax.block_until_ready(x)).to(device) for n, x in got.items()}


RUNNERS = {"core": run_core, "core-jax": run_core_jax, "torch": run_torch, "jax": run_jax}
# the paged route's page sizes, one drawn per configuration (page_size): FFPA one and four of its 64-row key tiles;
# FA4 16 (cp.async) and 128 (its key tile at head dims 64-128 and 192x128: TMA per page; cp.async elsewhere)
PAGE_SIZES = {"ffpa": (64, 256), "fa4": (16, 128)}


def page_size(cfg: Config) -> int:
    """The page size of ``cfg``'s paged route, from a side generator (the draw itself stays as it was)."""
    import random

    return random.Random(f"{cfg.seed}:page").choice(PAGE_SIZES[cfg.entry.family])


def run_torch_paged(cfg: Config, inp: Inputs, device) -> dict:
    """The paged route (issue #44) on the same keys: each sequence's keys copied into pools of shuffled pages with
    spare ones (finite random values in every row past the keys), ``xt.paged_attention`` (forward only: out, lse);
    packed draws make vLLM's call (``cu_seqlens_q``, ``max_seqlen_q`` as the varlen call passes it: decoding
    batches take the split route over the pages)."""
    import xattn.torch as xt

    e = cfg.entry
    ps = page_size(cfg)
    if cfg.varlen:
        cu_k = inp.cu_k.tolist()
        keys = [(inp.k[a:z], inp.v[a:z]) for a, z in zip(cu_k, cu_k[1:])]
    else:
        keys = [(inp.k[i], inp.v[i]) for i in range(inp.k.shape[0])]
    b, nk = len(keys), max(len(k) for k, _ in keys)
    per = max(1, -(-nk // ps))
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 1)
    num_pages = b * per + 3
    pools = [torch.randn(num_pages, ps, *t.shape[-2:], generator=gen, device=device, dtype=t.dtype)
             for t in (inp.k, inp.v)]
    table = torch.randperm(num_pages, generator=gen, device=device)[:b * per].view(b, per).to(torch.int32)
    for i, seq in enumerate(keys):
        for pool, t in zip(pools, seq):
            rows = pool[table[i].long()].flatten(0, 1)
            rows[:len(t)] = t
            pool[table[i].long()] = rows.view(per, ps, *t.shape[1:])
    causal, window = _mask_args(cfg)
    lengths = torch.tensor([len(k) for k, _ in keys], dtype=torch.int32, device=device)
    packed = dict(cu_seqlens_q=inp.cu_q, max_seqlen_q=_torch_max_seqlen(cfg)[0]) if cfg.varlen else {}
    out, lse = xt.paged_attention(inp.q, pools[0], pools[1], table, lengths, softmax_scale=cfg.scale, causal=causal,
                                  window_size=window, return_softmax_lse=True, family=e.family, **packed)
    return {"out": out, "lse": lse}


def _kvcache_plan(cfg: Config) -> tuple[list, list, int, int, int, bool]:
    """``(lens_q, lens_k, Nq, capacity, appended, heads_major)`` of ``cfg``'s KV-cache call, from a side generator:
    per-sequence query and key counts (a dense draw: B equal ones), the queries per sequence of the dense call
    (the longest document's), the cache rows (the longest keys and 0-40 spare ones), the keys the call appends
    (``k``/``v``: 0 or up to the fewest keys, at most Nq) and whether the cache is HF's heads-major one."""
    import random

    lens_q = list(cfg.lens_q) if cfg.varlen else [cfg.seqlen_q] * cfg.batch
    lens_k = list(cfg.lens_k) if cfg.varlen else [cfg.seqlen_k] * cfg.batch
    side = random.Random(f"{cfg.seed}:kvcache")
    nq = max(lens_q, default=0)
    capacity = max(lens_k, default=0) + side.choice([0, 0, 1, 9, 40])
    appended = side.choice([0, 0, min([nq, *lens_k])])
    return lens_q, lens_k, nq, capacity, appended, side.random() < 0.3


def kvcache_refused(cfg: Config) -> str | None:
    """Why FlashAttention's ``flash_attn_with_kvcache`` cannot express ``cfg`` (None: it can): it needs one or more
    sequences and a query in some sequence (each sequence is the dense call's ``Nq`` rows)."""
    lens_q, _, nq, _, _, _ = _kvcache_plan(cfg)
    if not lens_q or nq == 0:
        return "no query in any sequence"
    return None


def _kvcache_call(cfg: Config, inp: Inputs, device, compact: bool = False):
    """The KV-cache call's buffers (torch, on ``device``): ``(q [B, Nq, Hq, D], k_cache, v_cache, k, v, lengths,
    expected)``: each sequence's keys in a cache of spare rows (finite random values past its length; in the draws
    of :func:`_kvcache_plan` that say so, HF's heads-major cache transposed, unless ``compact``: JAX arrays), its
    last ``appended`` keys as k/v ``[B, appended, Hkv, D]`` (None when 0) with ``lengths = L - appended``, and the
    caches as they must read after the append. A packed draw is the dense problem of ``Nq`` = its longest document's
    queries: document b's queries in the last rows of its Nq (so the bottom-right alignment holds), random rows
    before them."""
    e = cfg.entry
    lens_q, lens_k, nq, capacity, appended, heads_major = _kvcache_plan(cfg)
    heads_major = heads_major and not compact
    b, hq, hkv = len(lens_q), cfg.heads_q, cfg.heads_kv
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    dt = inp.q.dtype
    q = torch.randn(b, nq, hq, e.head_dim, generator=gen, device=device, dtype=dt)
    caches = []
    for d in (e.head_dim, e.head_dim_v):
        shape = (b, hkv, capacity, d) if heads_major else (b, capacity, hkv, d)
        cache = torch.randn(shape, generator=gen, device=device, dtype=dt)
        caches.append(cache.transpose(1, 2) if heads_major else cache)
    expected = [c.clone() for c in caches]
    new = [torch.empty(b, appended, hkv, d, device=device, dtype=dt) for d in (e.head_dim, e.head_dim_v)]
    cu_q, cu_k = [0, *itertools.accumulate(lens_q)], [0, *itertools.accumulate(lens_k)]
    for i in range(b):
        q[i, nq - lens_q[i]:] = inp.q[cu_q[i]:cu_q[i + 1]] if cfg.varlen else inp.q[i]
        kept = lens_k[i] - appended
        for cache, full, rows_new, t in zip(caches, expected, new, (inp.k, inp.v)):
            keys = t[cu_k[i]:cu_k[i + 1]] if cfg.varlen else t[i]
            cache[i, :kept] = keys[:kept]
            full[i, :lens_k[i]] = keys
            rows_new[i] = keys[kept:]
    lengths = torch.tensor([n - appended for n in lens_k], dtype=torch.int32, device=device)
    k, v = new if appended else (None, None)
    return q, caches[0], caches[1], k, v, lengths, expected


def _kvcache_result(cfg: Config, out, lse, caches, expected) -> dict:
    """out/lse of the KV-cache call in ``cfg``'s layout (packed: each document's rows, rows past
    ``cu_seqlens_q[-1]`` out 0 and lse -inf, as the packed call's); AssertionError if the caches do not read
    ``expected`` after the append (the rows past each length as they were, the appended ones written)."""
    for got, want, name in zip(caches, expected, ("k_cache", "v_cache")):
        if not torch.equal(got, want):
            raise AssertionError(f"kvcache: {name} after the call differs from its keys with the new rows appended")
    if not cfg.varlen:
        return {"out": out, "lse": lse}
    lens_q, _, nq, _, _, _ = _kvcache_plan(cfg)
    got_out = torch.zeros(cfg.total_q, *out.shape[2:], device=out.device, dtype=out.dtype)
    got_lse = torch.full((lse.shape[1], cfg.total_q), float("-inf"), device=lse.device, dtype=lse.dtype)
    cu_q = [0, *itertools.accumulate(lens_q)]
    for i, n in enumerate(lens_q):
        got_out[cu_q[i]:cu_q[i + 1]] = out[i, nq - n:]
        got_lse[:, cu_q[i]:cu_q[i + 1]] = lse[i, :, nq - n:]
    return {"out": got_out, "lse": got_lse}


def run_torch_kvcache(cfg: Config, inp: Inputs, device) -> dict:
    """The KV-cache call (issue #43, FlashAttention's ``flash_attn_with_kvcache`` names): ``xt.attention_with_kvcache``
    with per-sequence device lengths on the buffers of :func:`_kvcache_call` (HF's heads-major cache in some draws),
    appending in place. Forward only: out and lse (:func:`_kvcache_result`)."""
    import xattn.torch as xt

    q, k_cache, v_cache, k, v, lengths, expected = _kvcache_call(cfg, inp, device)
    causal, window = _mask_args(cfg)
    out, lse = xt.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, softmax_scale=cfg.scale,
                                         causal=causal, window_size=window, return_softmax_lse=True,
                                         family=cfg.entry.family)
    return _kvcache_result(cfg, out, lse, (k_cache, v_cache), expected)


def run_jax_kvcache(cfg: Config, inp: Inputs, device) -> dict:
    """The KV-cache call of JAX: ``xattn.jax.attention_with_kvcache`` on the buffers of :func:`_kvcache_call`
    (compact arrays), lengths traced under the option ``jit``, the caches returned updated. Forward only: out and
    lse (:func:`_kvcache_result`)."""
    import jax

    import xattn.jax as xj

    q, k_cache, v_cache, k, v, lengths, expected = _kvcache_call(cfg, inp, device, compact=True)
    causal, window = _mask_args(cfg)
    kw = dict(scale=cfg.scale, causal=causal, window_size=window, return_softmax_lse=True, family=cfg.entry.family,
              backend=cfg.opt("backend", "kernel"))

    def call(q, k_cache, v_cache, k, v, lengths):
        return xj.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lengths, **kw)

    fn = jax.jit(call) if cfg.opt("jit") else call
    _sync(device)
    res = jax.block_until_ready(fn(*(None if t is None else _to_jax(t) for t in (q, k_cache, v_cache, k, v,
                                                                                  lengths))))
    out, lse, k_new, v_new = (torch.from_dlpack(x).to(device) for x in res)
    return _kvcache_result(cfg, out, lse, (k_new, v_new), expected)


def _kvcache_problem(cfg: Config):
    """The KV-cache call's forward as :func:`xattn.core.routes.forward_route` sees it (per-sequence device lengths)."""
    from xattn.core import routes

    e = cfg.entry
    lens_q, _, nq, capacity, _, _ = _kvcache_plan(cfg)
    return routes.FwdProblem(e.family, len(lens_q), cfg.heads_kv, e.g, nq, capacity, causal=e.causal,
                             local=e.window != (None, None), flat_kv=True, traced=True)


def run_jax_paged(cfg: Config, inp: Inputs, device) -> tuple[dict, Config, Inputs]:
    """The paged route of a JAX decoding draw (one query per sequence, no window: the calls Pallas' GPU
    ``paged_attention`` serves): k/v in heads-first pools ``[Hkv, pages, page_size, D]`` of shuffled pages with spare
    ones (random values in every row past the keys), ``xattn.jax.paged_attention`` (jitted under the option
    ``jit``). The peer has no scale: q is pre-scaled in its dtype, so the verdict's reference is of that q at
    scale 1. Returns ``(got, cfg, inputs)`` for the reference (out only: the peer returns no lse)."""
    import jax

    import xattn.jax as xj

    ps = page_size(cfg)
    b, nk = inp.k.shape[0], inp.k.shape[1]
    per = max(1, -(-nk // ps))
    gen = torch.Generator(device=device).manual_seed(cfg.seed + 2)
    num_pages = b * per + 3
    pools = [torch.randn(t.shape[2], num_pages, ps, t.shape[3], generator=gen, device=device, dtype=t.dtype)
             for t in (inp.k, inp.v)]
    table = torch.randperm(num_pages, generator=gen, device=device)[:b * per].view(b, per)
    for pool, t in zip(pools, (inp.k, inp.v)):
        rows = pool[:, table].permute(1, 2, 3, 0, 4).reshape(b, per * ps, *t.shape[2:])  # [B, per*ps, Hkv, D]
        rows[:, :nk] = t
        pool[:, table] = rows.view(b, per, ps, *t.shape[2:]).permute(3, 0, 1, 2, 4)
    q = (inp.q[:, 0].double() * cfg.scale).to(inp.q.dtype)  # [B, Hq, D], the peer's pre-scaled query
    lengths = torch.full((b,), nk, dtype=torch.int32, device=device)
    fn = jax.jit(xj.paged_attention) if cfg.opt("jit") else xj.paged_attention
    out = jax.block_until_ready(fn(*(_to_jax(t) for t in (q, *pools, table.to(torch.int32), lengths))))
    got = {"out": torch.from_dlpack(out).to(device)[:, None]}
    return got, dataclasses.replace(cfg, scale=1.0), dataclasses.replace(inp, q=q[:, None])


# --- references and the verdict -----------------------------------------------------------------------

def _grads(out, leaves, dout):
    if not out.requires_grad:  # no document had both queries and keys
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


def references(cfg: Config, inp: Inputs) -> tuple[dict, dict]:
    """``(fp64, low precision)`` out, lse, dq, dk, dv for ``inp``, on its device."""
    e = cfg.entry
    kw = dict(scale=cfg.scale, causal=e.causal, window=e.window)
    result = []
    for low in (False, True):
        leaves = [t.detach().clone() if low else t.detach().to(torch.float64) for t in (inp.q, inp.k, inp.v)]
        for t in leaves:
            t.requires_grad_()
        if cfg.varlen:
            fn = lowprec_varlen_attention if low else ref_varlen
            out, lse = fn(*leaves, inp.cu_q, inp.cu_k, **kw)
        else:
            out, lse = (lowprec_attention if low else ref_attention)(*leaves, **kw)
        dout = inp.dout.detach().to(out.dtype)
        grads = _grads(out, leaves, dout)
        result.append({"out": out.detach(), "lse": lse.detach(), **dict(zip(("dq", "dk", "dv"), grads))})
    return result[0], result[1]


def refusal_check(cfg: Config, run) -> Check:
    """Call ``run(cfg)`` with the configuration's refused form: it must raise the drawn error type with the
    drawn words in its message (before any launch), else the check fails naming what happened."""
    causal, window, error, words = cfg.opt("refuse")
    try:
        run(cfg)
    except Exception as exc:  # judged below: the type and the message are the contract
        ok = type(exc).__name__ == error and words in str(exc)
        problems = [] if ok else [f"raised {type(exc).__name__}: {exc} (expected {error} naming {words!r})"]
    else:
        problems = [f"accepted causal={causal}, window_size={window} (expected {error} naming {words!r})"]
    return Check("refusal", 0.0, 0.0, 1.0, problems)


def _paged_refused(cfg: Config, causal: bool) -> str | None:
    """Why the support matrix refuses ``cfg``'s paged kernel (its mask as ``causal`` and the entry's window, the
    drawn page size), or None: a refused paged call raises by name, as its test asserts, so no route runs it."""
    from xattn.core.spec import KernelSpec, supports

    e = cfg.entry
    left, right = e.window
    return supports(KernelSpec(e.family, "fwd", e.dtype, e.head_dim, e.head_dim_v, e.g, causal, False, left, right,
                               page_size=page_size(cfg)))


def routes_of(cfg: Config) -> list[str]:
    """The routes ``cfg`` runs, forced one by one: every backward route that can serve it as its front end
    describes the problem (``torch``: host document lengths; ``jax``: traced ones), or the drawn option
    ``route``; ``["fused"]`` for the core front ends (the fused kernels, called directly); then, for torch and
    JAX, the forward route ``split-kv`` where it can serve (a decoding forward, :mod:`xattn.core.split_kv`)."""
    from xattn.core import routes

    if cfg.opt("route"):
        return [cfg.opt("route")]
    if cfg.front_end not in ("torch", "jax"):
        return ["fused"]
    e = cfg.entry
    base = dict(family=e.family, head_dim=e.head_dim, head_dim_v=e.head_dim_v, g=e.g, causal=e.causal,
                window=e.window, heads_q=cfg.heads_q, total_q=cfg.total_q, total_k=cfg.total_k)
    if not cfg.varlen:
        problem = routes.BwdProblem(**base, kind="dense", seqlen_k=cfg.seqlen_k)
    elif cfg.front_end == "torch":
        problem = routes.BwdProblem(**base, kind="packed", lengths=(cfg.lens_q, cfg.lens_k))
    else:
        problem = routes.BwdProblem(**base, kind="traced", slots=cfg.batch, max_seqlen_q=cfg.seqlen_q,
                                    max_seqlen_k=cfg.seqlen_k, same_segments=bool(cfg.opt("same_cu")))
    names = list(routes.serving_routes(problem))
    if cfg.front_end in ("torch", "jax") and routes.why_not_forward("split-kv", _forward_problem(cfg)) is None:
        names.append("split-kv")  # the forward route of decoding (its backward: the default)
    if cfg.front_end == "torch" and cfg.opt("entry") != "flash_attn_func" and not _paged_refused(cfg, e.causal):
        names.append("paged")  # the same keys through a page table (forward only; packed: vLLM's call)
    if not kvcache_refused(cfg):  # FlashAttention's KV-cache call (torch and JAX), each forward route forced
        names.append("kvcache:fused")
        kernels = cfg.opt("backend", "kernel") == "kernel"  # (JAX's reference backend has no routes)
        if kernels and routes.why_not_forward("split-kv", _kvcache_problem(cfg)) is None:
            names.append("kvcache:split-kv")
    if cfg.front_end == "jax" and not cfg.varlen and cfg.seqlen_q == 1 and e.window == (None, None) and \
            cfg.opt("backend", "kernel") == "kernel" and not _paged_refused(cfg, False):
        names.append("paged")  # Pallas' paged_attention call: one query per sequence
    return names


def _forward_problem(cfg: Config):
    """The forward as :func:`xattn.core.routes.forward_route` sees it; ``flat_kv`` from the drawn k/v storage
    (one row stride between sequences: only torch's heads-major "swapped" storage changes it; JAX arrays are
    compact)."""
    from xattn.core import routes

    e = cfg.entry
    flat = cfg.front_end == "jax" or cfg.batch <= 1 or (cfg.layout("k") == "swapped") == (cfg.layout("v") == "swapped")
    nq, nk = _torch_max_seqlen(cfg) if cfg.varlen and cfg.front_end == "torch" else (cfg.seqlen_q, cfg.seqlen_k)
    return routes.FwdProblem(e.family, cfg.batch, cfg.heads_kv, e.g, nq, nk, causal=e.causal,
                             local=e.window != (None, None), varlen=cfg.varlen, flat_kv=flat)


def quantities_of(route: str, front_end: str) -> tuple[str, ...]:
    """What route ``route`` of ``front_end`` is judged on: the forward-only routes (``paged``, ``kvcache:*``) out and
    lse (JAX's ``paged``, Pallas' call: out only), the others every quantity of :data:`QUANTITIES`."""
    if route == "paged" and front_end == "jax":
        return ("out",)
    return ("out", "lse") if route == "paged" or route.startswith("kvcache:") else QUANTITIES


def _forcing(route: str):
    import contextlib

    from xattn.core import routes

    if route == "paged":
        return contextlib.nullcontext()
    if route.startswith("kvcache:"):
        return routes.forced_forward(route.partition(":")[2])
    return routes.forced_forward(route) if route in routes.FORWARD_ROUTES and route != "fused" else \
        routes.forced(route)


def evaluate(cfg: Config, device="cuda") -> list[Check]:
    """Run ``cfg`` through its front end on every route of :func:`routes_of` (each forced) and compare every
    quantity with fp64 (``tolerance.py``); a drawn refused form is tried first and must raise its named error
    (one more check, ``refusal``). The drop-in front ends are judged by ``forms_harness.py``."""

    if cfg.front_end in FORM_FRONT_ENDS:
        from .forms_harness import evaluate_form

        return evaluate_form(cfg, device)
    inp = make_inputs(cfg, device)
    checks = []
    if cfg.opt("refuse"):
        checks.append(refusal_check(cfg, lambda c: RUNNERS[c.front_end](c, inp, device)))
        cfg = dataclasses.replace(cfg, options=tuple((n, v) for n, v in cfg.options if n != "refuse"))
    ref64, ref_lp = None, None
    dt = DTYPES[cfg.entry.dtype]
    names = routes_of(cfg)
    for route in names:
        if route == "paged" and cfg.front_end == "jax":
            got, ref_cfg, ref_inp = run_jax_paged(cfg, inp, device)
            _sync(device)
            paged64, paged_lp = references(ref_cfg, ref_inp)
            check = compare("out", got["out"], paged64["out"], paged_lp["out"], dt)
            check.name = "out@paged"
            checks.append(check)
            continue
        with _forcing(route):
            run = run_torch_paged if route == "paged" else RUNNERS[cfg.front_end]
            if route.startswith("kvcache:"):
                run = run_torch_kvcache if cfg.front_end == "torch" else run_jax_kvcache
            got = run(cfg, inp, device)
        _sync(device)
        if ref64 is None:
            ref64, ref_lp = references(cfg, inp)
        for n in quantities_of(route, cfg.front_end):
            check = compare(n, got[n], ref64[n], ref_lp[n], dt)
            if len(names) > 1:
                check.name = f"{n}@{route}"
            checks.append(check)
    return checks


def rerun_hint(cfg: Config) -> str:
    module = "test_fuzz_" + cfg.front_end.replace("-", "_") + ".py"
    return f"rerun alone: XATTN_FUZZ_ONLY={cfg.seed} python -m pytest -m fuzz -q tests/fuzz/{module}"


def run_one(cfg: Config, collector, device="cuda") -> list[Check]:
    """Evaluate ``cfg``, record it in ``collector`` (pass, fail or error), raise AssertionError on failure."""
    t0 = time.perf_counter()
    try:
        checks = evaluate(cfg, device)
    except Exception as exc:
        collector.record(cfg, [], error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - t0,
                         routes=routes_of(cfg))
        raise AssertionError(f"{cfg.describe()}\n{type(exc).__name__}: {exc}\n{rerun_hint(cfg)}") from exc
    collector.record(cfg, checks, seconds=time.perf_counter() - t0, routes=routes_of(cfg))
    if not all(c.ok for c in checks):
        raise AssertionError("\n".join([cfg.describe(), *map(repr, checks), rerun_hint(cfg)]))
    return checks
