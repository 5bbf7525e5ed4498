"""Ring attention (context parallelism) on 2 GPUs vs the unsharded kernel on 1 GPU (GPU machine).

    python benchmarks/ring.py [--parts torch jax gemma] [--seqlens 32768 65536 131072] [--out results.json]

Problem: d512 Hq32/Hkv4 (Gemma 4's global layer), B1, bf16, causal, fwd+bwd, total length N.
* ``gpus=1``: ``xattn.torch.attention`` / ``xattn.jax.ffpa_attention`` on the whole sequence, one GPU.
* ``gpus=2``: ``ring_attention`` on the load-balanced shards, 2 ranks (torch: NCCL processes;
  JAX: ``shard_map`` over 2 devices). The step time is the slower rank's.
* ``gpus=2, method=*-compute-only``: the same ring with every send/receive replaced by handing the
  local block on (torch) -- the same kernels with no communication, so ``ring - compute-only`` is the
  time the ring spends waiting on communication.

FLOPs (FlashAttention convention): 4*B*Hq*N^2*D/2 forward (causal), x3.5 for fwd+bwd; ``tflops``
is the whole problem's FLOPs over the step time (aggregate), ``efficiency`` = 2-GPU throughput /
(2 x 1-GPU throughput). Peak memory is ``torch.cuda.max_memory_allocated`` per rank (torch) or
the device's ``peak_bytes_in_use`` (JAX). Timing: wall clock over synchronised steps, median of
``--iters`` after one warm-up step.

Part ``gemma``: the longest sequence that trains. HF Gemma 4 with the 31B model's layer dims (hidden
5376, MLP 21504, Hq 32; sliding Hkv 16 d256 window 1024; full Hkv 4 d512 k == v; 5 sliding : 1 full,
6 layers, vocab 8192), B1 bf16, ``attn_implementation="ffpa"``, one train step (fwd + bwd of the LM
loss, no activation checkpointing): 1 GPU on the whole sequence vs 2 GPUs with the sequence sharded
(``xattn.torch.context_parallel``). Rows ``framework="torch", method="gemma4-31b-dims-6L"`` with
``step_ms, tokens_per_s, peak_gib`` or ``oom: true``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HQ, HKV, D = 32, 4, 512


def log(msg: str) -> None:
    print(f"[ring {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def flops(n: int) -> float:
    return 4 * HQ * n * n * D * 0.5 * 3.5


def _row(framework, method, n, gpus, times, peak_gib):
    step = statistics.median(times)
    return dict(framework=framework, method=method, seqlen=n, gpus=gpus, step_ms=round(step * 1e3, 2),
                tflops=round(flops(n) / step / 1e12, 1), peak_gib=round(peak_gib, 2), iters=len(times))


# --- torch: NCCL processes -------------------------------------------------------------------

class _NoComm:
    """Stands in for ring._RingStep: the 'received' block is the local one (compute-only ablation)."""

    def __init__(self, group, tensors):
        self.received = list(tensors)

    def wait(self):
        return self.received


def _torch_worker(rank, world, port, seqlens, iters, path):
    import torch
    import torch.distributed as dist

    import xattn.torch as xt
    from xattn.torch import ring

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = []

    def timed(fn, n_iters):
        fn()
        times = []
        for _ in range(n_iters):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            t = torch.tensor(time.perf_counter() - t0, device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        return times

    for n in seqlens:
        g = torch.Generator(device="cuda").manual_seed(n)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
        q, k, v, dout = mk(1, n, HQ, D), mk(1, n, HKV, D), mk(1, n, HKV, D), mk(1, n, HQ, D)
        local = [xt.shard_sequence(t).requires_grad_() for t in (q, k, v)]
        local_dout = xt.shard_sequence(dout)
        its = iters if n < 131072 else max(1, iters - 1)

        def ring_step():
            for t in local:
                t.grad = None
            xt.ring_attention(*local, causal=True, softmax_scale=D ** -0.5).backward(local_dout)

        for method, patch in (("ring", None), ("ring-compute-only", _NoComm)):
            saved = ring._RingStep
            if patch is not None:
                ring._RingStep = patch
            torch.cuda.reset_peak_memory_stats()
            try:
                times = timed(ring_step, its)
            finally:
                ring._RingStep = saved
            peak = torch.tensor(torch.cuda.max_memory_allocated() / 2 ** 30, device="cuda")
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            rows.append(_row("torch", method, n, 2, times, float(peak)))
            if rank == 0:
                log(f"torch {method} N={n}: {rows[-1]['step_ms']} ms, {rows[-1]['tflops']} TFLOP/s, "
                    f"{rows[-1]['peak_gib']} GiB/rank")
        local = local_dout = None  # free them (the closures are done with them)
        torch.cuda.empty_cache()
        if rank == 0:  # one GPU, the whole sequence (rank 1 waits)
            full = [t.requires_grad_() for t in (q, k, v)]

            def one_step():
                for t in full:
                    t.grad = None
                xt.attention(*full, causal=True, softmax_scale=D ** -0.5).backward(dout)

            torch.cuda.reset_peak_memory_stats()
            one_step()
            times = []
            for _ in range(its):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                one_step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            rows.append(_row("torch", "single", n, 1, times, torch.cuda.max_memory_allocated() / 2 ** 30))
            log(f"torch single N={n}: {rows[-1]['step_ms']} ms, {rows[-1]['tflops']} TFLOP/s, "
                f"{rows[-1]['peak_gib']} GiB")
            del full
        q = k = v = dout = None
        torch.cuda.empty_cache()
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)


def _spawn(worker, seqlens, iters):
    """Run ``worker`` on 2 NCCL ranks; its rows (written by rank 0, also when a rank dies late)."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tempfile.mktemp(suffix=".json")
    try:
        mp.start_processes(worker, args=(2, port, seqlens, iters, path), nprocs=2, start_method="spawn")
    except Exception as e:  # noqa: BLE001 -- keep what was measured
        log(f"{worker.__name__} stopped: {type(e).__name__}: {str(e)[-300:]}")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def run_torch(seqlens, iters):
    return _spawn(_torch_worker, seqlens, iters)


