"""Memory growth over 1,000 mixed calls in one process (GPU): the figure "no growth beyond the
launcher cache" of issue #12.

The mix cycles through torch forward+backward of FFPA and FA4 configs (dense, varlen, sliding window,
the HF attention function, forward-only under no_grad), calls that must raise in between (wrong dtype,
GQA ratio, head dim, lengths, varlen without max_seqlen, an FA4 backward refused under
``torch.use_deterministic_algorithms``) and, unless ``--no-jax``, jitted JAX forward/grad calls and a bad
JAX call. After a warm-up (every case twice: compiles / disk loads, allocator pools), every 100 calls and
at the end it records torch.cuda.memory_allocated / memory_reserved, JAX bytes_in_use, host RSS
(/proc/self/status VmRSS), Python objects, cached launchers and registered XLA FFI targets. Growth is
end minus warm-up; the target is zero for the device memory and caches, and an RSS growth under 16 MiB.
Only bf16 configs the GPU kit precompiles are used. The run stops itself after ``--max-seconds``.

    python benchmarks/memory_growth.py [--calls 1000] [--no-jax] [--out benchmarks/results/memory_growth_h200.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from typing import Callable, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

RSS_LIMIT_MIB = 16
MiB = 2 ** 20


INPUT_ERRORS = (TypeError, ValueError, NotImplementedError)  # the named errors of a refused input


class Case(NamedTuple):
    name: str
    run: Callable[[], object]
    expect: tuple | None = None  # the errors a bad call must raise (one of); None: a good call


def rss_bytes() -> int | None:
    """Resident set size of this process (VmRSS), None where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _torch_good(device: str, small: bool) -> list[Case]:
    import torch

    import xattn.torch as xt

    gen = torch.Generator(device=device).manual_seed(0)
    n = (lambda x: max(2, x // 32)) if small else (lambda x: x)  # noqa: E731

    def mk(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(grad)

    def train(q, k, v, **kw):
        dout = torch.randn(*q.shape[:-1], v.shape[-1], device=device, dtype=torch.bfloat16, generator=gen)

        def run():
            xt.attention(q, k, v, **kw).backward(dout)
            for t in (q, k, v):
                t.grad = None
        return run

    def infer(q, k, v, **kw):
        def run():
            with torch.no_grad():
                return xt.attention(q, k, v, **kw)
        return run

    docs = [n(300), 0, 1, n(211)]
    cu = torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32, device=device)
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(docs), max_seqlen_k=max(docs), causal=True)
    t = sum(docs)
    cases = [
        Case("torch ffpa d512 gqa4 causal fwd+bwd", train(mk(1, n(333), 8, 512), mk(1, n(400), 2, 512),
                                                         mk(1, n(400), 2, 512), causal=True)),
        Case("torch ffpa d512 gqa4 fwd (no_grad)", infer(mk(2, n(256), 8, 512), mk(2, n(256), 2, 512),
                                                        mk(2, n(256), 2, 512))),
        Case("torch ffpa d512 gqa8 fwd+bwd",
             train(mk(1, n(200), 8, 512), mk(1, n(264), 1, 512), mk(1, n(264), 1, 512))),
        Case("torch ffpa d512 gqa8 causal fwd+bwd", train(mk(1, n(320), 8, 512), mk(1, n(320), 1, 512),
                                                         mk(1, n(320), 1, 512), causal=True)),
        Case("torch fa4 d128 gqa4 causal fwd+bwd", train(mk(2, n(500), 8, 128), mk(2, n(500), 2, 128),
                                                        mk(2, n(500), 2, 128), causal=True)),
        Case("torch fa4 d128 gqa4 causal varlen fwd+bwd", train(mk(t, 8, 128), mk(t, 2, 128), mk(t, 2, 128), **varlen)),
        Case("torch fa4 d256 gqa2 window(63,0) fwd+bwd", train(mk(1, n(600), 4, 256), mk(1, n(600), 2, 256),
                                                              mk(1, n(600), 2, 256), window_size=(63, 0))),
    ]
    try:
        from xattn.torch import ffpa_attention as fa
    except ImportError:  # transformers missing: no HF case
        return cases
    q, k, v = mk(1, 8, n(300), 512), mk(1, 2, n(300), 512), mk(1, 2, n(300), 512)  # SDPA layout [B, H, N, D]

    class Layer(torch.nn.Module):
        is_causal = True

    def hf_step():
        out, _ = fa.ffpa_attention_forward(Layer(), q, k, v, None, scaling=1.0)
        out.float().square().mean().backward()
        for x in (q, k, v):
            x.grad = None
    return cases + [Case("torch HF ffpa_attention_forward d512 gqa4 causal fwd+bwd", hf_step)]


def _torch_bad(device: str) -> list[Case]:
    import torch

    import xattn.torch as xt

    def mk(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    fp32 = [mk(1, 64, 8, 512, dtype=torch.float32), *(mk(1, 64, 2, 512, dtype=torch.float32) for _ in range(2))]
    q6, k4 = mk(1, 64, 6, 512), mk(1, 64, 4, 512)
    q100, k100 = mk(1, 64, 8, 100), mk(1, 64, 2, 100)
    q, k, v_short = mk(1, 64, 8, 512), mk(1, 64, 2, 512), mk(1, 48, 2, 512)
    qv, kv = mk(64, 8, 128), mk(64, 2, 128)
    cu = torch.tensor([0, 64], dtype=torch.int32, device=device)
    q4, k4d = mk(1, 96, 8, 128), mk(1, 96, 2, 128)

    def refused_fa4_backward():
        on = torch.are_deterministic_algorithms_enabled()
        warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            xt.attention(q4, k4d, k4d, causal=True).float().sum().backward()
        finally:
            torch.use_deterministic_algorithms(on, warn_only=warn_only)
            q4.grad = k4d.grad = None

    return [
        Case("bad: fp32 inputs", lambda: xt.attention(*fp32), INPUT_ERRORS),
        Case("bad: Hq 6 / Hkv 4", lambda: xt.attention(q6, k4, k4), INPUT_ERRORS),
        Case("bad: head_dim 100", lambda: xt.attention(q100, k100, k100), INPUT_ERRORS),
        Case("bad: k/v lengths differ", lambda: xt.attention(q, k, v_short), INPUT_ERRORS),
        Case("bad: varlen without max_seqlen", lambda: xt.attention(qv, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu),
             INPUT_ERRORS),
        Case("bad: FA4 backward under use_deterministic_algorithms", refused_fa4_backward, (RuntimeError,)),
    ]


def _jax_cases() -> list[Case]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import xattn.jax as xj

    keys = iter(jax.random.split(jax.random.PRNGKey(0), 32))

    def mk(*shape):
        return jax.random.normal(next(keys), shape, jnp.bfloat16)

    def grad(fn, *args):
        g = jax.jit(jax.grad(lambda *a: (fn(*a).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2)))
        return lambda: jax.block_until_ready(g(*args))

    docs = [300, 0, 1, 211]
    cu = jnp.array(np.concatenate([[0], np.cumsum(docs)]), jnp.int32)
    t = sum(docs)
    window = jax.jit(lambda q, k, v: xj.flash_attention(q, k, v, window_size=(63, 0), backend="kernel"))
    wq, wk, wv = mk(1, 600, 4, 256), mk(1, 600, 2, 256), mk(1, 600, 2, 256)
    bad_q = mk(333, 8, 512)
    return [
        Case("jax ffpa d512 gqa4 causal grad",
             grad(lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True, backend="kernel"),
                                                    mk(1, 333, 8, 512), mk(1, 400, 2, 512), mk(1, 400, 2, 512))),
        Case("jax fa4 d128 gqa4 causal grad",
             grad(lambda q, k, v: xj.flash_attention(q, k, v, causal=True, backend="kernel"),
                                                   mk(2, 500, 8, 128), mk(2, 500, 2, 128), mk(2, 500, 2, 128))),
        Case("jax fa4 d128 gqa4 causal varlen grad", grad(
            lambda q, k, v: xj.varlen_attention(q, k, v, cu, cu, max_seqlen_q=300, max_seqlen_k=300, family="fa4",
                                                causal=True, backend="kernel"), mk(t, 8, 128), mk(t, 2, 128),
                                                mk(t, 2, 128))),
        Case("jax fa4 d256 gqa2 window(63,0) fwd", lambda: jax.block_until_ready(window(wq, wk, wv))),
        Case("jax bad: rank-3 q", lambda: xj.ffpa_attention(bad_q, bad_q, bad_q, backend="kernel"), INPUT_ERRORS),
    ]


def sample(label: str, calls: int, t0: float, device: str, jax_on: bool) -> dict:
    """One measurement, after a full collection and a device sync."""
    import torch

    from xattn.core import cache

    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
    row = dict(at=label, calls=calls, seconds=round(time.perf_counter() - t0, 2),
               torch_allocated=torch.cuda.memory_allocated() if cuda else None,
               torch_reserved=torch.cuda.memory_reserved() if cuda else None, rss=rss_bytes(),
               python_objects=len(gc.get_objects()), launchers=len(cache.cached_specs()))
    if jax_on:
        import jax

        from xattn.jax import _ffi

        stats = jax.local_devices()[0].memory_stats() or {}
        row.update(jax_bytes_in_use=stats.get("bytes_in_use"), jax_ffi_targets=len(_ffi.registered_targets()))
    return row


def _call(case: Case, tally: dict) -> None:
    entry = tally.setdefault(case.name, dict(calls=0, raised={}, refused=0, bad=case.expect is not None))
    entry["calls"] += 1
    try:
        case.run()
    except Exception as exc:  # a bad call's error, or a good call's failure: counted, reported
        name = type(exc).__name__
        entry["raised"][name] = entry["raised"].get(name, 0) + 1
        if case.expect is not None and isinstance(exc, case.expect):
            entry["refused"] += 1
        else:
            entry["last_error"] = f"{name}: {exc}"[:300]


def growth(warm: dict, end: dict) -> dict:
    return {k: end[k] - warm[k] for k in warm if isinstance(warm[k], int) and isinstance(end.get(k), int)
            and k not in ("calls",)}


def verdict(tally: dict, grow: dict) -> tuple[bool, list[str]]:
    """``(target met, what missed it)``: zero device-memory/cache growth, RSS under the limit, every bad
    call refused with its error, every good call clean."""
    missed = [f"{k} grew by {grow[k]}" for k in ("torch_allocated", "torch_reserved", "launchers",
                                                  "jax_bytes_in_use", "jax_ffi_targets") if grow.get(k)]
    if grow.get("rss") is not None and grow["rss"] > RSS_LIMIT_MIB * MiB:
        missed.append(f"rss grew by {grow['rss'] / MiB:.1f} MiB > {RSS_LIMIT_MIB} MiB")
    for name, e in tally.items():
        if not e["bad"] and e["raised"]:
            missed.append(f"{name}: {e.get('last_error')}")
        elif e["bad"] and e["refused"] != e["calls"]:
            missed.append(f"{name}: refused {e['refused']} of {e['calls']} calls ({e.get('last_error', 'no error')})")
    return not missed, missed


def mix(cases: list, n: int, seed: int) -> list:
    """``n`` calls: whole cycles over ``cases``, each cycle in its own shuffled order."""
    rng, order = random.Random(seed), []
    while len(order) < n:
        cycle = list(cases)
        rng.shuffle(cycle)
        order += cycle
    return order[:n]


def run(calls: int = 1000, device: str = "cuda", small: bool = False, use_jax: bool = True,
        max_seconds: float = 170.0, warmup_cycles: int = 2, log=lambda m: print(m, flush=True)) -> dict:
    """The measurement (see the module docstring); returns the report dict."""
    t0 = time.perf_counter()
    cases = _torch_good(device, small) + _torch_bad(device)
    jax_note = None
    if use_jax:
        try:
            cases += _jax_cases()
        except ImportError as exc:
            use_jax, jax_note = False, f"skipped: {exc}"
    samples = [sample("start", 0, t0, device, use_jax)]
    warm_tally: dict = {}
    for case in mix(cases, warmup_cycles * len(cases), seed=1):  # shuffled too: the allocator sees the mix
        _call(case, warm_tally)
    samples.append(sample("warm", 0, t0, device, use_jax))
    tally, done = {}, 0
    for done, case in enumerate(mix(cases, calls, seed=0), 1):
        _call(case, tally)
        if done % 100 == 0 or done == calls:
            samples.append(sample(str(done), done, t0, device, use_jax))
            s, w = samples[-1], samples[1]
            log(f"memory_growth: {done}/{calls} calls, {s['seconds']} s, "
                + ", ".join(f"{k} {s[k] / MiB:.1f} MiB ({(s[k] - w[k]) / MiB:+.2f})"
                            for k in ("torch_allocated", "torch_reserved", "rss") if s[k] is not None)
                + f", launchers {s['launchers']}")
        if time.perf_counter() - t0 > max_seconds:
            log(f"memory_growth: stopping at {done} calls after {max_seconds} s")
            if samples[-1]["calls"] != done:
                samples.append(sample(str(done), done, t0, device, use_jax))
            break
    grow = growth(samples[1], samples[-1])
    met, missed = verdict({**tally, **{k: v for k, v in warm_tally.items() if k not in tally}}, grow)
    return dict(calls=done, calls_requested=calls, cases=len(cases), jax=jax_note or use_jax, warm_up=warm_tally,
                tally=tally, samples=samples, growth=grow, rss_limit_mib=RSS_LIMIT_MIB, target_met=met, missed=missed,
                stopped_early=done < calls, seconds=round(time.perf_counter() - t0, 2))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--no-jax", action="store_true", help="torch calls only")
    ap.add_argument("--max-seconds", type=float, default=170.0)
    ap.add_argument("--out", default=None, help="write the report here (JSON)")
    args = ap.parse_args(argv)
    import torch

    from xattn.core.spec import library_versions

    if not torch.cuda.is_available():
        sys.exit("memory_growth: needs a GPU (the CPU logic is tests/test_memory_growth.py)")
    report = run(args.calls, "cuda", use_jax=not args.no_jax, max_seconds=args.max_seconds)
    report = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                  versions=dict(library_versions()), torch=torch.__version__, **report)
    print(json.dumps(dict(growth=report["growth"], target_met=report["target_met"], missed=report["missed"],
                          calls=report["calls"], seconds=report["seconds"]), indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
