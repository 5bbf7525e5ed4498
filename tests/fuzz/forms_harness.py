"""Run one drop-in configuration (``forms.py``) and judge it against fp64 under the mask its form means.

Each front end returns out ``[B, Nq, Hq, Dv]`` and the gradients of q, k, v (``[B, N, H, D]``) for a
seeded cotangent. The truth is :func:`~tests.fuzz.tolerance.masked_attention` in fp64 (and its
low-precision twin for the tolerance) under the mask written here from each peer's documented
semantics, independently of xattn's planning code:

* ``hf``, no mask / 2D mask: bottom-right causal or ``sliding_window`` (HF's FlashAttention convention
  ``(w - 1, 0)`` / ``(w - 1, w - 1)``), keys kept by the 2D mask as HF's FlashAttention path and NeMo read
  it (wider: its last Nk columns; narrower: the first W keys, queries the last Nq of them); rows with no
  visible key are 0. 4D mask: the mask itself. Factory: HF's own ``sdpa_mask`` for the same arguments;
  rows it leaves without a key are undefined in HF (SDPA gives them anything) and are not judged.
* ``fa4-doc``: the query at global position p sees the keys of its run of equal ids at positions <= p;
  padding queries (id <= 0) are 0. ``causal_fa4_attention``: plain causal.
* ``jax-nn``: jax.nn's top-left causal / window / length masks; rows with no visible key are 0
  (xattn's documented difference), except where the call falls back to jax.nn's own XLA
  implementation (a window with ``key_value_seq_lengths``, a window at FFPA's head dims, negative
  window sides): jax.nn averages the values there, so those rows are not judged.

Rows not judged get a zero cotangent, so the gradients are judged whole.
"""

from __future__ import annotations

import torch

from .forms import FormConfig
from .tolerance import Check, compare, masked_attention

