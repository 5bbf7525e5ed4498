"""A Gemma 4 training step with the sequence sharded over P ranks (context parallelism through HF's
``"ffpa"``), against the same step on one process: shared by the CPU (gloo, fp64 stand-in kernels) and
the 2xH200 (NCCL, real kernels) tests.

The step: LM loss = mean cross-entropy of next-token targets, shifted on the GLOBAL sequence before
sharding (a shard's last token predicts a token on another rank). Each rank sums its tokens' losses;
the loss and every parameter gradient are all-reduced (what DDP over the CP group would do)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.torch import gemma_packed as gp
from xattn.torch import context_parallel, ring, setup_ffpa_backend


def build(impl, dtype, device, seed=0, weights_dtype=None, **overrides):
    """Gemma 4's real layer mix (5 sliding d256 GQA : 1 full d512, ``tests/torch/gemma_packed.py``) with
    well-conditioned random weights rounded to ``weights_dtype`` (default ``dtype``), run in ``dtype``;
    the same on every rank for the same seed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(gp.config(**overrides), attn_implementation=impl)
    model.load_state_dict(gp.weights(weights_dtype or dtype, seed, **overrides))
    return model.to(device, dtype)


def targets(ids):
    """Next-token targets ``[B, N]`` of ``ids``, -100 at the end."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def step(model, ids, labels, position_ids=None, group=None):
    """``(loss, {param: grad fp64})``: loss summed over tokens then divided by the global token count."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=position_ids, use_cache=False).logits
    loss_sum = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    count = torch.tensor(float((labels != -100).sum()), dtype=torch.float64, device=ids.device)
    if group is not None:
        dist.all_reduce(count, group=group)
    (loss_sum / count).backward()
    loss = (loss_sum / count).detach()
    grads = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    if group is not None:
        dist.all_reduce(loss, group=group)
        for g in grads.values():
            dist.all_reduce(g, group=group)
    return float(loss), grads


def sharded_step(model, ids, group=None, mode="context"):
    """The CP step on this rank's shard of ``ids`` (the full ``[B, N]`` batch, same on every rank).
    ``mode``: ``"context"`` (``with context_parallel(group)``) or ``"setup"`` (``setup_ffpa_backend``)."""
    group = group or dist.group.WORLD
    labels = targets(ids)
    shard = dict(group=group)
    local_ids, local_labels = ring.shard_sequence(ids, **shard), ring.shard_sequence(labels, **shard)
    positions = ring.sequence_positions(ids.shape[1], group, device=ids.device)[None].expand(ids.shape[0], -1)
    if mode == "context":
        with context_parallel(group):
            return step(model, local_ids, local_labels, positions, group)
    setup_ffpa_backend(dist.get_world_size(group), False)
    try:
        return step(model, local_ids, local_labels, positions, group)
    finally:
        setup_ffpa_backend(1, False)
