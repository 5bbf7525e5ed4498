"""HF continuous batching throughput (issue #44): generated tokens per second of ``model.generate_batch`` on HF Gemma 4
with the 31B layer dims (:func:`benchmarks.ring.gemma4_31b_dims`: 6 layers, 5 sliding : 1 full, vocab 8192), bf16,
well-conditioned weights, ``--requests`` concurrent requests of ``--prompt`` tokens, ``--tokens`` greedy new tokens
each. Impls: ``ffpa`` (xattn, registered for continuous batching as ``"ffpa_flash"``,
:mod:`xattn.torch.hf.continuous_batching`) and ``sdpa`` (transformers' own).

    python benchmarks/continuous_batching.py [--impls ffpa,sdpa] [--requests 8,32,64] [--prompt 8192]
                                             [--tokens 64] [--out FILE]

transformers 5.25's continuous-batching cache sizes every full-attention layer by the config's one head dim, so a
Gemma 4 whose global layers have their own (``global_head_dim`` 512, 4 KV heads) fails there under every
implementation. :func:`per_layer_full_attention_cache` sizes each full-attention group by its own layers' dims
instead, for both impls alike (a benchmark-only patch of transformers' allocator, applied while this runs).

Each (impl, requests) runs once after a warm-up ``generate_batch`` of 2 short requests; ``tokens_per_s`` = new
tokens of all requests / wall seconds of the call (prefill included, as a server sees it). ``tokens_equal_sdpa``: the
share of requests whose tokens equal sdpa's (bf16 near ties may flip; the correctness judgment is
``tests/torch/test_hf_continuous_batching*.py``). Rows: ``impl, requests, prompt_len, new_tokens, seconds,
tokens_per_s, status``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DEVICE = os.environ.get("CB_DEVICE", "cuda")  # "cpu": a smoke run (tests), no timings worth reading


def log(msg: str) -> None:
    print(f"[cb {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextlib.contextmanager
def per_layer_full_attention_cache():
    """transformers' full-attention cache allocator sized by its group's own layers (head dim, KV heads)."""
    from transformers.generation.continuous_batching.cache_allocators import full_attention

    cls = full_attention.FullAttentionCacheAllocator
    original = cls.__init__

    def init(self, index, config, num_key_value_heads, cache_dtype, page_size, layer_indices, allow_block_sharing):
        layer = config.per_layer_config[layer_indices[0]]
        original(self, index, config, layer.num_key_value_heads, cache_dtype, page_size, layer_indices,
                 allow_block_sharing)
        if self.head_dim != layer.head_dim:  # the config's one head dim: size the pages by this group's
            self.head_dim = layer.head_dim
            per_page = self.get_bytes_per_page(layer.num_key_value_heads, layer.head_dim, cache_dtype, page_size)
            self._before_cache_tensor_init(index=index, layer_indices=layer_indices, tokens_per_page=page_size,
                                           bytes_per_page=per_page, allow_block_sharing=allow_block_sharing)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def build(impl: str, config=None):
    """The model (bf16 on :data:`DEVICE`), its attention set for continuous batching."""
    import torch
    from transformers import AutoModelForCausalLM

    from benchmarks.e2e_gemma4 import condition
    from benchmarks.ring import gemma4_31b_dims
    from xattn.torch.hf import continuous_batching

    config = config or gemma4_31b_dims(6, 8192)
    config.allow_global_per_layer_attribute_access = True
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16)
    condition(model, DEVICE)
    if impl == "ffpa":
        continuous_batching.enable_continuous_batching(model)
    return model.eval()


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(length + n)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def generate(model, batch: list[list[int]], tokens: int) -> list[list[int]]:
    from transformers import GenerationConfig

    from xattn.torch.hf.continuous_batching import batching_config

    gen = GenerationConfig(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    out = model.generate_batch(batch, generation_config=gen,
                               continuous_batching_config=batching_config())
    errors = [r.error for r in out.values() if r.error is not None]
    if errors:
        raise RuntimeError(errors[0][:300])
    return [r.generated_tokens for r in sorted(out.values(), key=lambda r: int(r.request_id[4:]))]


def measure(model, impl: str, n: int, prompt: int, tokens: int, vocab: int) -> dict:
    import torch

    row = dict(impl=impl, requests=n, prompt_len=prompt, new_tokens=tokens)
    try:
        batch = prompts(n, prompt, vocab)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, batch, tokens)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    except torch.OutOfMemoryError:
        return dict(row, status="oom")
    except Exception as exc:  # a row says why; the run goes on
        return dict(row, status=f"error: {type(exc).__name__}: {str(exc)[:200]}")
    return dict(row, seconds=round(seconds, 3), tokens_per_s=round(n * tokens / seconds, 1), status="ok",
                tokens=out)


def main(argv=None, config=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="ffpa,sdpa")
    ap.add_argument("--requests", default="8,32,64")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rows = []
    with per_layer_full_attention_cache():
        for impl in args.impls.split(","):
            model = build(impl, config)
            vocab = model.config.get_text_config().vocab_size
            generate(model, prompts(2, 16, vocab), 2)  # warm-up: kernels loaded, graphs captured
            for n in map(int, args.requests.split(",")):
                row = measure(model, impl, n, args.prompt, args.tokens, vocab)
                row.update(device=_device_name(), date=time.strftime("%Y-%m-%d"))
                rows.append(row)
                log(" ".join(f"{k}={row.get(k)}" for k in ("impl", "requests", "prompt_len", "tokens_per_s",
                                                           "seconds", "status")))
                _write(args.out, rows)  # row by row: a run cut short keeps what it measured
            del model
    sdpa = {r["requests"]: r.get("tokens") for r in rows if r["impl"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        if r["status"] == "ok" and r["requests"] in sdpa:
            same = sum(a == b for a, b in zip(r["tokens"], sdpa[r["requests"]]))
            r["tokens_equal_sdpa"] = round(same / r["requests"], 3)
    _write(args.out, rows)
    return rows


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE


def _write(path: str | None, rows: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"suite": __doc__.split("\n\n")[0], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