__all__ = ["evaluate_form", "RUNNERS"]

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class _Module(torch.nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.is_causal = causal


def _inputs(cfg: FormConfig, device):
    dt = DTYPES[cfg.dtype]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    b, nq, nk, hq, hkv = cfg.batch, cfg.seqlen_q, cfg.seqlen_k, cfg.heads_q, cfg.heads_kv
    shapes = dict(q=(b, nq, hq, cfg.head_dim), k=(b, nk, hkv, cfg.head_dim), v=(b, nk, hkv, cfg.head_dim_v),
                  dout=(b, nq, hq, cfg.head_dim_v))
    return {n: torch.randn(s, generator=gen, device=device, dtype=dt) for n, s in shapes.items()}


def _bottom_right(nq: int, nk: int, base: int, left, right, device) -> torch.Tensor:
    """``[Nq, Nk]``: query i at key position ``base + i`` sees keys ``base + i - left .. base + i + right``."""
    rel = torch.arange(nk, device=device)[None, :] - (torch.arange(nq, device=device)[:, None] + base)
    vis = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if left is not None:
        vis &= rel >= -left
    if right is not None:
        vis &= rel <= right
    return vis


def _hf_window(causal: bool, sliding):
    left = None if sliding is None else sliding - 1
    return left, 0 if causal else left


# --- hf -----------------------------------------------------------------------------------------------

def _hf_mask_function(cfg: FormConfig):
    from transformers import masking_utils as mu

    name, w = cfg.arg("mask_function"), cfg.arg("window")
    return {"causal": lambda: mu.causal_mask_function, "bidirectional": lambda: mu.bidirectional_mask_function,
            "sliding": lambda: mu.sliding_window_causal_mask_function(w),
            "sliding_bidirectional": lambda: mu.sliding_window_bidirectional_mask_function(w)}[name]()


def _random_mask(cfg: FormConfig, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(cfg.arg("mask_seed"))
    m = torch.rand(cfg.batch, 1, cfg.seqlen_q, cfg.seqlen_k, generator=gen) < 0.7
    m[..., torch.randint(cfg.seqlen_k, (cfg.seqlen_q,), generator=gen)] = True  # every row sees a key
    m[..., torch.arange(cfg.seqlen_q), torch.randint(cfg.seqlen_k, (cfg.seqlen_q,), generator=gen)] = True
    return m.to(device)


def run_hf(cfg: FormConfig, x: dict, device):
    """``(out, grads, truth mask [B, Nq, Nk], judged rows [B, Nq] or None)`` of ffpa_attention_forward."""
    from xattn.torch import ffpa_attention as fa

    b, nq, nk = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    causal, sliding, kind = cfg.arg("is_causal"), cfg.arg("sliding_window"), cfg.arg("kind")
    kw = {} if sliding is None else dict(sliding_window=sliding)
    judged = None
    if kind == "none":
        mask = None
        truth = _bottom_right(nq, nk, nk - nq, *_hf_window(causal, sliding), device).expand(b, nq, nk)
    elif kind == "2d":
        mask = torch.tensor(cfg.arg("keep"), dtype=torch.long, device=device)
        width = mask.shape[1]
        keep = mask[:, width - nk:].bool() if width >= nk else \
            torch.cat([mask.bool(), mask.new_zeros(b, nk - width, dtype=torch.bool)], 1)
        base = nk - nq if width >= nk else width - nq
        truth = _bottom_right(nq, nk, base, *_hf_window(causal, sliding), device)[None] & keep[:, None, :]
    elif kind == "4d":
        truth4 = _random_mask(cfg, device)
        mask = truth4 if not cfg.arg("additive") else \
            torch.zeros(truth4.shape, dtype=DTYPES[cfg.dtype], device=device).masked_fill(~truth4, float("-inf"))
        truth = truth4[:, 0]
    else:
        from transformers import masking_utils as mu

        keep = cfg.arg("keep")
        args = dict(batch_size=b, q_length=nq, kv_length=nk, q_offset=cfg.arg("q_offset"), kv_offset=0,
                    mask_function=_hf_mask_function(cfg),
                    attention_mask=None if keep is None else torch.tensor(keep, device=device).bool())
        truth = mu.sdpa_mask(**args, allow_is_causal_skip=False, device=device)[:, 0]
        mask = fa.ffpa_mask(**args, device=device)
        judged = truth.any(-1)  # HF leaves rows without a key undefined
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    query, key, value = (t.transpose(1, 2) for t in leaves)
    out, weights = fa.ffpa_attention_forward(_Module(causal), query, key, value, mask, scaling=cfg.scale, **kw)
    assert weights is None and out.shape == (b, nq, cfg.heads_q, cfg.head_dim_v), out.shape
    return out, leaves, truth, judged


# --- fa4-doc ------------------------------------------------------------------------------------------

def _runs(ids: torch.Tensor) -> torch.Tensor:
    change = ids[:, 1:] != ids[:, :-1]
    return torch.cat([torch.zeros_like(change[:, :1]), change], 1).long().cumsum(1)


def run_doc(cfg: FormConfig, x: dict, device):
    from xattn.torch import fa4

    b, nq, nk = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    leaves = [x[n].detach().clone().requires_grad_() for n in ("q", "k", "v")]
    query, key, value = (t.transpose(1, 2) for t in leaves)
    if cfg.arg("kind") == "causal":
        out = fa4.causal_fa4_attention(query, key, value, cfg.scale)
        truth = _bottom_right(nq, nk, 0, None, 0, device).expand(b, nq, nk)
        return out.transpose(1, 2), leaves, truth, None
    ids = torch.tensor(cfg.arg("ids"), dtype=torch.int64, device=device)
    start = cfg.arg("q_global_start")
    q_ids = ids[:, start:start + nq]
    out = fa4.document_causal_fa4_attention(query, key, value, q_ids, ids, start, cfg.scale)
    runs = _runs(ids)
    pos_q, pos_k = torch.arange(nq, device=device) + start, torch.arange(nk, device=device)
    truth = (runs[:, start:start + nq, None] == runs[:, None, :]) & (pos_k[None, None, :] <= pos_q[None, :, None])
    truth &= (q_ids > 0)[:, :, None]  # padding queries: 0
    return out.transpose(1, 2), leaves, truth, None


# --- jax-nn -------------------------------------------------------------------------------------------

def _jax_nn_truth(cfg: FormConfig, device):
    """``(visible [B, T, S], unjudged rows [B, T])`` under jax.nn's top-left masks (unjudged: rows with no
    visible key where the call falls back to jax.nn's XLA implementation, which averages the values)."""
    b, t, s = cfg.batch, cfg.seqlen_q, cfg.seqlen_k
    i, j = torch.arange(t, device=device)[:, None], torch.arange(s, device=device)[None, :]
    causal, w = cfg.arg("is_causal"), cfg.arg("local_window_size")
    left, right = (w, w) if isinstance(w, int) else (w if w is not None else (None, None))
    vis = torch.ones(t, s, dtype=torch.bool, device=device)
    if causal:
        vis &= j <= i
    if left is not None:
        vis &= (i - left <= j) & (j <= i + right)
    vis = vis[None].expand(b, t, s).clone()
    q_len, kv_len = cfg.arg("query_seq_lengths"), cfg.arg("key_value_seq_lengths")
    if q_len is not None:
        vis &= (i[None] < torch.tensor(q_len, device=device)[:, None, None])
    if kv_len is not None:
        kv = torch.tensor(kv_len, device=device)[:, None]
        vis &= j[None] < kv[:, :, None]
    kernels = cfg.arg("backend", "kernel") == "kernel"  # the reference computes every row
    falls_back = kernels and left is not None and (kv_len is not None or cfg.head_dim >= 320 or min(left, right) < 0)
    unjudged = ~vis.any(-1) if falls_back else torch.zeros(b, t, dtype=torch.bool, device=device)
    return vis, unjudged


def run_jax_nn(cfg: FormConfig, x: dict, device):
    import jax
    import jax.numpy as jnp

    import xattn.jax as xj

    truth, unjudged = _jax_nn_truth(cfg, device)
    if device != "cpu":
        torch.cuda.synchronize()
    arrays = [jnp.from_dlpack(x[n].contiguous()) for n in ("q", "k", "v")]
    lens = {n: None if cfg.arg(n) is None else jnp.asarray(cfg.arg(n), jnp.int32)
            for n in ("query_seq_lengths", "key_value_seq_lengths")}
    w = cfg.arg("local_window_size")

    def attn(q, k, v):
        return xj.dot_product_attention(q, k, v, scale=cfg.scale, is_causal=cfg.arg("is_causal"),
                                        local_window_size=w, backend=cfg.arg("backend", "kernel"), **lens)
    out, pull = jax.vjp(attn, *arrays)
    dout = x["dout"].masked_fill(unjudged[:, :, None, None], 0)
    grads = pull(jnp.from_dlpack(dout.contiguous()))
    to_torch = lambda a: torch.from_dlpack(jax.block_until_ready(a)).to(device)  # noqa: E731
    return to_torch(out), [to_torch(g) for g in grads], truth, ~unjudged, unjudged


RUNNERS = {"hf": run_hf, "fa4-doc": run_doc, "jax-nn": run_jax_nn}


# --- the verdict ---------------------------------------------------------------------------------------

def _references(x: dict, truth, dout, scale: float):
    refs = []
    for dtype in (torch.float64, x["q"].dtype):
        leaves = [x[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v")]
        out = masked_attention(*leaves, truth, scale=scale)
        grads = torch.autograd.grad(out, leaves, dout.to(dtype), allow_unused=True)
        refs.append([out.detach()] + [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)])
    return refs


def evaluate_form(cfg: FormConfig, device="cuda") -> list[Check]:
    """Run ``cfg`` through its drop-in and compare out, dq, dk, dv with fp64 under the form's mask."""
    x = _inputs(cfg, device)
    checks = []
    res = RUNNERS[cfg.front_end](cfg, x, device)
    if cfg.front_end == "jax-nn":
        out, grads, truth, judged, unjudged = res
        out = out.masked_fill(unjudged[:, :, None, None], 0)
    else:
        out, leaves, truth, judged = res
        if judged is None:
            judged = torch.ones(truth.shape[:2], dtype=torch.bool, device=truth.device)
    dout = x["dout"].masked_fill(~judged[:, :, None, None], 0)
    if cfg.front_end != "jax-nn":
        grads = torch.autograd.grad(out, leaves, dout, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    ref64, ref_lp = _references(x, truth, dout, cfg.scale)
    dt = DTYPES[cfg.dtype]
    sel = judged[:, :, None, None].expand_as(out)
    checks.append(compare("out", out.detach()[sel], ref64[0][sel], ref_lp[0][sel], dt))
    for name, got, r64, rlp in zip(("dq", "dk", "dv"), grads, ref64[1:], ref_lp[1:]):
        checks.append(compare(name, got, r64, rlp, dt))
    return checks
