"""Hugging Face ``attn_implementation="ffpa"`` (a drop-in for NeMo's ``ffpa_attention`` module): the attention
function, its mask factory, registration, and the low-level SDPA-layout fwd/bwd that ring attention builds on.

"ffpa" is registered globally, so any HF model may select it; it must give what ``"sdpa"`` gives.
Run exactly or fall back exactly:

* :func:`ffpa_mask` (the mask factory) reads the layer's HF ``mask_function`` and returns what NeMo's
  returns, ``torch.Tensor | BlockMask | None`` (never None: see its docstring); for causal, sliding-window
  (causal or bidirectional), packed-document and padding masks a
  :class:`~xattn.torch.hf_masks.PlannedMask`, HF's exact 4D SDPA mask as a tensor that is built only if
  read, carrying the launch plan (:class:`~xattn.torch.hf_masks.KernelMask`: kernel window + varlen
  segments, built once per forward). Anything else (chunked layers, image-token blocks, custom
  overlays, right padding that differs per row) gets HF's own SDPA mask, with a warning naming the
  reason. ``config.ffpa_sliding_attn_backend`` (NeMo's knob; else ``XATTN_SLIDING_BACKEND``) picks
  "fa4" (kernels, default), "flex" (HF's ``BlockMask``) or "sdpa" for non-causal layers of the text
  model; vision and audio sub-encoders are planned like any layer (their padding kept).
* :func:`ffpa_attention_forward` runs a plan on the kernels (FFPA for head_dim 320-512,
  FA4 for <= 256 and windows) when dtype, scaling, head dims and options allow; otherwise it falls
  back exactly: SDPA with the layer's exact mask, the model's own eager function for ``softcap`` or
  ``s_aux`` sinks, FlexAttention for a ``BlockMask``; each reason is logged once.
* Without a factory mask (``attention_mask=None``, direct calls): causal per ``is_causal`` /
  ``module.is_causal``, bottom-right aligned (FlashAttention); ``sliding_window=w`` is HF's
  FlashAttention convention ``(w-1, 0)`` causal / ``(w-1, w-1)`` not; packed rows from
  ``cu_seq_lens_q/k`` or restarting ``position_ids`` (batch 1).

Context parallelism (``setup_ffpa_backend(cp_size > 1, False)`` or ``xattn.torch.context_parallel(group)``):
every layer receives this rank's sequence shard; global layers run :func:`xattn.torch.ring.ring_attention`, sliding
layers its halo exchange, and whatever cannot run sharded raises (there is no exact fallback on a shard).

Determinism: with ``torch.use_deterministic_algorithms(True)`` the backward of a layer that runs
on FA4 (head_dim <= 256, sliding layers) raises torch's RuntimeError naming the op (``warn_only=True``:
warns and runs), because FA4 reduce-adds fp32 dQ / GQA dK/dV partials in scheduling order; layers on
FFPA (head_dim 320-512) and every forward are bitwise reproducible (see :mod:`xattn.torch.attention`).

HF hands ``query [B, Hq, N, D]`` and ``key/value [B, Hkv, Nk, D]`` (SDPA layout); the kernels read
``[B, N, H, D]`` views of them (no copy). Never assumes 1/sqrt(d) (Gemma 4 uses ``scaling=1.0``).
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
import os

import torch

from xattn.core.spec import family_for

from . import cp_group, hf_fallback
from .attention import attention, attention_with_lse, default_family
from .hf_masks import (KernelMask, Pattern, PlannedMask, describe, hf_window, plan_hf_mask, plan_without_mask,
                       window_mask)
from .ops import bwd as _bwd_op
from .ring import ring_attention

__all__ = ["ffpa_attention_forward", "ffpa_mask", "register_ffpa_attention", "setup_ffpa_backend", "_ffpa_dense_fwd",
           "_ffpa_dense_bwd"]

logger = logging.getLogger(__name__)
# The backend of layers whose mask is not plain causal (sliding windows, documents, bidirectional blocks):
# a model config's ``ffpa_sliding_attn_backend`` (NeMo's knob) wins, else this default.
SLIDING_BACKEND = os.environ.get("XATTN_SLIDING_BACKEND", "fa4")
_SLIDING_BACKENDS = ("fa4", "flex", "sdpa")
_FFPA_HEAD_DIM = 512
_VARLEN_WIN_NONE = -2 ** 31  # the seed's "no window" sentinel (xattn's core takes None)
_FALLBACK_WARNED: set[str] = set()
_REGISTERED = False
_FFPA_LOW_LEVEL_READY: bool | None = None
_SDPA_FN = _FLEX_FN = _EAGER_FN = _FFPA_FN = None
_CUTEDSL_BACKEND = None
_DTYPES = (torch.bfloat16, torch.float16)


def _warn_once(reason: str, message: str, target: str = "sdpa") -> None:
    """Log ``ffpa fallback to <target>: <message> (reason=<reason>)`` once per reason and process, as NeMo's
    module logs it (this module's logger; the record's ``reason``/``target`` attributes hold both)."""
    if reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(reason)
        logger.warning("ffpa fallback to %s: %s (reason=%r)", target, message, reason,
                       extra={"reason": reason, "target": target})


@torch.compiler.assume_constant_result  # torch.compile reads the answer at trace time (the probe is not traceable)
def kernels_available() -> str | None:
    """``None`` when the sm90 kernels can run here, else why not (probed once per process)."""
    return _probe_kernels()


@functools.cache
def _probe_kernels() -> str | None:
    from xattn.core.info import collect

    fams = collect()["families"]
    return None if fams["ffpa"]["can_run"] else fams["ffpa"]["why_not_run"]


def _ffpa_low_level_ready() -> bool:
    """Whether the FFPA kernels (dense fwd/bwd) can run in this process."""
    global _FFPA_LOW_LEVEL_READY
    _FFPA_LOW_LEVEL_READY = kernels_available() is None
    return _FFPA_LOW_LEVEL_READY


def _ffpa_varlen_ready() -> bool:
    """Whether the FFPA varlen kernels can run in this process (the same launchers as dense)."""
    return _ffpa_low_level_ready()


def _get_sdpa():
    """HF's ``sdpa_attention_forward`` (None without transformers)."""
    global _SDPA_FN
    _SDPA_FN = _SDPA_FN or hf_fallback.get_sdpa()
    return _SDPA_FN


