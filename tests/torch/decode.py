"""Greedy decode of a tiny Gemma 4 (sliding d256 + full d512 layers) for the decode tests (issue #25): HF
``generate()`` eager with a ``DynamicCache``, or with one ``StaticCache`` compiled as HF compiles it
(``CompileConfig``: torch.compile, mode "reduce-overhead", CUDA graphs on a GPU)."""

import torch

from .gemma import tiny_gemma4_config

PROMPT, NEW = 40, 12  # the prompt is longer than the sliding window (16): its static cache is full


def model(impl: str, device, dtype=torch.bfloat16, seed: int = 0):
    """The tiny model (2 sliding + 2 full layers, window 16) on ``device``; the same weights for every
    ``impl`` and ``dtype`` (built in fp32, then cast), scores kept in a sane range (``q_norm`` x 0.1)."""
    from transformers import AutoModelForCausalLM

    import xattn.torch as xt

    xt.register_ffpa_attention()
    torch.manual_seed(seed)
    config = tiny_gemma4_config(hidden=128, layers=4, vocab=256, sliding_window=16)
    config.max_position_embeddings = 512
    net = AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("q_norm.weight"):
                p.fill_(0.1)
    return net.to(device=device, dtype=dtype).eval()


def prompt(device, n: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return torch.randint(3, 256, (1, n), generator=g).to(device)


def generate(net, ids, new: int = NEW, graphs: bool = False, cache=None):
    """``(new tokens [new], logits [new, vocab] fp32)`` of a greedy ``generate()``; ``graphs``: a ``StaticCache``
    (or ``cache``, reset first) and HF's compiled decode step (also on the CPU, where there are no graphs)."""
    from transformers import DynamicCache, StaticCache
    from transformers.generation.configuration_utils import CompileConfig

    compile_config = CompileConfig()
    compile_config._compile_all_devices = True  # the CPU test compiles as the GPU does
    if graphs:
        cache = cache or StaticCache(config=net.config, max_cache_len=ids.shape[1] + new)
        cache.reset()
    else:
        cache = DynamicCache(config=net.config)
    with torch.no_grad():
        out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, past_key_values=cache, compile_config=compile_config,
                           disable_compile=not graphs, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], torch.cat(out.logits).float()


def teacher_forced_logits(net, ids, tokens) -> torch.Tensor:
    """Logits ``[len(tokens), vocab]`` fp32 that predict each of ``tokens`` after ``ids``, in one forward."""
    seq = torch.cat([ids[0], tokens])[None]
    with torch.no_grad():
        logits = net(input_ids=seq, use_cache=False).logits[0].float()
    return logits[ids.shape[1] - 1:-1]


def padded_step_logits(net, ids, mask, tokens) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` fp32 of a left-padded batch (``mask`` 0 on the pads) decoded step by step with a
    ``DynamicCache``, fed the fixed ``tokens [B, T]`` (so every model sees the same inputs): each step's last
    position, positions counted from each row's first real token."""
    from transformers import DynamicCache

    cache, m, out = DynamicCache(config=net.config), mask, []
    with torch.no_grad():
        net(input_ids=ids, attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
            use_cache=True)
        for t in tokens.T:
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
            step = net(input_ids=t[:, None], attention_mask=m, position_ids=m.sum(-1, keepdim=True) - 1,
                       past_key_values=cache, use_cache=True)
            out.append(step.logits[:, -1].float())
    return torch.stack(out, 1)
