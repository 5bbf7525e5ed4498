"""End-to-end Gemma 4 training step (issue #14): tokens/s and peak memory of one train step
(forward + backward of the LM loss, no optimizer) with the Gemma-4-31B layer dims (hidden 5376,
MLP 21504, 32 query heads; sliding layers: 16 KV heads, d256, window 1024; full layers: 4 KV
heads, d512, k == v; 5 sliding : 1 full, 6 layers, vocab 8192), B 1, bf16, no checkpointing.

    python benchmarks/e2e_gemma4.py [--parts torch,jax] [--seqlens 8192,16384,32768] [--packed] [--out FILE]

torch (HF ``AutoModelForCausalLM``): ``ffpa`` (xattn: FFPA on full layers, FA4 on sliding ones),
``ffpa-flex`` (the seed's route: FFPA on full layers, FlexAttention on sliding ones,
``XATTN_SLIDING_BACKEND=flex``), ``sdpa``, and ``none`` (attention replaced by a free stand-in
that passes q through: the step without attention, so ``attn_share = 1 - none / impl``).
JAX (a Flax nnx stack of the same layers, :func:`build_jax_step`): ``xattn`` (xattn.jax),
``xla`` (``jax.nn.dot_product_attention(implementation="xla")``; cuDNN refuses d512), ``none``.

``--packed`` (issue #23): one row of N tokens packed from documents of mixed lengths
(:func:`benchmarks.packed.documents` ``mixNk``: log-uniform 64..8192, seeded). torch: restarting
``position_ids`` plus ``cu_seq_lens_q/k`` and ``max_length_q/k`` as HF's packed FlashAttention
interface passes them (sdpa and flex read the documents from the position_ids mask), impls ``ffpa``,
``sdpa``, ``flex_attention``; JAX: ``xattn`` (``packed_attention`` with segment ids: FA4 with the
window on sliding layers, FFPA on full ones) and ``xla`` (``jax.nn.dot_product_attention`` with the
segment mask). ``--check`` (with ``--packed``): one process runs the same batch through sdpa and
ffpa, and sdpa again on the documents in reverse order (equal in exact arithmetic: that distance is
bf16 noise), and reports the loss and gradient differences vs sdpa (``grad_rel``:
``||g - g_sdpa|| / ||g_sdpa||`` over all parameters, ``grad_rel_max``: the worst tensor), on
well-conditioned weights (:func:`condition`).

Every (impl, N) runs in its own process (clean peak memory; an out-of-memory ends only that
row). Rows: ``framework, impl, seqlen, step_s, tokens_per_s, peak_gib, speedup_vs_sdpa``
(vs ``sdpa`` for torch, vs ``xla`` for JAX), ``attn_share``, ``status`` ("ok" / "oom" / "error: ...").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TORCH_IMPLS = ("ffpa", "ffpa-flex", "sdpa", "none")
TORCH_PACKED_IMPLS = ("ffpa", "sdpa", "flex_attention", "none")
JAX_IMPLS = ("xattn", "xla", "none")
BASELINE = {"torch": "sdpa", "jax": "xla"}
VOCAB = 8192
DIMS = dict(hidden=5376, mlp=21504, heads=32, sliding_kv=16, sliding_d=256, window=1024, full_kv=4, full_d=512,
            layers=6)


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- torch: HF Gemma 4 ---------------------------------------------------------------------------

def _register_none() -> None:
    """HF attention ``"none"``: returns q itself ([B, N, H, D]); the step's cost without attention."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def none_attention(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    AttentionInterface.register("none", none_attention)
    AttentionMaskInterface.register("none", lambda *args, **kwargs: None)


def packed_documents(n: int) -> list[int]:
    from benchmarks.packed import documents

    return documents(f"mix{n // 1024}k")