def _get_flex():
    """HF's ``flex_attention_forward`` (None without transformers / FlexAttention)."""
    global _FLEX_FN
    _FLEX_FN = _FLEX_FN or hf_fallback.get_flex()
    return _FLEX_FN


def _get_eager():
    """The generic eager attention used for ``softcap`` / ``s_aux`` when a model has no eager function."""
    global _EAGER_FN
    _EAGER_FN = _EAGER_FN or hf_fallback.get_eager()
    return _EAGER_FN


def _ffpa_sdpa(query, key, value, attn_mask=None, dropout_p: float = 0.0, is_causal: bool = False, scale=None,
               enable_gqa: bool = False, backend=None):
    """``scaled_dot_product_attention``'s signature on the kernels (ffpa-attn's ``ffpa_attn_func``):
    ``[B, H, N, D]`` in and out, differentiable.

    ``is_causal`` is bottom-right aligned (as ``ffpa_attn_func``); ``attn_mask`` and dropout raise
    NotImplementedError; Hq != Hkv needs ``enable_gqa=True`` as in SDPA. ``backend`` is the second value
    of :func:`_get_ffpa_high_level` (``xattn.core``) or None; anything else raises ValueError."""
    import xattn.core

    if backend is not None and backend is not xattn.core:
        raise ValueError(f"backend: expected the backend returned by _get_ffpa_high_level() (xattn.core) or None, "
                         f"got {backend!r}")
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: the kernels take no mask tensor; use is_causal")
    if dropout_p:
        raise NotImplementedError(f"dropout_p={dropout_p}: the kernels have no attention dropout")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads, key {key.shape[1]}: pass enable_gqa=True for GQA")
    out = attention(*(t.transpose(1, 2) for t in (query, key, value)), softmax_scale=scale, causal=is_causal)
    return out.transpose(1, 2)


def _get_ffpa_high_level():
    """``(sdpa_like_fn, backend)``: the differentiable SDPA-signature function and ``xattn.core``, or
    ``(None, None)`` where the kernels cannot run."""
    global _FFPA_FN, _CUTEDSL_BACKEND
    if not _ffpa_low_level_ready():
        return None, None
    import xattn.core

    _FFPA_FN, _CUTEDSL_BACKEND = _ffpa_sdpa, xattn.core
    return _FFPA_FN, _CUTEDSL_BACKEND