# --- torch: a Gemma 4 train step, 1 GPU vs 2 GPUs -------------------------------------------

def gemma4_31b_dims(layers=6, vocab=8192):
    """The 31B model's layer dims (see the module docstring), ``layers`` layers, a small vocab."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab, hidden_size=5376, intermediate_size=21504, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=16, head_dim=256, global_head_dim=512,
        num_global_key_value_heads=4, attention_k_eq_v=True, sliding_window=1024,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * (layers // 6), max_position_embeddings=1 << 20,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=vocab)


def _gemma_worker(rank, world, port, seqlens, iters, path):
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import xattn.torch as xt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=120))
    xt.register_ffpa_attention()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(gemma4_31b_dims(), attn_implementation="ffpa", dtype=torch.bfloat16)
    rows = []

    def save():
        if rank == 0:
            with open(path, "w") as f:
                json.dump(rows, f)

    def train_step(ids, labels, positions):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100).backward()

    def measure(n, gpus, run):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        row = dict(framework="torch", method="gemma4-31b-dims-6L", seqlen=n, gpus=gpus)
        try:
            run()
            times = []
            for _ in range(iters):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step = statistics.median(times)
            row.update(step_ms=round(step * 1e3, 1), tokens_per_s=round(n / step), iters=iters,
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 1))
        except torch.OutOfMemoryError:
            row.update(oom=True, peak_gib=round(torch.cuda.max_memory_allocated() / 2 ** 30, 1))
        model.zero_grad(set_to_none=True)
        return row

    for n in seqlens:
        g = torch.Generator(device="cuda").manual_seed(n)
        ids = torch.randint(0, 8192, (1, n), device="cuda", generator=g)
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
        if rank == 0:
            rows.append(measure(n, 1, lambda: train_step(ids, labels, None)))
            log(f"gemma 1 GPU N={n}: {rows[-1]}")
            save()
        dist.barrier()
        local, local_labels = xt.shard_sequence(ids), xt.shard_sequence(labels)
        positions = xt.sequence_positions(n, device="cuda")[None]

        def cp_step():
            with xt.context_parallel():
                train_step(local, local_labels, positions)

        row = measure(n, 2, cp_step)
        oom = torch.tensor(float(row.get("oom", False)), device="cuda")
        dist.all_reduce(oom, op=dist.ReduceOp.MAX)
        if rank == 0:
            rows.append(row)
            log(f"gemma 2 GPUs N={n}: {row}")
            save()
        if float(oom):
            break
    dist.destroy_process_group()


def run_gemma(seqlens, iters):
    return _spawn(_gemma_worker, seqlens, iters)


# --- JAX: shard_map over 2 devices -----------------------------------------------------------

def run_jax(seqlens, iters):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    # let XLA overlap the ring's collective-permutes with the kernels
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_latency_hiding_scheduler=true"
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    import xattn.jax as xj

    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(devices, ("cp",))
    spec = P(None, "cp")
    rows = []

    def peak_gib(devs):
        return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in devs) / 2 ** 30

    def timed(fn, args, n_iters):
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(n_iters):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return times

    for n in seqlens:
        key = jax.random.split(jax.random.PRNGKey(n), 4)
        shapes = ((1, n, HQ, D), (1, n, HKV, D), (1, n, HKV, D), (1, n, HQ, D))
        its = iters if n < 131072 else max(1, iters - 1)

        def loss_ring(q, k, v, dout):
            out = jax.shard_map(lambda q, k, v: xj.ring_attention(q, k, v, axis_name="cp", causal=True,
                                                                  scale=D ** -0.5),
                                mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(q, k, v)
            return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

        ring_step = jax.jit(jax.grad(loss_ring, argnums=(0, 1, 2)))
        put = NamedSharding(mesh, spec)
        args = [jax.device_put(xj.shard_sequence(jax.random.normal(kk, s, jnp.bfloat16), 2), put)
                for kk, s in zip(key, shapes)]
        times = timed(ring_step, args, its)
        rows.append(_row("jax", "ring", n, 2, times, peak_gib(devices)))
        log(f"jax ring N={n}: {rows[-1]['step_ms']} ms, {rows[-1]['tflops']} TFLOP/s")
        del args

        def loss_one(q, k, v, dout):
            out = xj.ffpa_attention(q, k, v, causal=True, scale=D ** -0.5)
            return (out.astype(jnp.float32) * dout.astype(jnp.float32)).sum()

        one_step = jax.jit(jax.grad(loss_one, argnums=(0, 1, 2)))
        args = [jax.device_put(jax.random.normal(kk, s, jnp.bfloat16), devices[0]) for kk, s in zip(key, shapes)]
        times = timed(one_step, args, its)
        rows.append(_row("jax", "single", n, 1, times, peak_gib(devices[:1])))
        log(f"jax single N={n}: {rows[-1]['step_ms']} ms, {rows[-1]['tflops']} TFLOP/s")
        del args
    return rows


def add_efficiency(rows):
    """``efficiency`` on every 2-GPU row: its throughput over twice the 1-GPU throughput at that N."""
    single = {(r["framework"], r["seqlen"]): r["tflops"] for r in rows if r["gpus"] == 1 and "tflops" in r}
    for r in rows:
        base = single.get((r["framework"], r["seqlen"]))
        if r["gpus"] == 2 and base and "tflops" in r:
            r["efficiency"] = round(r["tflops"] / (2 * base), 3)
    ring = {(r["framework"], r["seqlen"]): r["step_ms"] for r in rows if r["method"] == "ring"}
    for r in rows:
        if r["method"] == "ring-compute-only" and (r["framework"], r["seqlen"]) in ring:
            r["comm_wait_ms"] = round(ring[(r["framework"], r["seqlen"])] - r["step_ms"], 2)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["torch", "jax", "gemma"], choices=["torch", "jax", "gemma"])
    ap.add_argument("--seqlens", nargs="+", type=int, default=None,
                    help="default: 32768 65536 131072 (gemma: 16384 32768 65536 131072)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "ring_h200x2.json"))
    args = ap.parse_args()
    part_of = lambda r: "gemma" if r["method"].startswith("gemma") else r["framework"]  # noqa: E731
    rows = []
    if os.path.exists(args.out):  # keep the other parts' rows
        rows = [r for r in json.load(open(args.out))["rows"] if part_of(r) not in args.parts]
    runners = dict(torch=run_torch, jax=run_jax, gemma=run_gemma)
    for part in args.parts:
        seqlens = args.seqlens or ([16384, 32768, 65536, 131072] if part == "gemma" else [32768, 65536, 131072])
        log(f"{part}: N {seqlens}, {args.iters} iters")
        rows += runners[part](seqlens, args.iters)
        with open(args.out, "w") as f:
            json.dump({"problem": f"d{D} Hq{HQ}/Hkv{HKV} B1 bf16 causal fwd+bwd", "rows": add_efficiency(rows)},
                      f, indent=1)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
