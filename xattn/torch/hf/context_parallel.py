"""Context parallelism of Hugging Face ``"ffpa"`` layers: while a group is active
(:mod:`xattn.torch.cp_group`), every layer receives this rank's sequence shard in the layout of
:func:`xattn.torch.ring.shard_sequence`; global layers run :func:`xattn.torch.ring.ring_attention`, sliding
layers its halo exchange. Whatever cannot run sharded raises: there is no exact fallback on a shard.

HF hands ``query [B, Hq, N_local, D]`` and ``key/value [B, Hkv, N_local, D/Dv]`` (SDPA layout); the ring
reads ``[B, N, H, D]`` views and returns ``[B, N_local, Hq, Dv]``.
"""

from __future__ import annotations

import torch

from xattn.core.spec import family_for

from ..ring import ring_attention
from . import support
from .call_plan import layer_window
from .kernel_mask import KernelMask

__all__ = ["sharded_plan", "run_sharded"]


def sharded_plan(pattern, mask_function, args) -> KernelMask:
    """The mask factory's plan of a context-parallel forward: the layer's window on global positions (the
    shard's restarting ``position_ids`` are the layout, not documents). ``pattern`` is the
    :class:`~xattn.torch.hf.masks.Pattern` of ``mask_function`` (None: not one the kernels run), ``args`` the
    factory's ``sdpa_mask`` arguments. Raises NotImplementedError for what cannot run sharded."""
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


def run_sharded(group, module, query, key, value, attention_mask, dropout, scaling, softcap, kwargs):
    """A context-parallel layer: ring attention (global) or its halo exchange (sliding) on this rank's shard."""
    if attention_mask is not None and not isinstance(attention_mask, KernelMask):
        raise NotImplementedError("context parallelism: this layer's mask is not a pattern the ring runs "
                                  f"({type(attention_mask).__name__}); sharded layers have no SDPA fallback")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise NotImplementedError("context parallelism: packed documents (cu_seq_lens_q/k) are not supported")
    if attention_mask is None:
        window = layer_window(module, kwargs)
    else:
        attention_mask.check(query, key)
        window = attention_mask.window
    _check_sharded_positions(group, kwargs.get("position_ids"), query.shape[2], attention_mask)
    plan = KernelMask(query.shape[0], query.shape[2], key.shape[2], window)
    reason = support.fallback_reason(module, query, value, dropout, scaling, softcap, plan, kwargs)
    if reason is not None:
        raise NotImplementedError(f"context parallelism: {reason[1]} ({reason[0]}); sharded layers have no fallback")
    windowed = support.is_windowed(window)
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

    from ..ring import sequence_positions

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