@functools.cache
def _block_mask_type() -> type | None:
    """flex_attention's ``BlockMask`` class (imported once), or None where this torch has none."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return None
    return BlockMask


def _is_block_mask(mask) -> bool:
    """True for a flex ``BlockMask``: that layer runs on FlexAttention."""
    if mask is None or isinstance(mask, (KernelMask, PlannedMask)):
        return False
    kind = _block_mask_type()
    return kind is not None and isinstance(mask, kind)


# --- the mask factory and registration ------------------------------------------------------

def _sliding_backend(config) -> str:
    """The backend of non-causal layers: ``config.ffpa_sliding_attn_backend`` when the model config has it
    (NeMo: "flex" or "sdpa"; xattn adds "fa4", the kernels), else ``XATTN_SLIDING_BACKEND`` (default "fa4").
    ValueError for anything else, as NeMo raises it."""
    value = getattr(config, "ffpa_sliding_attn_backend", None)
    name = "ffpa_sliding_attn_backend" if value is not None else "XATTN_SLIDING_BACKEND"
    backend = str(SLIDING_BACKEND if value is None else value).lower()
    if backend not in _SLIDING_BACKENDS:
        raise ValueError(f"{name} must be 'flex', 'sdpa' or 'fa4', got {backend!r}.")
    return backend


def _is_sub_encoder(config) -> bool:
    """Vision / audio towers (``config.model_type`` containing "vision" or "audio", e.g. Gemma 4's) share the
    registry with the text model."""
    model_type = getattr(config, "model_type", "") or ""
    return "vision" in model_type or "audio" in model_type


def ffpa_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function=None, attention_mask=None, dtype: torch.dtype = torch.float32, **kwargs):
    """Mask factory of ``"ffpa"`` (``ALL_MASK_ATTENTION_FUNCTIONS["ffpa"]``), same arguments as HF's ``sdpa_mask``.

    Returns ``torch.Tensor | BlockMask | None`` (NeMo's annotation; xattn never returns None):

    * a :class:`~xattn.torch.hf_masks.PlannedMask`: HF's exact SDPA mask (bool ``[B, 1, q_length,
      kv_length]``, True = attend, built only if read) carrying the launch plan, for every pattern the
      kernels run exactly (plain causal too, padding, sliding windows, packed documents, bidirectional,
      caches). NeMo returns None for plain causal layers without padding; that leaves the layer's
      kwargs (``is_causal``, ``sliding_window``) to decide a mask the factory knew, which they can
      contradict (the GPU fuzz found such calls), so the plan always travels with the mask.
    * HF's own SDPA mask (4D bool) where the kernels cannot reproduce the mask (chunked layers,
      image-token blocks, custom overlays, uneven right padding), with a warning naming the reason.
    * for non-causal masks (``mask_function`` other than HF's ``causal_mask_function``), the
      backend ``config.ffpa_sliding_attn_backend`` names (else ``XATTN_SLIDING_BACKEND``): "fa4" (the
      kernels, default), "flex" (HF's ``BlockMask``; the layer runs FlexAttention) or "sdpa" (HF's SDPA
      mask); anything else raises ValueError.
    * vision / audio sub-encoders (``config.model_type`` with "vision" or "audio", e.g. Gemma 4's towers)
      are planned like any layer (bidirectional over their padded patches: a PlannedMask), and the
      sliding backend setting does not apply to them. NeMo returns None there, which drops the
      sub-encoder's padding mask; xattn keeps sdpa's results.

    ``attention_mask`` is HF's 2D padding mask ``[B, >= kv_length]`` (its last ``kv_length`` columns are read).
    """
    from transformers import masking_utils as mu

    if isinstance(attention_mask, (KernelMask, PlannedMask)):
        return attention_mask  # prepared earlier (generate() with a static cache), as HF returns 4D masks
    q_length, kv_length, kv_offset = (int(x) for x in (q_length, kv_length, kv_offset))
    if not isinstance(q_offset, torch.Tensor):  # a static cache's is a device tensor: planned there, no sync
        q_offset = int(q_offset)
    config = kwargs.get("config")
    device = kwargs.pop("device", None) or (attention_mask.device if attention_mask is not None else "cpu")
    args = dict(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                kv_offset=kv_offset, mask_function=mask_function or mu.causal_mask_function,
                attention_mask=attention_mask, device=device)
    extra = {n: x for n, x in kwargs.items() if n != "allow_is_causal_skip"}

    def hf_sdpa_mask(**skip):
        mask = mu.sdpa_mask(**args, **{"allow_is_causal_skip": False, **skip}, **extra)
        if mask is not None:
            mask._xattn_factory_fallback = True  # the attention function knows it is HF's exact mask
        return mask

    if not _is_sub_encoder(config) and mask_function is not None and mask_function is not mu.causal_mask_function:
        backend = _sliding_backend(config)
        if backend == "flex":
            return mu.flex_attention_mask(**args, **extra)
        if backend == "sdpa":
            return hf_sdpa_mask(allow_is_causal_skip=kwargs.get("allow_is_causal_skip", True))
    pattern = describe(args["mask_function"]) if attention_mask is None or attention_mask.dim() == 2 else None
    if cp_group.active_group() is not None:
        return PlannedMask(_sharded_plan(pattern, args["mask_function"], args), device)
    if pattern is None:
        fn = args["mask_function"]
        _warn_once("mask_function", f"{getattr(fn, '__qualname__', fn)} is not a pattern the kernels reproduce "
                   "exactly (chunked, blockwise or custom masks)")
        return hf_sdpa_mask()
    keep = padding_mask = None
    if attention_mask is not None:
        keep = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
        if attention_mask.shape[-1] >= kv_offset + kv_length:  # keep is a slice of it (nothing padded on)
            padding_mask = attention_mask
    plan = plan_hf_mask(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, keep, device,
                        hf_sdpa_mask, padding_mask=padding_mask)
    if isinstance(plan, str):
        _warn_once("mask", plan)
        return hf_sdpa_mask()
    return PlannedMask(plan, device)


def _sharded_plan(pattern, mask_function, args) -> KernelMask:
    """The plan of a context-parallel forward: the layer's window on global positions (the shard's
    restarting ``position_ids`` are the layout, not documents). Raises for what cannot run sharded."""
    if pattern is None:
        name = getattr(mask_function, "__qualname__", mask_function)
        raise NotImplementedError(f"context parallelism: the mask {name}"
                                  " is not a causal, sliding-window or bidirectional pattern")
    keep = args["attention_mask"]
    if keep is not None and not bool(keep.all()):
        raise NotImplementedError("context parallelism: padding masks are not supported (shard unpadded rows)")
    if args["q_length"] != args["kv_length"] or args["q_offset"] or args["kv_offset"]:
        raise NotImplementedError("context parallelism: a KV cache is not supported (CP is for training/prefill "
                                  "of whole sequences)")

    def no_sdpa_mask():
        raise NotImplementedError("context parallelism: a sharded layer has no exact SDPA fallback")
    return KernelMask(args["batch_size"], args["q_length"], args["kv_length"], (pattern.left, pattern.right),
                      description="context-parallel shard", notes={"context_parallel": True},
                      _materialize=no_sdpa_mask)


def register_ffpa_attention() -> bool:
    """Register ``"ffpa"`` in HF's ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent).

    Returns True when this call registered it, False when it was registered already (as NeMo's) or
    transformers is not installed."""
    global _REGISTERED
    if _REGISTERED:
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    AttentionInterface.register("ffpa", ffpa_attention_forward)
    AttentionMaskInterface.register("ffpa", ffpa_mask)
    _REGISTERED = True
    logger.info("registered ALL_ATTENTION_FUNCTIONS['ffpa'] + ALL_MASK_ATTENTION_FUNCTIONS['ffpa'] (xattn)")
    return True


def setup_ffpa_backend(cp_size: int, has_packed_sequence: bool) -> None:
    """Check the parallel setup, register ``"ffpa"``, and turn context parallelism on (``cp_size > 1``) or off.

    A superset of NeMo's function, which raises for ``cp_size > 1`` and for packed sequences because its
    ``"ffpa"`` can do neither; xattn runs both:

    * ``has_packed_sequence`` true (``cp_size`` 1): accepted; packed documents run on the kernels
      (varlen segments from HF's packed mask, ``cu_seq_lens_q/k`` or restarting ``position_ids``).
    * ``cp_size > 1``: every ``"ffpa"`` layer runs on sequence shards (ring attention) over the group handed
      over with :func:`xattn.torch.set_context_parallel_group` (else the world group, when its size is
      ``cp_size``); see :mod:`xattn.torch.cp_group`.

    Arguments as NeMo takes them: ``cp_size`` an int (None means 1), ``has_packed_sequence`` a bool, an int
    or None (read by truth value). Raises TypeError/ValueError for other types, ``cp_size < 1`` or a missing
    group, NotImplementedError for packed documents under CP, ImportError without transformers."""
    if cp_size is None:
        cp_size = 1
    if isinstance(cp_size, bool) or not isinstance(cp_size, numbers.Integral):
        raise TypeError(f"cp_size: expected an int, got {type(cp_size).__name__}")
    if cp_size < 1:
        raise ValueError(f"cp_size: expected a positive int, got {cp_size!r}")
    if has_packed_sequence is not None and not isinstance(has_packed_sequence, (bool, numbers.Integral)):
        raise TypeError(f"has_packed_sequence: expected a bool (or an int, None), got "
                        f"{type(has_packed_sequence).__name__}")
    if cp_size > 1 and has_packed_sequence:
        raise NotImplementedError("cp_size > 1 with packed sequences: context parallelism runs one sequence per "
                                  "row (documents across shards are not supported)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ImportError("attn_implementation='ffpa' needs transformers: pip install 'transformers>=5'") from None
    cp_group.activate(int(cp_size))
    register_ffpa_attention()


# --- the attention function -----------------------------------------------------------------

def _packed_kwargs(kwargs, batch: int, q_len: int):
    """``((cu_q, cu_k), (max_q, max_k))`` from ``cu_seq_lens_q/k`` or restarting ``position_ids``, else None."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None or batch != 1:
            raise ValueError("cu_seq_lens_q/cu_seq_lens_k: give both, with batch size 1 (packed rows)")
        mq, mk = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        mq = int((cu_q[1:] - cu_q[:-1]).max()) if mq is None else int(mq)
        mk = int((cu_k[1:] - cu_k[:-1]).max()) if mk is None else int(mk)
        return (cu_q, cu_k), (mq, mk)
    pos = kwargs.get("position_ids")
    if pos is None or batch != 1 or pos.dim() != 2 or pos.shape[-1] != q_len:
        return None
    starts = torch.nonzero(pos[0, 1:] - pos[0, :-1] != 1).flatten() + 1  # HF's rule: a step other than +1
    if starts.numel() == 0:
        return None
    bounds = torch.cat([starts.new_zeros(1), starts, starts.new_tensor([q_len])])
    longest = int((bounds[1:] - bounds[:-1]).max())
    return (bounds, bounds), (longest, longest)


def _plan(module, query, key, attention_mask, kwargs) -> KernelMask:
    """The layer's plan: the factory's mask (plus FA-style ``cu_seq_lens_*`` documents) or one from kwargs."""
    if isinstance(attention_mask, KernelMask):
        attention_mask.check(query, key)
        if kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is None or attention_mask.varlen:
            _note_unseparated_documents(attention_mask, kwargs.get("position_ids"))
            return attention_mask
        if attention_mask.q_length != attention_mask.kv_length:
            raise ValueError("cu_seq_lens_q/k: packed documents with a KV cache are not supported")
        window = attention_mask.window
    else:
        window = hf_window(_causal(module, kwargs), kwargs.get("sliding_window"))
    packed = _packed_kwargs(kwargs, query.shape[0], query.shape[2])
    return plan_without_mask(query, key, window, *(packed or (None, None)))


def _note_unseparated_documents(plan: KernelMask, position_ids) -> None:
    """Restarting ``position_ids`` on a mask that does not separate documents (HF builds such masks
    when a cache is in use): run as SDPA does, documents attending to each other, and say so once."""
    if plan.varlen or plan.notes.get("positions_checked") or position_ids is None or position_ids.dim() != 2 \
            or plan.batch_size != 1 or plan.q_length != plan.kv_length or position_ids.shape[-1] != plan.q_length:
        return
    plan.notes["positions_checked"] = True
    if bool((position_ids[0, 1:] - position_ids[0, :-1] != 1).any()):
        _warn_once("packed_position_ids", "position_ids restart, but HF's mask does not separate the documents "
                   "(a cache is in use): they attend to each other, as under sdpa. Pass use_cache=False, or "
                   "cu_seq_lens_q/k, to keep them apart", target="the mask as given")


def _causal(module, kwargs) -> bool:
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _padding_layout(query, key, attention_mask) -> tuple[torch.Tensor, int]:
    """``(keep [B, Nk] bool, base)`` of a caller's 2D padding mask ``[B, W]`` (True/1 = real token):
    query ``i`` sits at key position ``base + i``.

    As HF's FlashAttention path (``_upad_input``) and NeMo read it: a mask as wide as the keys covers
    them; a wider one (sliding-window cache) covers the last ``Nk`` keys (``[:, -Nk:]``); a narrower
    one (static cache) covers the first ``W`` keys, the rest are empty cache slots that no query sees,
    and the queries are the last ``Nq`` of those ``W``. ValueError for a batch or width that cannot
    describe these keys."""
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask.shape[0] != b:
        raise ValueError(f"attention_mask: a 2D padding mask [batch, keys] needs batch {b}, got shape "
                         f"{tuple(attention_mask.shape)}")
    width = attention_mask.shape[1]
    keep = attention_mask.bool()
    if width >= nk:
        return keep[:, width - nk:], nk - nq
    if width < nq:
        raise ValueError(f"attention_mask: a 2D padding mask of {width} keys is narrower than the {nq} queries "
                         f"(key length {nk}); it must cover at least the queries' own positions")
    return torch.cat([keep, keep.new_zeros(b, nk - width)], dim=1), width - nq


def _padding_plan(module, query, key, keep, base, kwargs) -> KernelMask | None:
    """The plan of a 2D padding mask (:func:`_padding_layout`); causality and ``sliding_window`` from kwargs
    (HF's FlashAttention convention). None (after a warning) where SDPA would differ from the kernels
    (e.g. uneven right padding)."""
    window = hf_window(_causal(module, kwargs), kwargs.get("sliding_window"))
    b, nq, nk = query.shape[0], query.shape[2], key.shape[2]
    plan = plan_hf_mask(Pattern(*window), b, nq, nk, base, 0, keep, query.device,
                        lambda: _padding_sdpa_mask(query, key, keep, base, window))
    if isinstance(plan, str):
        _warn_once("mask", plan)
        return None
    return plan


def _padding_sdpa_mask(query, key, keep, base, window):
    """The exact SDPA mask ``[B, 1, Nq, Nk]`` of a 2D padding mask (:func:`_padding_layout`)."""
    return window_mask(query.shape[2], key.shape[2], base, window, query.device)[None, None] & keep[:, None, None, :]


def _check_inputs(query, key, value, scaling) -> None:
    """TypeError/ValueError naming the argument for what neither the kernels nor SDPA can run."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor [batch, heads, sequence, head_dim], got "
                            f"{type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, sequence, head_dim] (SDPA layout), got shape "
                             f"{tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if scaling is not None and (isinstance(scaling, bool) or not math.isfinite(float(scaling))):
        raise ValueError(f"scaling: expected a finite float, got {scaling!r}")


def _fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs) -> tuple[str, str] | None:
    if query.dtype not in _DTYPES:
        return "dtype", f"{query.dtype} is not float16/bfloat16"
    if softcap is not None:
        return "softcap", f"softcap={softcap} has no kernel here"
    if kwargs.get("s_aux") is not None:
        return "s_aux", "attention sinks (s_aux) have no kernel"
    if dropout and getattr(module, "training", False):
        return "dropout", f"attention dropout {dropout} while training"
    if scaling is None:
        return "scaling", "no explicit scaling given (never assumed 1/sqrt(d))"
    if scaling <= 0:
        return "scaling", f"scaling={scaling}: the kernels take a positive scale only"
    if kwargs.get("position_bias") is not None:
        return "position_bias", "an additive position bias has no kernel"
    windowed = plan.window not in ((None, None), (None, 0))
    if family_for(query.shape[-1], value.shape[-1], windowed) is None:
        what = "with a sliding window " if windowed else ""
        return "ffpa_unavailable", f"no kernel {what}for head dims {query.shape[-1]}/{value.shape[-1]}"
    why = kernels_available()
    if why is not None:
        return "ffpa_unavailable", why
    return None


def _run_kernels(plan: KernelMask, query, key, value, scaling):
    """The kernels on ``[B, N, H, D]`` views; returns ``[B, Nq, Hq, Dv]`` contiguous."""
    if plan.kv_start or plan.kv_stop is not None:
        key, value = key[:, :, plan.kv_start:plan.kv_stop], value[:, :, plan.kv_start:plan.kv_stop]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    windowed = plan.window not in ((None, None), (None, 0))
    kw = dict(softmax_scale=scaling, causal=plan.causal, window_size=plan.window if windowed else (None, None),
              family=family_for(query.shape[-1], value.shape[-1], windowed))
    if not plan.varlen:
        return attention(q, k, v, **kw)
    b, nq, nk = q.shape[0], q.shape[1], k.shape[1]
    out = attention(q.reshape(b * nq, *q.shape[2:]), k.reshape(b * nk, *k.shape[2:]),
                    v.reshape(b * nk, *v.shape[2:]), cu_seqlens_q=plan.cu_seqlens_q,
                    cu_seqlens_k=plan.cu_seqlens_k, max_seqlen_q=plan.max_seqlen_q,
                    max_seqlen_k=plan.max_seqlen_k, **kw)
    return out.reshape(b, nq, *out.shape[1:])


def ffpa_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                           softcap=None, **kwargs):
    """HF attention function: query ``[B, Hq, Nq, D]``, key/value ``[B, Hkv, Nk, D/Dv]`` -> ``(out [B, Nq, Hq, Dv]
    contiguous, weights)``; the kernels where exact, else the exact fallback (see the module docstring).
    ``weights`` is None except on the eager fallback (softcap, ``s_aux``), which returns the model's eager
    attention probabilities ``[B, Hq, Nq, Nk]``, as ``attn_implementation="eager"`` does.
    Non-tensor, non-4D or non-floating inputs and a NaN/inf ``scaling`` raise TypeError/ValueError naming
    the argument; ``scaling <= 0`` runs on SDPA (the kernels take a positive scale)."""
    _check_inputs(query, key, value, scaling)
    if isinstance(attention_mask, PlannedMask):
        attention_mask = attention_mask.plan
    group = cp_group.active_group()
    if group is not None:
        return _run_sharded(group, module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs), None
    if _is_block_mask(attention_mask):
        return hf_fallback.run_flex(module, query, key, value, attention_mask, scaling, softcap, kwargs)
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        keep, base = _padding_layout(query, key, attention_mask)
        plan = _padding_plan(module, query, key, keep, base, kwargs)
        if plan is None:
            window = hf_window(_causal(module, kwargs), kwargs.get("sliding_window"))
            return _exact_fallback(module, query, key, value, _padding_sdpa_mask(query, key, keep, base, window),
                                   dropout, scaling, softcap, kwargs)
    elif attention_mask is not None and not isinstance(attention_mask, KernelMask):
        if not getattr(attention_mask, "_xattn_factory_fallback", False):  # the factory warned already
            _warn_once("4d_mask", "a mask tensor from outside the ffpa mask factory runs on SDPA as given")
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs)
    else:
        plan = _plan(module, query, key, attention_mask, kwargs)
    reason = _fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs)
    if reason is not None:
        _warn_once(*reason, target="eager" if reason[0] in ("softcap", "s_aux") else "sdpa")
        return _exact_fallback(module, query, key, value, plan.sdpa_mask(), dropout, scaling, softcap, kwargs)
    return _run_kernels(plan, query, key, value, scaling), None


def _run_sharded(group, module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs):
    """A context-parallel layer: ring attention (global) or its halo exchange (sliding) on this rank's shard."""
    if attention_mask is not None and not isinstance(attention_mask, KernelMask):
        raise NotImplementedError("context parallelism: this layer's mask is not a pattern the ring runs "
                                  f"({type(attention_mask).__name__}); sharded layers have no SDPA fallback")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise NotImplementedError("context parallelism: packed documents (cu_seq_lens_q/k) are not supported")
    if attention_mask is None:
        window = hf_window(_causal(module, kwargs), kwargs.get("sliding_window"))
    else:
        attention_mask.check(query, key)
        window = attention_mask.window
    _check_sharded_positions(group, kwargs.get("position_ids"), query.shape[2], attention_mask)
    plan = KernelMask(query.shape[0], query.shape[2], key.shape[2], window)
    reason = _fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs)
    if reason is not None:
        raise NotImplementedError(f"context parallelism: {reason[1]} ({reason[0]}); sharded layers have no fallback")
    windowed = window not in ((None, None), (None, 0))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return ring_attention(q, k, v, group=group, causal=window == (None, 0), softmax_scale=scaling,
                          window_size=window if windowed else (None, None),
                          family=family_for(query.shape[-1], value.shape[-1], windowed))


def _check_sharded_positions(group, position_ids, n_local: int, plan: KernelMask | None) -> None:
    """ValueError unless ``position_ids [B, N_local]`` are this rank's load-balanced shard
    (:func:`xattn.torch.ring.sequence_positions`) in every row: the ring computes on that layout alone, so
    packed documents, a contiguous shard or HF's default ``arange`` positions would give wrong attention.
    Once per forward (the factory's plan remembers it); the verdict is all-reduced, so every rank raises
    together instead of leaving the others waiting in a ring step."""
    if plan is not None and plan.notes.get("positions_checked"):
        return
    if position_ids is None:
        raise ValueError("context parallelism: the 'ffpa' layers need position_ids (this rank's shard of the "
                         "global positions, xattn.torch.sequence_positions(N, group)) to check the ring's layout")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() not in (1, 2) \
            or position_ids.shape[-1] != n_local:
        raise ValueError(f"context parallelism: position_ids must be [batch, {n_local}] (this rank's shard), got "
                         f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
    import torch.distributed as dist

    from .ring import sequence_positions

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    want = sequence_positions(n_local * world, rank=rank, world_size=world, device=position_ids.device)
    bad = (position_ids.reshape(-1, n_local) != want).any().to(torch.int32).reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if bool(bad.item()):
        raise ValueError("context parallelism: position_ids do not match the ring's load-balanced layout on every "
                         "rank (each rank must hold chunks r and 2P-1-r of one unpacked sequence per row: "
                         "xattn.torch.shard_sequence / sequence_positions). Packed documents, contiguous shards and "
                         "positions restarting inside a row cannot run on the ring")
    if plan is not None:
        plan.notes["positions_checked"] = True


def _exact_fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    """:func:`_fallback` with a mask xattn built (bool ``[B, 1, Nq, Nk]``): rows that see no key come out 0, as
    on the kernels. SDPA leaves them to its backend (CUDA's memory-efficient kernel returns nonzero values
    there, measured on the H200; the CPU returns 0), so the result would depend on the device."""
    out, weights = _fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs)
    dead = ~mask.any(-1)  # [B or 1, 1, Nq]
    if bool(dead.any()):
        out = out.masked_fill(dead[:, 0, :, None, None], 0.0)
    return out, weights


def _fallback(module, query, key, value, mask, dropout, scaling, softcap, kwargs):
    if softcap is not None or kwargs.get("s_aux") is not None:
        return hf_fallback.run_eager(module, query, key, value, mask, dropout, scaling, softcap, kwargs)
    return hf_fallback.run_sdpa(module, query, key, value, mask, dropout, scaling, kwargs)


# --- low level (SDPA layout), building blocks of ring attention -------------------------------

def _ffpa_dense_fwd(q, k, v, scale: float, causal: bool):
    """Forward on SDPA layout: q ``[B, Hq, Nq, D]``, k/v ``[B, Hkv, Nk, D]`` -> ``(out [B, Hq, Nq, D], lse [B, Hq, Nq]
    fp32)``. GQA and causal (bottom-right aligned) handled; results are not differentiable (the caller
    merges out/lse and calls :func:`_ffpa_dense_bwd`)."""
    with torch.no_grad():
        out, lse = attention_with_lse(*(t.transpose(1, 2) for t in (q, k, v)), softmax_scale=scale, causal=causal,
                                      family=default_family(q.shape[-1], v.shape[-1]))
    return out.transpose(1, 2), lse


def _ffpa_dense_bwd(grad_out, q, k, v, out, lse, scale: float, causal: bool):
    """Backward from the caller's ``out``/``lse`` (e.g. ring-merged), SDPA layout: ``(dq, dk, dv)`` ``[B, H, N, D]``
    with dk/dv reduced to the Hkv heads."""
    t = [x.transpose(1, 2) for x in (grad_out, q, k, v, out)]
    dq, dk, dv = _bwd_op(t[0].contiguous(), t[1], t[2], t[3], t[4], lse, default_family(q.shape[-1], v.shape[-1]),
                         float(scale), bool(causal), -1, -1, None, None, 0, 0)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _ffpa_varlen_fwd(q_pack, k_pack, v_pack, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool):
    """Packed THD forward: q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``, int32 ``cu_q/cu_k [S + 1]`` ->
    ``(out [Tq, Hq, D], lse [Hq, Tq] fp32)``, not differentiable."""
    with torch.no_grad():
        return attention_with_lse(q_pack, k_pack, v_pack, softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q,
                                  cu_seqlens_k=cu_k, max_seqlen_q=int(max_q), max_seqlen_k=int(max_k),
                                  family=default_family(q_pack.shape[-1], v_pack.shape[-1]))


def _ffpa_varlen_bwd(grad_out_pack, q_pack, k_pack, v_pack, out_pack, lse_pack, cu_q, cu_k, max_q: int, max_k: int,
                     scale: float, causal: bool):
    """Packed THD backward from the caller's ``out_pack``/``lse_pack``: ``(dq [Tq, Hq, D], dk, dv [Tk, Hkv, D])``."""
    return _bwd_op(grad_out_pack.contiguous(), q_pack, k_pack, v_pack, out_pack, lse_pack,
                   default_family(q_pack.shape[-1], v_pack.shape[-1]), float(scale), bool(causal), -1, -1,
                   cu_q, cu_k, int(max_q), int(max_k))