def torch_batch(n: int, packed: bool, reverse: bool = False) -> dict:
    """Model kwargs of the step's one row: ``input_ids`` (and for ``packed`` the documents' restarting
    ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``) plus ``labels`` (next token, -100 at
    each document's last token). ``reverse``: the same documents in the opposite order (the same
    loss and gradients in exact arithmetic; only the rounding differs)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(n)
    ids = torch.randint(0, VOCAB, (1, n), device="cuda", generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    batch = dict(input_ids=ids, labels=labels)
    if packed:
        lens = packed_documents(n)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        labels[0, (cu[1:] - 1).long()] = -100
        if reverse:
            pieces = [(ids[:, a:b], labels[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())][::-1]
            ids, labels, lens = torch.cat([p[0] for p in pieces], 1), torch.cat([p[1] for p in pieces], 1), lens[::-1]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        batch = dict(input_ids=ids, labels=labels,
                     position_ids=torch.cat([torch.arange(m, device="cuda") for m in lens])[None],
                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lens), max_length_k=max(lens))
    return batch


def build_torch_step(impl: str, n: int, packed: bool = False, reverse: bool = False):
    """The train step of ``impl`` at N ``n`` (HF Gemma 4, CUDA, bf16): a closure running fwd + bwd
    and returning the loss; ``packed``: documents in one row (:func:`torch_batch`)."""
    if impl == "ffpa-flex":
        os.environ["XATTN_SLIDING_BACKEND"] = "flex"
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import xattn.torch as xt
    from benchmarks.ring import gemma4_31b_dims

    xt.register_ffpa_attention()
    _register_none()
    attn = {"ffpa-flex": "ffpa"}.get(impl, impl)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(gemma4_31b_dims(DIMS["layers"], VOCAB), attn_implementation=attn,
                                                 dtype=torch.bfloat16)
    batch = torch_batch(n, packed, reverse)
    labels = batch.pop("labels")

    def step():
        model.zero_grad(set_to_none=True)
        logits = model(**batch, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    step.model, step.batch, step.labels = model, batch, labels
    return step


def condition(model, device: str = "cuda") -> None:
    """Well-conditioned weights for a numerical comparison (a model built on the GPU from its config
    holds whatever HF's device-side construction left, a loss of ~42 here): norms 1, matrices
    N(0, 0.02) (HF's initializer_range), q_norm x 0.1 so attention scores stay in a sane range."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(0.1 if name.endswith("q_norm.weight") else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def torch_check(n: int) -> dict:
    """The packed batch through sdpa and ffpa on one model, plus sdpa on the documents in reverse
    order (the bf16 noise yardstick): losses and gradient differences vs sdpa."""
    import torch

    step = build_torch_step("sdpa", n, packed=True)
    model = step.model
    condition(model)
    reverse = torch_batch(n, True, reverse=True)
    runs = {}
    for name, impl, batch in (("sdpa", "sdpa", None), ("sdpa, documents reversed", "sdpa", reverse),
                              ("ffpa", "ffpa", None)):
        model.set_attn_implementation(impl)
        if batch is not None:
            saved = dict(step.batch), step.labels.clone()
            step.batch.clear()
            step.batch.update({k: v for k, v in batch.items() if k != "labels"})
            step.labels.copy_(batch["labels"])
        loss = step().item()
        if batch is not None:
            step.batch.clear()
            step.batch.update(saved[0])
            step.labels.copy_(saved[1])
        runs[name] = dict(loss=loss, grads={k: p.grad.detach().clone() for k, p in model.named_parameters()
                                            if p.grad is not None})
    base = runs["sdpa"]["grads"]
    norm = sum(g.float().square().sum() for g in base.values()).sqrt()
    out = {}
    for name, r in runs.items():
        if name == "sdpa":
            continue
        diff = sum((r["grads"][k].float() - g.float()).square().sum() for k, g in base.items()).sqrt()
        per = {k: ((r["grads"][k].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)).item()
               for k, g in base.items()}
        worst = max(per, key=per.get)
        out[name] = dict(status="ok", loss=round(r["loss"], 6), loss_diff=round(r["loss"] - runs["sdpa"]["loss"], 6),
                         grad_rel=round((diff / norm).item(), 6), grad_rel_max=round(per[worst], 6), worst=worst)
    return dict(check=out, sdpa_loss=round(runs["sdpa"]["loss"], 6), device=torch.cuda.get_device_name())


def torch_step(impl: str, n: int, iters: int, packed: bool = False) -> dict:
    import torch

    step = build_torch_step(impl, n, packed)
    torch.cuda.reset_peak_memory_stats()
    step()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return dict(step_s=statistics.median(times), peak_gib=torch.cuda.max_memory_allocated() / 2 ** 30,
                device=torch.cuda.get_device_name())


# --- JAX: a Flax nnx stack of the same layers -------------------------------------------------------

def build_jax_step(impl: str, n: int, dims: dict = DIMS, vocab: int = VOCAB, batch: int = 1, dtype: str = "bfloat16",
                   packed: bool = False, backend: str = "auto"):
    """``(step, params, ids, labels)``: ``step(params, ids, labels) -> (loss, grads)``, jitted.
    ``packed``: one row of :func:`packed_documents` (segment ids; positions restart per document).
    ``backend``: xattn's (``"reference"`` runs any head dim and float32, for the CPU wiring test).

    Each layer: RMSNorm -> q/k/v projections (full layers: v = k) -> q/k RMSNorm over the head dim
    -> RoPE -> attention (sliding: causal window ``dims["window"]`` keys; full: causal) -> output
    projection -> RMSNorm; then RMSNorm -> GeGLU MLP -> RMSNorm; residuals around both. Scale 1.0
    (Gemma 4 normalises q instead; q_norm weights 0.1 keep the scores well-conditioned). Weights and
    activations in ``dtype`` (float32 only for checks on the reference path), small random init.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import xattn.jax as xj

    dt = jnp.dtype(dtype)
    window = dims["window"]
    segments = positions = None
    num_docs = 0
    if packed:
        import numpy as np

        lens = packed_documents(n)
        num_docs = len(lens)
        segments = jnp.asarray(np.repeat(np.arange(1, len(lens) + 1), lens)[None].repeat(batch, 0), jnp.int32)
        positions = jnp.asarray(np.concatenate([np.arange(m) for m in lens]), jnp.float32)

    def attention(q, k, v, sliding):
        if impl == "none":
            return q
        if packed and impl == "xattn":
            family, win = ("fa4", (window - 1, 0)) if sliding else ("ffpa", (None, None))
            return xj.packed_attention(q, k, v, segments, max_segments=num_docs + 1, family=family, scale=1.0,
                                       causal=True, window_size=win, backend=backend)
        if packed and impl == "xla":
            mask = (segments[:, None, :, None] == segments[:, None, None, :])
            return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0, is_causal=True, implementation="xla",
                                                local_window_size=(window - 1, 0) if sliding else None)
        if impl == "xattn":
            if sliding:
                return xj.flash_attention(q, k, v, scale=1.0, causal=True, window_size=(window - 1, 0),
                                          backend=backend)
            return xj.ffpa_attention(q, k, v, scale=1.0, causal=True, backend=backend)
        if impl == "xla":
            return jax.nn.dot_product_attention(q, k, v, scale=1.0, is_causal=True, implementation="xla",
                                                local_window_size=(window - 1, 0) if sliding else None)
        raise ValueError(f"impl: expected one of {JAX_IMPLS}, got {impl!r}")

    def rope(x, theta):
        d = x.shape[-1]
        freqs = 1.0 / theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
        pos = jnp.arange(x.shape[1], dtype=jnp.float32) if positions is None else positions
        angles = pos[:, None] * freqs[None]
        cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
        x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    class Norm(nnx.Module):
        def __init__(self, d, scale=1.0):
            self.w = nnx.Param(jnp.full((d,), scale, dt))

        def __call__(self, x):
            x32 = x.astype(jnp.float32)
            return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6) * self.w.value).astype(dt)

    def dense(din, dout, rngs):
        return nnx.Linear(din, dout, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs,
                          kernel_init=nnx.initializers.normal(0.02))

    class Layer(nnx.Module):
        def __init__(self, sliding, rngs):
            h = dims["hidden"]
            self.sliding = sliding
            self.kv, self.d = (dims["sliding_kv"], dims["sliding_d"]) if sliding else (dims["full_kv"], dims["full_d"])
            self.q = dense(h, dims["heads"] * self.d, rngs)
            self.k = dense(h, self.kv * self.d, rngs)
            self.v = dense(h, self.kv * self.d, rngs) if sliding else None
            self.o = dense(dims["heads"] * self.d, h, rngs)
            self.q_norm, self.k_norm = Norm(self.d, 0.1), Norm(self.d)
            self.norms = nnx.List([Norm(h) for _ in range(4)])
            self.gate, self.up = dense(h, dims["mlp"], rngs), dense(h, dims["mlp"], rngs)
            self.down = dense(dims["mlp"], h, rngs)

        def __call__(self, x):
            b, n, _ = x.shape
            y = self.norms[0](x)
            q = self.q(y).reshape(b, n, dims["heads"], self.d)
            k_raw = self.k(y).reshape(b, n, self.kv, self.d)
            v = (self.v(y).reshape(b, n, self.kv, self.d) if self.sliding else k_raw)
            theta = 10_000.0 if self.sliding else 1_000_000.0
            q, k = rope(self.q_norm(q), theta), rope(self.k_norm(k_raw), theta)
            a = attention(q, k, v, self.sliding).reshape(b, n, -1)
            x = x + self.norms[1](self.o(a))
            y = self.norms[2](x)
            return x + self.norms[3](self.down(jax.nn.gelu(self.gate(y), approximate=True) * self.up(y)))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(vocab, dims["hidden"], dtype=dt, param_dtype=dt, rngs=rngs,
                                   embedding_init=nnx.initializers.normal(0.02))
            self.layers = nnx.List([Layer(i % 6 != 5, rngs) for i in range(dims["layers"])])
            self.final = Norm(dims["hidden"])

        def __call__(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.embed.attend(self.final(x))

    model = Model(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def loss_fn(params, ids, labels):
        logits = nnx.merge(graphdef, params)(ids).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1).mean()

    ids = jax.random.randint(jax.random.PRNGKey(n), (batch, n), 0, vocab)
    labels = jnp.roll(ids, -1, axis=1)
    return jax.jit(jax.value_and_grad(loss_fn)), params, ids, labels


def jax_step(impl: str, n: int, iters: int, packed: bool = False) -> dict:
    # Preallocation off: XLA's BFC allocator then stops at 75% of the GPU (JAX's GPU memory docs), ~104 GiB
    # of the H200's 139, where torch's rows may use all of it; the 32k step needs ~115 GiB. So the JAX
    # children get 90% unless the caller chose a fraction (jax refuses the new and the old name together).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if "XLA_CLIENT_MEM_FRACTION" not in os.environ and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        os.environ["XLA_CLIENT_MEM_FRACTION"] = "0.9"
    import jax

    step, params, ids, labels = build_jax_step(impl, n, packed=packed)
    jax.block_until_ready(step(params, ids, labels))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, ids, labels))
        times.append(time.perf_counter() - t0)
    dev = jax.devices()[0]
    return dict(step_s=statistics.median(times),
                peak_gib=(dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2 ** 30,
                device=dev.device_kind)


# --- driver ------------------------------------------------------------------------------------------

def _is_oom(text: str) -> bool:
    return any(s in text for s in ("OutOfMemoryError", "RESOURCE_EXHAUSTED", "out of memory", "Out of memory"))


def _error_line(stderr: str) -> str:
    """The line that names the failure: the last ``SomeError: ...`` / fatal-check line, else the last line."""
    lines = [ln.strip() for ln in stderr.strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^([\w.]*(Error|Exception)|F\d{4} |Check failed)", ln)]
    return (named or lines or ["?"])[-1]


def run_child(cmd: list[str], timeout: float) -> tuple[dict | None, str]:
    """Run a benchmark's ``--child`` process: ``(the JSON of its last "RESULT " line, status)``, status "ok",
    "oom" or "error: ..." (the line that names the failure, or the timeout); no JSON unless "ok"."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"error: timeout after {timeout:.0f} s"
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode == 0 and result:
        return json.loads(result[-1][7:]), "ok"
    if _is_oom(proc.stderr + proc.stdout):
        return None, "oom"
    return None, f"error: {_error_line(proc.stderr)[:300]}"


def measure(framework: str, impl: str, n: int, iters: int, timeout: float, packed: bool = False) -> dict:
    """One (impl, N) in a child process; returns the row (status "ok", "oom" or "error: ...");
    ``impl == "check"``: the packed loss/gradient comparison (:func:`torch_check`)."""
    row = dict(framework=framework, impl=impl, seqlen=n, batch=1, layers=DIMS["layers"], iters=iters, packed=packed)
    if packed:
        row["documents"] = len(packed_documents(n))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", framework, impl, str(n), str(iters)]
    cmd += ["--packed"] if packed else []
    t0 = time.perf_counter()
    got, status = run_child(cmd, timeout)
    row["status"] = status
    if got is not None and impl == "check":
        row.update(got)
    elif got is not None:
        row.update(step_s=round(got["step_s"], 4), tokens_per_s=round(n / got["step_s"]),
                   peak_gib=round(got["peak_gib"], 1), device=got["device"])
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _key(r: dict) -> tuple:
    return r["framework"], r["impl"], r["seqlen"], r.get("packed", False)


def derive(rows: list[dict]) -> list[dict]:
    """Add ``speedup_vs_sdpa`` (vs the framework's baseline) and ``attn_share`` (1 - none / impl)."""
    ok = {_key(r): r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok" or r["impl"] == "check":
            continue
        packed = r.get("packed", False)
        base = ok.get((r["framework"], BASELINE[r["framework"]], r["seqlen"], packed))
        r["speedup_vs_sdpa"] = round(base["step_s"] / r["step_s"], 3) if base else None
        free = ok.get((r["framework"], "none", r["seqlen"], packed))
        r["attn_share"] = round(1 - free["step_s"] / r["step_s"], 3) if free and r["impl"] != "none" else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| framework | impl | N | step s | tokens/s | peak GiB | vs baseline | attention share |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = f"{r['seqlen']} packed ({r['documents']} docs)" if r.get("packed") else r["seqlen"]
        if r["impl"] == "check" and r.get("status") == "ok":
            for impl, c in r["check"].items():
                got = (f"loss {c['loss']} ({c['loss_diff']:+.2e}), grads vs sdpa {c['grad_rel']:.2e} "
                       f"(worst {c['grad_rel_max']:.2e})" if c["status"] == "ok" else c["status"])
                lines.append(f"| {r['framework']} | check: {impl} | {n} | {got} | | | | |")
            continue
        if r.get("status") != "ok":
            lines.append(f"| {r['framework']} | {r['impl']} | {n} | {r['status']} | | | | |")
            continue
        sp = r.get("speedup_vs_sdpa")
        share = r.get("attn_share")
        lines.append(f"| {r['framework']} | {r['impl']} | {n} | {r['step_s']:.3f} | {r['tokens_per_s']} | "
                     f"{r['peak_gib']} | {'' if sp is None else f'{sp:.2f}x'} | "
                     f"{'' if share is None else f'{share:.0%}'} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="torch,jax")
    ap.add_argument("--seqlens", default="8192,16384,32768")
    ap.add_argument("--impls", default=None, help="comma list; default: all of each framework")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=240, help="seconds per (impl, N) process")
    ap.add_argument("--out", default=None)
    ap.add_argument("--packed", action="store_true", help="one row packed from documents of mixed lengths")
    ap.add_argument("--check", action="store_true", help="with --packed: loss and grads of ffpa/flex vs sdpa")
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.check and not args.packed:
        ap.error("--check compares the packed batch: give --packed")
    if args.child:
        framework, impl, n, iters = args.child
        if impl == "check":
            got = torch_check(int(n))
        else:
            got = (torch_step if framework == "torch" else jax_step)(impl, int(n), int(iters), args.packed)
        print("RESULT " + json.dumps(got), flush=True)
        return
    rows = []
    if args.out and os.path.exists(args.out):
        rows = json.load(open(args.out)).get("rows", [])
    seqlens = [int(s) for s in args.seqlens.split(",")]
    plan = []
    for framework in args.parts.split(","):
        if framework not in ("torch", "jax"):
            ap.error(f"--parts: expected torch and/or jax, got {framework!r}")
        known = (TORCH_PACKED_IMPLS if args.packed else TORCH_IMPLS) if framework == "torch" else JAX_IMPLS
        impls = args.impls.split(",") if args.impls else list(known)
        unknown = [i for i in impls if i not in known]
        if unknown:  # before anything runs: a wrong name would otherwise become an error row in --out
            ap.error(f"--impls {','.join(unknown)}: not a {framework} impl{' (packed)' if args.packed else ''}; "
                     f"expected some of {','.join(known)}")
        plan.append((framework, ["check"] if args.check and framework == "torch" else [] if args.check else impls))
    for framework, impls in plan:
        for n in seqlens:
            for impl in impls:
                rows = [r for r in rows if _key(r) != (framework, impl, n, args.packed)]
                rows.append(measure(framework, impl, n, args.iters, args.timeout, args.packed))
                log(json.dumps(rows[-1]))
                rows = derive(rows)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(dict(benchmark="e2e_gemma4", dims=DIMS, vocab=VOCAB, rows=rows), f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
