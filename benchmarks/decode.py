"""Greedy decode latency (issue #25): ms per new token and prefill time of HF Gemma 4 with the 31B
layer dims (:func:`benchmarks.ring.gemma4_31b_dims`: 6 layers, 5 sliding : 1 full, vocab 8192), B 1, bf16,
on well-conditioned weights (:func:`benchmarks.e2e_gemma4.condition`).

    python benchmarks/decode.py [--impls ffpa,sdpa,flash_attention_2] [--modes eager,graphs]
                                [--prompt 8192] [--tokens 64] [--rounds 1] [--repeats 5] [--out FILE]

Modes:

* ``eager``: ``generate()`` with a fresh ``DynamicCache`` (HF's default: eager forward per token).
* ``graphs``: ``generate()`` with one ``StaticCache`` (reset per call), which HF compiles with its default
  ``CompileConfig``: ``torch.compile(mode="reduce-overhead")``, CUDA graphs replayed per token, as
  ``generate(..., cache_implementation="static")`` runs. The prefill runs eager.

Each (impl, mode) runs in its own process: one warm-up ``generate()`` (kernels loaded; graphs compiled
and captured), then ``--repeats`` (5) times a 1-token and a ``--tokens``-token ``generate()`` (synchronised):
``prefill_s`` is the 1-token call, ``ms_per_token`` the difference per extra token (medians). That is
the whole decode step as a user sees it: HF's per-step work (mask creation, logits processing, its
own host syncs) included. ``tokens`` are the greedy tokens, so rows can be compared with sdpa's
(``tokens_equal_sdpa``: the share of leading tokens equal). ``--rounds R`` measures every (impl, mode) R
times, the impls alternating, and reports the median of the rounds (``ms_per_token_rounds``): eager decode
is bound by the host, whose speed drifts between processes (on the H200 machine, by up to 1.5x).
Each ``generate()`` prefills the prompt anew: where one prefill is long (sdpa's d512 prefill at 128k, ~24 s on an
H200), ``--repeats 1`` keeps a row to 3 prefills (``repeats`` is in each row).
Rows: ``impl, mode, prompt_len, new_tokens, ms_per_token, prefill_s, status`` ("ok" / "oom" / "error: ...").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

IMPLS = ("ffpa", "sdpa", "flash_attention_2")
MODES = ("eager", "graphs")
VOCAB = 8192
LAYERS = 6
DEVICE = os.environ.get("DECODE_DEVICE", "cuda")  # "cpu": a smoke run of the loop (tests), no timings worth reading


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[decode {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(impl: str, config=None):
    """HF Gemma 4 (31B layer dims, :data:`LAYERS` layers; or ``config``) on :data:`DEVICE` in bf16 with
    well-conditioned weights, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    import xattn.torch as xt
    from benchmarks.e2e_gemma4 import condition
    from benchmarks.ring import gemma4_31b_dims

    xt.register_ffpa_attention()
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(config or gemma4_31b_dims(LAYERS, VOCAB), attn_implementation=impl,
                                                 dtype=torch.bfloat16)
    condition(model, DEVICE)
    return model.eval()


def prompt_ids(n: int, vocab: int = VOCAB):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(n)
    return torch.randint(0, vocab, (1, n), device=DEVICE, generator=g)


