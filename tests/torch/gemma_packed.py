"""Packed and padded batches through a tiny Gemma 4 with its real layer mix, for the CPU (stand-in
kernels) and GPU (real kernels) tests.

The model: 6 layers, 5 sliding (head_dim 256, GQA, window smaller than the documents) : 1 full
(head_dim 512, one KV head, k == v), with every ``q_norm.weight`` scaled by 0.1 so attention scores
have std ~2 (well-conditioned: bf16 rounding alone then moves logits by a few %, not 20-60 %).

Truth: the same (rounded) weights in fp64 on ``"sdpa"``, each document run ALONE. The packed
batch through ``"ffpa"`` must be no further from it than ``"sdpa"`` (packed, same dtype) is, on
the logits and on every parameter gradient of the loss ``sum(logits**2) / tokens``.
"""

import torch

from tests.reference import rel_err
from xattn.torch import ffpa_attention as fa

from .gemma import tiny_gemma4_config

LAYER_MIX = ["sliding_attention"] * 5 + ["full_attention"]


def config(**overrides):
    kw = dict(hidden=64, layers=6, heads=4, kv_heads=2, vocab=96, sliding_window=5)
    kw.update(overrides)
    return tiny_gemma4_config(**kw, layer_types=LAYER_MIX * (kw["layers"] // 6))


def weights(dtype, seed=0, **overrides):
    """The model's state dict, well-conditioned (q_norm x 0.1) and rounded to ``dtype``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_norm.weight"):
                p.mul_(0.1)
    return model.to(dtype).state_dict()


def build(impl, state, device, dtype, **overrides):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config(**overrides), attn_implementation=impl)  # own config
    model.load_state_dict(state)
    model.to(device, dtype)
    assert model.config._attn_implementation == impl
    return model


def _loss_and_grads(model, runs, tokens):
    """Sum of ``logits**2 / tokens`` over ``runs`` (each a dict of model kwargs + a boolean ``keep``)."""
    model.zero_grad()
    logits = []
    for run in runs:
        run = dict(run)
        keep = run.pop("keep")
        out = model(**run).logits.double()[keep]
        (out.square().sum() / tokens).backward()
        logits.append(out.detach())
    grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(logits), grads


def packed_runs(ids, lengths, route, device):
    """One packed row of the documents: HF's ``position_ids`` route, or FlashAttention-style
    ``cu_seq_lens_q/k`` (with a cache, so HF's own mask does not separate the documents)."""
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    run = dict(input_ids=ids, position_ids=pos, keep=torch.ones_like(ids, dtype=torch.bool))
    if route == "position_ids":
        run["use_cache"] = False
    else:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        run.update(use_cache=True, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                   max_length_k=max(lengths))
    return [run]


def alone_runs(ids, lengths, device):
    runs, start = [], 0
    for n in lengths:
        doc = ids[:, start:start + n]
        runs.append(dict(input_ids=doc, position_ids=torch.arange(n, device=device)[None], use_cache=False,
                         keep=torch.ones_like(doc, dtype=torch.bool)))
        start += n
    return runs


def padded_runs(ids, keep):
    return [dict(input_ids=ids, attention_mask=keep.long(), use_cache=False, keep=keep)]


def padded_alone_runs(ids, keep, device):
    runs = []
    for r in range(ids.shape[0]):
        row = ids[r:r + 1, keep[r]]
        runs.append(dict(input_ids=row, use_cache=False, keep=torch.ones_like(row, dtype=torch.bool)))
    return runs


def compare(ffpa_runs, sdpa_runs, truth_runs, device, dtype, tokens, counter=None, **overrides):
    """``{"ffpa"|"sdpa": (logits_err, {param: grad_err})}`` against fp64 sdpa on ``truth_runs``;
    ``counter(name)`` is told which model runs (for kernel-call counting)."""
    fa.register_ffpa_attention()
    state = weights(dtype, **overrides)
    truth = _loss_and_grads(build("sdpa", state, device, torch.float64, **overrides), truth_runs, tokens)
    errs = {}
    for name, runs in (("sdpa", sdpa_runs), ("ffpa", ffpa_runs)):
        if counter:
            counter(name)
        logits, grads = _loss_and_grads(build(name, state, device, dtype, **overrides), runs, tokens)
        errs[name] = (rel_err(logits, truth[0]), {n: rel_err(g, truth[1][n]) for n, g in grads.items()})
    return errs


def summary(errs, label) -> str:
    lines = []
    for name, (logit_err, grads) in errs.items():
        median = sorted(grads.values())[len(grads) // 2]
        worst = max(grads, key=grads.get)
        lines.append(f"{label}: {name} vs fp64 sdpa alone: logits {logit_err:.2e}, {len(grads)} grads median "
                     f"{median:.2e} max {grads[worst]:.2e} ({worst})")
    return "\n".join(lines)


def assert_no_worse(errs, slack=1.5, logits_floor=2e-3, grad_floor=1e-2):
    (s_logits, s_grads), (f_logits, f_grads) = errs["sdpa"], errs["ffpa"]
    assert f_logits <= slack * s_logits + logits_floor, ("logits", f_logits, s_logits)
    assert f_grads.keys() == s_grads.keys()
    for n, e in f_grads.items():
        assert e <= slack * s_grads[n] + grad_floor, (n, e, s_grads[n])
