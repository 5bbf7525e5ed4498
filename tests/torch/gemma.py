"""A tiny random Gemma 4 text model run per attention implementation, for the "ffpa" vs "sdpa"
parity tests (CPU with the reference stand-in, GPU with the real kernels).

A random model this small is numerically rough: "sdpa" itself is ~7 % (bf16) or ~0.5 % (fp16)
away from the same weights in fp64 on the logits, and further on the grads. So parity is judged
the FlashAttention way: both low-precision models are compared with an fp64 "sdpa" run of the
SAME (rounded) weights, and "ffpa" must be about as close to it as "sdpa" is.

Each model gets its OWN config object: ``from_config`` writes ``_attn_implementation`` into the
config it is given, so two models built from one config would both run the last one set."""

import torch

from tests.reference import rel_err
from xattn.torch import ffpa_attention as fa
from xattn.torch.hf import routing


def tiny_gemma4_config(hidden=64, layers=2, heads=4, kv_heads=2, vocab=64, sliding_window=4, layer_types=None):
    """Full layers head_dim 512 (one KV head, k == v), sliding layers head_dim 256 with GQA."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=sliding_window,
        layer_types=layer_types or ["sliding_attention", "full_attention"] * (layers // 2), max_position_embeddings=256,
        vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=16)  # not the 262144 x 256 default table


def parity(monkeypatch, config_kwargs, ids, mask, device, dtype=torch.float16):
    """Run ``ids``/``mask`` [B, N] through "sdpa" and "ffpa" in ``dtype`` and fp64 "sdpa" (the
    truth), all with the same ``dtype``-rounded weights, loss ``mean(logits[non-pad]**2)``.

    Returns ``(errs, layers, calls)``:
    ``errs = {"sdpa"|"ffpa": (logits_err, {param: grad_err})}`` relative to the truth;
    ``layers``: per attention call of the "ffpa" model, ``(head_dim, {"out"|"dq"|"dk"|"dv": err})``
    of the "ffpa" function against its fp64 fallback on the same inputs (the activations and
    masks the model really hands over; a fresh random ``dout``) -- sharp where the whole-model
    numbers are blurred by the model's own rounding;
    ``calls``: how often each model entered xattn's kernel path
    (``xattn.torch.hf.routing.attention``)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    fa.register_ffpa_attention()
    calls = {"truth": 0, "sdpa": 0, "ffpa": 0, "layer check": 0}
    current = []
    layers = []
    kernel_call, ffpa_forward = routing.attention, fa.ffpa_attention_forward

    def counting_attention(*args, **kwargs):
        calls[current[0]] += 1
        return kernel_call(*args, **kwargs)

    def checked_forward(module, query, key, value, attention_mask, *args, **kwargs):
        result = ffpa_forward(module, query, key, value, attention_mask, *args, **kwargs)
        outer = current[0]
        current[:] = ["layer check"]
        with torch.enable_grad():
            errs = {}
            for_ref, for_ffpa = ([t.detach().to(dt).requires_grad_() for t in (query, key, value)]
                                 for dt in (torch.float64, query.dtype))
            ref = ffpa_forward(module, *for_ref, attention_mask, *args, **kwargs)[0]  # fp64: the SDPA fallback
            out = ffpa_forward(module, *for_ffpa, attention_mask, *args, **kwargs)[0]
            dout = torch.randn_like(ref)
            ref.backward(dout)
            out.backward(dout.to(out.dtype))
            errs["out"] = rel_err(out, ref)
            for name, a, b in zip(("dq", "dk", "dv"), for_ffpa, for_ref):
                errs[name] = rel_err(a.grad, b.grad)
        layers.append((query.shape[-1], errs))
        current[:] = [outer]
        return result

    monkeypatch.setattr(routing, "attention", counting_attention)
    monkeypatch.setitem(AttentionInterface._global_mapping, "ffpa", checked_forward)
    runs = {"truth": ("sdpa", torch.float64), "sdpa": ("sdpa", dtype), "ffpa": ("ffpa", dtype)}
    torch.manual_seed(0)
    weights = AutoModelForCausalLM.from_config(tiny_gemma4_config(**config_kwargs)).to(dtype).state_dict()
    keep = mask.bool()
    logits, grads = {}, {}
    for name, (impl, run_dtype) in runs.items():
        model = AutoModelForCausalLM.from_config(tiny_gemma4_config(**config_kwargs), attn_implementation=impl)
        model.load_state_dict(weights)
        model.to(device, run_dtype)
        assert model.config._attn_implementation == impl
        current[:] = [name]
        out = model(input_ids=ids, attention_mask=mask).logits.double()[keep]
        out.square().mean().backward()
        logits[name] = out.detach()
        grads[name] = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
    errs = {name: (rel_err(logits[name], logits["truth"]),
                   {n: rel_err(g, grads["truth"][n]) for n, g in grads[name].items()})
            for name in ("sdpa", "ffpa")}
    return errs, layers, calls


def summary(errs, layers, dtype) -> str:
    """One line per implementation: logits error and worst / median parameter-grad error; one per
    attention call: its errors against fp64."""
    lines = [f"attention call {i} (head_dim {d}, {str(dtype)[6:]}) vs fp64: "
             + ", ".join(f"{k} {v:.2e}" for k, v in e.items()) for i, (d, e) in enumerate(layers)]
    for name, (logit_err, grad_errs) in errs.items():
        worst = max(grad_errs, key=grad_errs.get)
        median = sorted(grad_errs.values())[len(grad_errs) // 2]
        lines.append(f"{name} {str(dtype)[6:]} vs fp64 sdpa: logits {logit_err:.2e}; {len(grad_errs)} param grads: "
                     f"max {grad_errs[worst]:.2e} ({worst}), median {median:.2e}")
    return "\n".join(lines)


def assert_parity(errs, layers, slack=1.5, logits_floor=1e-3, grad_floor=1e-2, layer_tol=1e-2):
    """Every attention call's out/dq/dk/dv within ``layer_tol`` of fp64; and the whole model: ffpa
    at most ``slack`` times as far from the truth as sdpa (plus a floor), on the logits and on
    every parameter grad."""
    assert layers, "the ffpa model made no attention call"
    for head_dim, layer_errs in layers:
        for name, e in layer_errs.items():
            assert e < layer_tol, (head_dim, name, e)
    (s_logits, s_grads), (f_logits, f_grads) = errs["sdpa"], errs["ffpa"]
    assert f_logits <= slack * s_logits + logits_floor, ("logits", f_logits, s_logits)
    for n, e in f_grads.items():
        assert e <= slack * s_grads[n] + grad_floor, (n, e, s_grads[n])
