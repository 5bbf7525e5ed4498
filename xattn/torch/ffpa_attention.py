"""Hugging Face ``attn_implementation="ffpa"``: the attention function, its mask, registration, and
the low-level SDPA-layout fwd/bwd used by ring attention.

HF hands ``query [B, Hq, N, D]`` and ``key/value [B, Hkv, Nk, D]`` (SDPA layout); the kernels take
``[B, N, H, D]``: the transposed views are passed as they are (no copy, strides allow it).
Routing in :func:`ffpa_attention_forward`, in order:

* fp16/bf16, no softcap, no training dropout, explicit ``scaling``, a head dim with a kernel:
  - packed sequences (``cu_seq_lens_q/k`` + ``max_length_q/k``, or ``position_ids`` that restart)
    -> varlen, document-causal;
  - ``attention_mask`` None -> dense (causal per ``is_causal`` / ``module.is_causal``);
  - 2D bool padding mask -> unpad, varlen, re-pad with zeros;
  - ``sliding_window`` with head_dim <= 256 -> FA4 local attention (``SLIDING_BACKEND="fa4"``,
    env ``XATTN_SLIDING_BACKEND``), or FlexAttention with ``"flex"``;
* a flex ``BlockMask`` -> FlexAttention; anything else -> SDPA (eager math when softcap is set),
  logged once per reason: ``dtype``, ``softcap``, ``dropout``, ``scaling``, ``ffpa_unavailable``,
  ``unsupported_mask``.

Never assumes 1/sqrt(d) (Gemma 4 uses ``scaling=1.0``).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from xattn.core.spec import family_for

from .attention import attention, attention_with_lse, default_family
from .ops import bwd as _bwd_op

__all__ = ["register_ffpa_attention", "setup_ffpa_backend", "ffpa_attention_forward", "ffpa_mask",
           "SLIDING_BACKEND"]

log = logging.getLogger("xattn")
SLIDING_BACKEND = os.environ.get("XATTN_SLIDING_BACKEND", "fa4")  # "fa4" or "flex"
_warned: set[str] = set()
_registered = False
_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _fallback_once(reason: str, detail: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning("xattn ffpa: falling back (%s): %s", reason, detail)


@functools.cache
def kernels_available() -> str | None:
    """``None`` when the sm90 kernels can run here, else why not (probed once per process)."""
    from xattn.core.info import collect

    fams = collect()["families"]
    return None if fams["ffpa"]["can_run"] else fams["ffpa"]["why_not_run"]


# --- masks and registration ---------------------------------------------------------------

def ffpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask=None, dtype=None, **kwargs):
    """The mask HF builds for "ffpa" layers: ``None`` (no padding) or a 2D bool ``[B, kv_length]``.

    The kernels apply causality and sliding windows themselves; only padding travels as a mask.
    A mask that is not 2D is passed through unchanged (it routes to SDPA).
    """
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        return attention_mask
    keep = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
    return None if bool(keep.all()) else keep


def register_ffpa_attention() -> bool:
    """Register ``"ffpa"`` in ``AttentionInterface`` and ``AttentionMaskInterface``; True the first time."""
    global _registered
    if _registered:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("ffpa", ffpa_attention_forward)
    AttentionMaskInterface.register("ffpa", ffpa_mask)
    _registered = True
    return True


def setup_ffpa_backend(cp_size: int = 1, has_packed_sequence: bool = False) -> bool:
    """Validate the parallel setup, then :func:`register_ffpa_attention` (packed sequences are supported)."""
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size: expected a positive int, got {cp_size!r}")
    if cp_size > 1:
        raise NotImplementedError("cp_size > 1: ring context parallelism for ffpa is not available yet")
    if not isinstance(has_packed_sequence, bool):
        raise TypeError(f"has_packed_sequence: expected a bool, got {type(has_packed_sequence).__name__}")
    return register_ffpa_attention()


# --- routing --------------------------------------------------------------------------------

def _fallback_reason(module, query, value, dropout, scaling, softcap, sliding) -> tuple[str, str] | None:
    if query.dtype not in _DTYPES:
        return "dtype", f"{query.dtype} is not float16/bfloat16"
    if softcap is not None:
        return "softcap", f"softcap={softcap} has no kernel"
    if dropout and getattr(module, "training", False):
        return "dropout", f"attention dropout {dropout} while training"
    if scaling is None:
        return "scaling", "no explicit scaling given (never assumed 1/sqrt(d))"
    if family_for(query.shape[-1], value.shape[-1], sliding) is None:
        return "ffpa_unavailable", f"no kernel for head dims {query.shape[-1]}/{value.shape[-1]}"
    why = kernels_available()
    if why is not None:
        return "ffpa_unavailable", why
    return None


def _packed_cu_seqlens(kwargs, q_len):
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None and cu_k is not None:
        return cu_q.int(), cu_k.int(), int(kwargs.get("max_length_q") or q_len), int(kwargs.get("max_length_k") or q_len)
    pos = kwargs.get("position_ids")
    if pos is None or pos.dim() != 2 or pos.shape[0] != 1 or pos.shape[1] != q_len:
        return None
    starts = torch.nonzero(pos[0] == 0).flatten()
    if starts.numel() <= 1:
        return None  # one document: plain dense causal
    ends = torch.cat([starts[1:], starts.new_tensor([q_len])])
    cu = torch.cat([starts.new_zeros(1), ends]).int()
    max_len = int((ends - starts).max())
    return cu, cu, max_len, max_len


def ffpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           softcap=None, **kwargs):
    """HF attention function: returns ``(out [B, N, Hq, Dv] contiguous, None)``; see the module docstring."""
    sliding = kwargs.get("sliding_window")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    if sliding is not None and SLIDING_BACKEND == "flex":
        return _flex(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    reason = _fallback_reason(module, query, value, dropout, scaling, softcap, sliding is not None)
    if attention_mask is not None and not (attention_mask.dim() == 2 and attention_mask.dtype == torch.bool):
        if type(attention_mask).__name__ == "BlockMask":
            return _flex(module, query, key, value, attention_mask, scaling, softcap, kwargs)
        reason = reason or ("unsupported_mask", f"mask of shape {tuple(attention_mask.shape)} / {attention_mask.dtype}")
    if reason is not None:
        _fallback_once(*reason)
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, softcap, causal, sliding)
    family = family_for(query.shape[-1], value.shape[-1], sliding is not None)
    window = (sliding - 1, 0) if sliding is not None else (None, None)
    causal = causal and sliding is None
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, N, H, D] views, no copy
    packed = _packed_cu_seqlens(kwargs, q.shape[1]) if q.shape[0] == 1 else None
    if packed is not None:
        cu_q, cu_k, mq, mk = packed
        out = attention(q[0], k[0], v[0], softmax_scale=scaling, causal=True, window_size=window,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk, family=family)
        return out[None], None
    if attention_mask is None:
        return attention(q, k, v, softmax_scale=scaling, causal=causal, window_size=window, family=family), None
    return _padded(q, k, v, attention_mask, scaling, causal, window, family), None


def _padded(q, k, v, keep_k, scaling, causal, window, family):
    """Unpad by the 2D mask, run varlen, re-pad with zeros. Queries are the last Nq kv positions."""
    b, nq = q.shape[:2]
    keep_q = keep_k[:, -nq:]
    idx_q, idx_k = keep_q.flatten().nonzero().flatten(), keep_k.flatten().nonzero().flatten()
    lens_q, lens_k = keep_q.sum(1, dtype=torch.int32), keep_k.sum(1, dtype=torch.int32)
    zero = lens_q.new_zeros(1)
    cu_q, cu_k = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)]), torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    qs = q.reshape(b * nq, *q.shape[2:])[idx_q]
    ks = k.reshape(-1, *k.shape[2:])[idx_k]
    vs = v.reshape(-1, *v.shape[2:])[idx_k]
    out = attention(qs, ks, vs, softmax_scale=scaling, causal=causal, window_size=window, cu_seqlens_q=cu_q,
                    cu_seqlens_k=cu_k, max_seqlen_q=int(lens_q.max()), max_seqlen_k=int(lens_k.max()), family=family)
    full = out.new_zeros(b * nq, *out.shape[1:])
    full = full.index_copy(0, idx_q, out)
    return full.reshape(b, nq, *out.shape[1:])


def _dense_mask(query, key, attention_mask, causal, sliding):
    """4D bool [B, 1, Nq, Nk] for the fallbacks (bottom-right causal / window + 2D padding)."""
    nq, nk = query.shape[2], key.shape[2]
    i = torch.arange(nq, device=query.device)[:, None] + (nk - nq)
    j = torch.arange(nk, device=query.device)[None, :]
    m = torch.ones(nq, nk, dtype=torch.bool, device=query.device)
    if causal or sliding is not None:
        m &= j <= i
    if sliding is not None:
        m &= j > i - sliding
    m = m[None, None].expand(query.shape[0], 1, nq, nk)
    if attention_mask is not None and attention_mask.dim() == 2:
        m = m & attention_mask[:, None, None, :].bool()
    elif attention_mask is not None:
        m = m & attention_mask.bool() if attention_mask.dtype == torch.bool else m
    return m


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, softcap, causal, sliding):
    """torch SDPA (eager when softcapped) on [B, H, N, D]; returns [B, N, Hq, Dv] contiguous.

    GQA is left to SDPA (``enable_gqa``), never expanded twice. Query rows with no visible key
    (left padding under a causal mask) give zeros, not NaN."""
    live = None
    if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
        mask = attention_mask  # an additive float mask from the caller: keep it
    else:
        mask = _dense_mask(query, key, attention_mask, causal, sliding)
        live = mask.any(-1, keepdim=True)  # [B, 1, Nq, 1]
        mask = mask | ~live  # a dead row attends to everything; its output is zeroed below
    if softcap is not None:
        out = _eager_softcap(query, key, value, mask, scaling, softcap)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
            enable_gqa=query.shape[1] != key.shape[1]).transpose(1, 2)
    if live is not None:
        out = out * live.transpose(1, 2).to(out.dtype)  # [B, Nq, 1, 1]
    return out.contiguous(), None


def _eager_softcap(query, key, value, mask, scaling, softcap):
    """Softcapped attention in fp32 scores on [B, H, N, D]; returns [B, N, Hq, Dv] contiguous."""
    g = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(g, 1), value.repeat_interleave(g, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    s = torch.matmul(query, k.transpose(-1, -2)).float() * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).to(value.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous()


def _flex(module, query, key, value, attention_mask, scaling, softcap, kwargs):
    from transformers.integrations.flex_attention import flex_attention_forward

    out, _ = flex_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                    softcap=softcap, **kwargs)
    return out, None


# --- low level (SDPA layout), building blocks of ring attention -------------------------------

def _ffpa_dense_fwd(query, key, value, scaling: float, causal: bool = True):
    """query ``[B, Hq, N, D]``, key/value ``[B, Hkv, Nk, D]`` -> ``(out [B, Hq, N, D], lse [B, Hq, N] fp32)``."""
    out, lse = attention_with_lse(*(t.transpose(1, 2) for t in (query, key, value)), softmax_scale=scaling,
                                  causal=causal, family=default_family(query.shape[-1]))
    return out.transpose(1, 2), lse


def _ffpa_dense_bwd(dout, query, key, value, out, lse, scaling: float, causal: bool = True):
    """Gradients from the caller's ``out``/``lse`` (SDPA layout); dk/dv are reduced to Hkv heads."""
    t = [x.transpose(1, 2) for x in (dout, query, key, value, out)]
    dq, dk, dv = _bwd_op(t[0].contiguous(), t[1], t[2], t[3], t[4], lse, default_family(query.shape[-1]), float(scaling),
                         causal, -1, -1, None, None, 0, 0)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _ffpa_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scaling: float,
                     causal: bool = True):
    """Packed THD: ``(out [Tq, Hq, D], lse [Hq, Tq])``."""
    return attention_with_lse(q, k, v, softmax_scale=scaling, causal=causal, cu_seqlens_q=cu_seqlens_q,
                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                              family=default_family(q.shape[-1]))


def _ffpa_varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                     scaling: float, causal: bool = True):
    """Packed THD gradients from the caller's ``out``/``lse``."""
    return _bwd_op(dout.contiguous(), q, k, v, out, lse, default_family(q.shape[-1]), float(scaling), causal, -1, -1,
                   cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