class Decoder:
    """Greedy ``generate()`` of one model in one mode on a fixed prompt (see the module docstring)."""

    def __init__(self, model, mode: str, prompt: int, tokens: int):
        from transformers import StaticCache
        from transformers.generation.configuration_utils import CompileConfig

        self.model, self.mode, self.prompt, self.tokens = model, mode, prompt, tokens
        self.ids = prompt_ids(prompt, model.config.vocab_size)
        self.static = None
        self.compile = CompileConfig()  # HF's default for static caches: torch.compile(mode="reduce-overhead")
        if mode == "graphs":  # one cache for every call: the captured graphs keep its addresses
            self.static = StaticCache(config=model.config, max_cache_len=prompt + tokens)
            self.compile._compile_all_devices = DEVICE != "cuda"  # the CPU smoke run compiles too (no graphs)

    def generate(self, tokens: int) -> tuple[float, list[int]]:
        """``(seconds, new tokens)`` of one synchronised ``generate()`` of ``tokens`` new tokens."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config) if self.static is None else self.static
        if self.static is not None:
            cache.reset()
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), max_new_tokens=tokens,
                                      min_new_tokens=tokens, do_sample=False, past_key_values=cache,
                                      compile_config=self.compile, disable_compile=self.static is None)
        sync()
        return time.perf_counter() - t0, out[0, self.prompt:].tolist()

    def run(self, repeats: int = 5) -> dict:
        """Median over ``repeats`` of: ``prefill_s`` (a 1-token generate), ``ms_per_token`` (the extra time of
        a ``tokens``-token generate, per extra token); and the tokens."""
        import statistics

        self.generate(self.tokens)  # kernels loaded; under graphs: compiled and captured
        prefill, per_token = [], []
        for _ in range(repeats):
            one, _ = self.generate(1)
            full, tokens = self.generate(self.tokens)
            prefill.append(one)
            per_token.append((full - one) / max(self.tokens - 1, 1) * 1e3)
        return dict(prefill_s=statistics.median(prefill), ms_per_token=statistics.median(per_token),
                    ms_per_token_runs=[round(x, 3) for x in per_token], tokens=tokens)


def child(impl: str, mode: str, prompt: int, tokens: int, repeats: int = 5) -> dict:
    import torch

    got = Decoder(build_model(impl), mode, prompt, tokens).run(repeats)
    from torch._dynamo.utils import counters  # after the run: nothing compile-related is imported by eager rows
    stats = dict(unique_graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()),
                 **{k: v for k, v in counters["inductor"].items() if "cudagraph" in k})
    return dict(**got, compile_stats=stats, device=torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE)


def measure(impl: str, mode: str, prompt: int, tokens: int, timeout: float, repeats: int = 5) -> dict:
    from benchmarks.e2e_gemma4 import run_child

    row = dict(impl=impl, mode=mode, prompt_len=prompt, new_tokens=tokens, batch=1, layers=LAYERS, repeats=repeats)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", impl, mode, str(prompt), str(tokens), str(repeats)]
    t0 = time.perf_counter()
    got, row["status"] = run_child(cmd, timeout)
    if got is not None:
        row.update(ms_per_token=round(got["ms_per_token"], 3), prefill_s=round(got["prefill_s"], 4),
                   ms_per_token_runs=got["ms_per_token_runs"], compile_stats=got["compile_stats"], tokens=got["tokens"],
                   device=got["device"])
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def derive(rows: list[dict]) -> list[dict]:
    """``tokens_equal_sdpa``: the share of leading greedy tokens equal to sdpa's eager row's."""
    base = {r["prompt_len"]: r for r in rows if r["impl"] == "sdpa" and r["mode"] == "eager" and r["status"] == "ok"}
    for r in rows:
        ref = base.get(r["prompt_len"])
        if r["status"] != "ok" or ref is None:
            continue
        same = 0
        for a, b in zip(r["tokens"], ref["tokens"]):
            if a != b:
                break
            same += 1
        r["tokens_equal_sdpa"] = round(same / max(len(ref["tokens"]), 1), 3)
    return rows


def combine(results: list[dict]) -> dict:
    """One row from the rounds of an (impl, mode): the median of the rounds' ms/token and prefill, each
    round's median in ``ms_per_token_rounds``; the first failure if any round failed."""
    bad = [r for r in results if r["status"] != "ok"]
    if bad or len(results) == 1:
        return bad[0] if bad else results[0]
    row = dict(results[-1])
    row["ms_per_token_rounds"] = [r["ms_per_token"] for r in results]
    row["ms_per_token"] = round(statistics.median(row["ms_per_token_rounds"]), 3)
    row["prefill_s"] = round(statistics.median(r["prefill_s"] for r in results), 4)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| impl | mode | prompt | ms/token | prefill s | tokens = sdpa's |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['impl']} | {r['mode']} | {r['prompt_len']} | {r['status']} | | |")
            continue
        same = r.get("tokens_equal_sdpa")
        lines.append(f"| {r['impl']} | {r['mode']} | {r['prompt_len']} | {r['ms_per_token']:.2f} | "
                     f"{r['prefill_s']:.3f} | {'' if same is None else f'{same:.0%}'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=300, help="seconds per (impl, mode) process")
    ap.add_argument("--rounds", type=int, default=1, help="measure each (impl, mode) this often, alternating")
    ap.add_argument("--repeats", type=int, default=5, help="timed generate() pairs per process (median)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats: at least 1")
    if args.child:
        impl, mode, prompt, tokens, repeats = args.child
        print("RESULT " + json.dumps(child(impl, mode, int(prompt), int(tokens), int(repeats))), flush=True)
        return
    for name, allowed in (("impls", IMPLS), ("modes", MODES)):
        bad = set(getattr(args, name).split(",")) - set(allowed)
        if bad:
            ap.error(f"--{name}: unknown {sorted(bad)}; choose from {','.join(allowed)}")
    rows = []
    if args.out and os.path.exists(args.out):
        rows = json.load(open(args.out)).get("rows", [])
    rounds = collections.defaultdict(list)
    for mode in args.modes.split(","):
        for _ in range(args.rounds):  # impls alternate round by round: the host's speed drifts between processes
            for impl in args.impls.split(","):
                rows = [r for r in rows if (r["impl"], r["mode"], r["prompt_len"]) != (impl, mode, args.prompt)]
                rounds[impl, mode].append(measure(impl, mode, args.prompt, args.tokens, args.timeout,
                                                   args.repeats))
                log(json.dumps({k: v for k, v in rounds[impl, mode][-1].items() if k != "tokens"}))
                rows.append(combine(rounds[impl, mode]))
            rows = derive(rows)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(dict(benchmark="decode", layers=LAYERS, vocab=VOCAB, rows=rows), f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
