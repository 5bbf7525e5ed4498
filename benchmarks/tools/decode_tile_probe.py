"""Where split-KV decode loses time outside the stream of keys (#43): the split launch compiled with other tiles
(FA4 d128) or with an early PDL trigger, and the combine with other thread counts, pipeline depths and programmatic
dependent launch (PDL), each timed in a CUDA graph beside torch SDPA.

A variant replaces the shipped launchers in xattn's in-process launcher table (``xattn.core.cache``) for the
probe's calls only; it is compiled here (FA4 ~10 s a tile on a CPU), never stored in the disk cache. Each
variant's out is checked against fp32 SDPA before it is timed.

    python benchmarks/tools/decode_tile_probe.py [--layer d128|d512] [--shapes B:NK,...]
        [--variants SPLIT/COMBINE,...] [--splits 0,8,16,32] [--compile-only] [--timeline [--warm q,index]]
        [--dense-slots S]

A variant is ``SPLIT/COMBINE``. SPLIT (FA4 d128 only; d512 keeps the shipped FFPA launch: ``shipped``): ``shipped``,
or a tile ``MxN`` / ``MxNsK`` (K pipeline stages for K and V, default FlashAttention's 2) of FlashAttention's sm90
forward (one MMA warpgroup per 64 rows; ``128x128`` is flash_attn's own d128 choice), ``+trig`` for a kernel whose
threads call ``griddepcontrol.launch_dependents`` first (a PDL-launched combine may then start while the splits
run; it waits on ``griddepcontrol.wait`` before it reads a partial). COMBINE: ``one`` (the shipped one-pass combine,
:mod:`xattn.core.combine_sm90`, at the chunk the route picks; ``oneC``: C partials in flight a thread at any P) or
FlashAttention's ``FlashAttentionForwardCombine`` as ``tTsS`` (T threads, S partial tiles in flight; ``t256s4`` was
shipped before session 26), ``+pdl`` for a PDL launch. num_splits 0: the route's rule.
``--compile-only`` compiles the variants on a CPU (CUTE_DSL_ARCH=sm_90a) and exits.
Timing: ``do_bench`` median of a graph replay (L2 flushed between runs), as benchmarks/decode_attention.py.
``--timeline`` also profiles 50 replays of each graph (torch.profiler, L2 flushed before each) and prints where the
replay's time goes on the GPU: from the flush's end to the first kernel, each kernel's duration and the gap before
the next one (medians), and the span from the flush's end to the last kernel's end; ``--warm q,index`` first reads
the queries and/or the split launch's index tensors back into L2 after each flush (a model's decode step finds q in
L2, just written; the split launch reads its index before its first key: a dependent round trip to memory when cold).
``--dense-slots S`` (B1, FA4) also times the split launch without an index (:func:`dense_slots`), q by TMA and by
copies. Since session 28 the route itself runs one sequence so (the slot launch, :func:`xattn.core.split_kv.
slot_launch`): at B1 the SPLIT variants replace nothing (they are the varlen launch's, B > 1).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

LAYERS = {"d128": ("fa4", 32, 8, 128), "d512": ("ffpa", 32, 4, 512)}  # family, Hq, Hkv, D
DEFAULT_VARIANTS = "shipped/one,shipped/one+pdl,shipped+trig/one+pdl,shipped/t256s4,shipped/t256s4+pdl"


def split_spec(layer: str):
    """The key the route looks the split launch up by (varlen, non-causal: the splits see no mask; FA4's decode
    tile :class:`~xattn.core.split_kv.SplitFwdSpec` where the core has one)."""
    from xattn.core.spec import KernelSpec
    from xattn.core.split_kv import split_launch_spec

    from xattn.core.split_kv import shared_queries

    family, hq, hkv, d = LAYERS[layer]
    return split_launch_spec(KernelSpec(family, "fwd", "bfloat16", d, d, hq // hkv, causal=False, varlen=True),
                             shared_q=shared_queries(family, d, d, hq // hkv))  # the torch route's


def _triggered(cls):
    """``cls`` (FlashAttention's sm90 forward) whose producer and MMA threads call ``launch_dependents`` first."""
    import cutlass.cute as cute

    class Triggered(cls):
        def load(self, *args, **kwargs):
            cute.arch.griddepcontrol_launch_dependents()
            return cls.load(self, *args, **kwargs)

        def mma(self, *args, **kwargs):
            cute.arch.griddepcontrol_launch_dependents()
            return cls.mma(self, *args, **kwargs)

    return Triggered


def compile_split(spec, tile_m: int, tile_n: int, stages: int = 2, trigger: bool = False):
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from xattn.core import fa4_sm90
    from xattn.core.symbolic import CUTE_DTYPES, Dims, compile_launcher

    cfg = fa4_sm90._tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    g = spec.qhead_per_kvhead
    from xattn.core import split_q_sm90

    shared = getattr(spec, "shared_q", False)
    base = split_q_sm90.SharedQueryForwardSm90 if shared else FlashAttentionForwardSm90
    cls = _triggered(base) if trigger else base
    kernel = cls(
        CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, g, is_causal=spec.causal, is_local=spec.is_local,
        pack_gqa=g > 1, tile_m=tile_m, tile_n=tile_n, num_stages=stages, num_threads=128 * (tile_m // 64 + 1),
        Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    dims = Dims(spec)
    q, k, v = dims.qkv()
    if shared:  # q's own rows, as split_q_sm90.compile_shared_q builds it
        from quack.compile_utils import make_fake_tensor
        import cutlass.cute as cute

        q = make_fake_tensor(dims.dtype, (cute.sym_int(), dims.hq, spec.head_dim), divisibility=dims.div)
        launcher = split_q_sm90._SharedVarlenFwd(kernel)
    else:
        launcher = fa4_sm90._VarlenFwd(kernel, spec)
    return compile_launcher(launcher, (q, k, v, *dims.cu_seqlens(), *dims.out_lse()))


def _split_variant(text: str, spec) -> tuple[int, int, int, bool] | None:
    """``"64x64s3+trig"`` -> (64, 64, 3, True); ``"shipped[+trig]"``: the shipped tile (None: the shipped launcher,
    no variant to build)."""
    body, _, flag = text.partition("+")
    trigger = flag == "trig"
    if body == "shipped":
        if not trigger:
            return None
        body = f"{getattr(spec, 'tile_m', 128)}x{getattr(spec, 'tile_n', 128)}"
    dims, _, stages = body.partition("s")
    tm, tn = (int(x) for x in dims.split("x"))
    return tm, tn, int(stages or 2), trigger


def _combine_variant(text: str) -> tuple[int, int, bool]:
    """``"t128s16+pdl"`` -> (128, 16, True): FlashAttention's combine, threads, stages, PDL; ``"one+pdl"`` -> (0, 0,
    True): the shipped one-pass combine; ``"one32"`` -> (0, 32, False): the same, 32 partials in flight a thread."""
    body, _, flag = text.partition("+")
    if body.startswith("one"):
        return 0, int(body[3:] or 0), flag == "pdl"
    threads, stages = body.removeprefix("t").split("s")
    return int(threads), int(stages), flag == "pdl"


def timeline(replay, calls: int = 50, warm=None) -> str:
    """Medians over ``calls`` profiled replays, each after a 256 MiB L2 flush: ``start`` (flush end to the first
    kernel), each kernel's ``name=duration`` and ``+gap`` to the next, ``span`` (flush end to the last kernel's
    end), in us. ``warm``: a callable run between the flush and the replay (its kernels are listed first)."""
    import statistics

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush.zero_()
            if warm is not None:
                warm()
            replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    runs, run = [], None
    for e in kernels:
        if "fill" in e.name.lower() or "memset" in e.name.lower():  # the flush
            run = [e.time_range.end]
            runs.append(run)
        elif run is not None:
            run.append((e.name, e.time_range.start, e.time_range.end))
    runs = [r for r in runs if len(r) > 1]
    n = min(len(r) for r in runs)
    med = statistics.median
    parts = [f"start {med(r[1][1] - r[0] for r in runs):.2f}"]
    for i in range(1, n):
        name = runs[0][i][0].split("<")[0].removeprefix("kernel_cutlass_kernel_")[:28]
        parts.append(f"{name}={med(r[i][2] - r[i][1] for r in runs):.2f}")
        if i + 1 < n:
            parts.append(f"+{med(r[i + 1][1] - r[i][2] for r in runs):.2f}")
    parts.append(f"span {med(r[n - 1][2] - r[0] for r in runs):.2f} ({len(runs)} replays, {n - 1} kernels)")
    return " ".join(parts)


def compile_dense_copy_q(spec):
    """FlashAttention's dense sm90 forward for ``spec`` (its decode tile) with q loaded by copies, not TMA (a TMA
    descriptor may refuse q's batch stride of 0)."""
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    from xattn.core import fa4_sm90
    from xattn.core.symbolic import CUTE_DTYPES, Dims, compile_launcher

    class CopyQ(FlashAttentionForwardSm90):
        @property
        def use_tma_Q(self):
            return False

        @use_tma_Q.setter
        def use_tma_Q(self, value):  # FlashAttention's __init__ / __call__ set it
            pass

    cfg = fa4_sm90._tile_size_fwd_sm90(spec.head_dim, spec.head_dim_v, spec.causal, spec.is_local)
    g = spec.qhead_per_kvhead
    kernel = CopyQ(CUTE_DTYPES[spec.dtype], spec.head_dim, spec.head_dim_v, g, is_causal=False, is_local=False,
                   pack_gqa=g > 1, tile_m=spec.tile_m, tile_n=spec.tile_n, num_stages=2, num_threads=spec.num_threads,
                   Q_in_regs=False, intra_wg_overlap=cfg.intra_wg_overlap, mma_pv_is_rs=cfg.mma_pv_is_rs)
    dims = Dims(spec)
    return compile_launcher(fa4_sm90._DenseFwd(kernel, spec), (*dims.qkv(), *dims.out_lse()))


def dense_slots(layer: str, q, k, v, splits: int, copy_q: bool = False):
    """FA4's split launch without an index (the route's next step for one sequence, docs/benchmarks.md): the S
    splits as one dense forward of batch S on the decode tile, q ``[1, 1, Hq, D]`` read through a batch stride of 0
    (by TMA, or with ``copy_q`` by copies: :func:`compile_dense_copy_q`), the keys ``k [1, Nk, Hkv, D]`` as ``[S,
    Nk / S, Hkv, D]`` through a batch stride of Nk / S rows (no copy), then the shipped combine (PDL, the chunk for
    S). Returns ``(call, key)``: ``call() -> out [1, 1, Hq, Dv]``; Nk a multiple of 64 S."""
    import dataclasses
    import math

    import torch

    from xattn.core.spec import KernelSpec
    from xattn.core.split_kv import CombineSpec, SplitFwdSpec, combine_chunk
    from xattn.torch import ops

    family, hq, hkv, d = LAYERS[layer]
    nk = k.shape[1]
    if family != "fa4" or q.shape[:2] != (1, 1) or nk % (64 * splits):
        raise SystemExit(f"--dense-slots: FA4, B1 q_len 1, Nk a multiple of 64 x {splits}; got {layer} {tuple(q.shape)}"
                         f" Nk {nk}")
    chunk = nk // splits
    q_slots = q.as_strided((splits, 1, hq, d), (0, *q.stride()[1:]), q.storage_offset())
    k_slots, v_slots = (t[0].as_strided((splits, chunk, hkv, d), (chunk * t.stride(1), *t.stride()[1:]))
                        for t in (k, v))
    spec, problem = ops._checked("fwd", family, q_slots, k_slots, v_slots, False, -1, -1)
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(KernelSpec)}
    tiled = SplitFwdSpec(**fields, tile_m=64, tile_n=64)
    if copy_q:  # its own key (the source field names it), compiled here
        tiled = dataclasses.replace(tiled, source="probe: q by copies")
        _install(tiled, compile_dense_copy_q(tiled))
    cspec = CombineSpec(family, "bfloat16", d, combine_chunk(splits))
    out_p = torch.empty((splits, 1, hq, d), dtype=q.dtype, device=q.device)
    lse_p = torch.empty((splits, hq, 1), dtype=torch.float32, device=q.device)
    out = torch.empty((1, 1, hq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((1, hq, 1), dtype=torch.float32, device=q.device)
    scale = 1 / math.sqrt(d)

    def call():
        ops.LAUNCH["fwd"]((tiled, problem), q_slots, k_slots, v_slots, out_p, lse_p, softmax_scale=scale)
        ops.LAUNCH["combine"](cspec, out_p.unsqueeze(1), lse_p.unsqueeze(1).transpose(2, 3), out, lse.permute(0, 2, 1))
        return out

    return call, tiled


def _install(spec, function):
    from xattn.core import cache

    cache._entries[spec] = cache.Launcher(spec, function, function, 0.0, "probe")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layer", default="d128", choices=sorted(LAYERS))
    ap.add_argument("--shapes", default="1:8192,1:32768,8:8192,8:32768", help="B:NK,... (q_len 1)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--splits", default="0", help="num_splits values for B1 (B>1: 0)")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--timeline", action="store_true", help="profile the graph replays kernel by kernel")
    ap.add_argument("--dense-slots", type=int, default=0, help="B1 shapes: also time FA4's split launch without an "
                    "index, as a dense forward over this many slots (dense_slots)")
    ap.add_argument("--warm", default="", help="with --timeline: after each flush read these back into L2 first: "
                    "'q' (the call's queries, which a model's previous kernel has just written), 'index' (the split "
                    "launch's cu_seqlens), comma-separated")
    args = ap.parse_args()
    family, hq, hkv, d = LAYERS[args.layer]
    from benchmarks.tools.flash_combine import compile_flash_combine
    from xattn.core.combine_sm90 import compile_combine
    from xattn.core.split_kv import COMBINE_CHUNKS, CombineSpec

    spec = split_spec(args.layer)
    ckeys = [CombineSpec(family, "bfloat16", d, c) for c in COMBINE_CHUNKS]  # the route picks one by its P
    variants = [tuple(v.split("/")) for v in args.variants.split(",")]
    splits_built, combines_built = {}, {}
    for split_text, combine_text in variants:
        sv, cv = _split_variant(split_text, spec), _combine_variant(combine_text)
        if sv is not None and sv not in splits_built:
            if family != "fa4":
                raise SystemExit(f"{split_text}: split variants are FA4's (d128) only")
            t0 = time.perf_counter()
            splits_built[sv] = compile_split(spec, *sv)
            print(f"compiled split {split_text} in {time.perf_counter() - t0:.1f} s", flush=True)
        if cv not in combines_built:
            t0 = time.perf_counter()
            if cv[0] == 0 and not cv[1]:  # the shipped combine: each chunk's launcher where the route takes it
                combines_built[cv] = {key: compile_combine(key, pdl=cv[2]) for key in ckeys}
            else:  # one launcher in place of every chunk's
                fn = (compile_combine(CombineSpec(family, "bfloat16", d, cv[1]), pdl=cv[2]) if cv[0] == 0 else
                      compile_flash_combine(ckeys[0], pdl=cv[2], threads=cv[0], stages=cv[1]))
                combines_built[cv] = dict.fromkeys(ckeys, fn)
            print(f"compiled combine {combine_text} in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.compile_only:
        return
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    import xattn.torch as xt
    from xattn.core import cache

    from xattn.torch import split_kv as split_kv_torch

    warm_sets = {w for w in args.warm.split(",") if w}
    if warm_sets - {"q", "index"}:
        raise SystemExit(f"--warm: 'q' and/or 'index', got {args.warm!r}")

    def warmer(q):
        """What ``--warm`` reads back into L2 after each flush: q, the split route's index tensors (every setup of
        this process: a few hundred bytes)."""
        tensors = [q] if "q" in warm_sets else []
        if "index" in warm_sets:
            tensors += [t for st in split_kv_torch._SETUPS.values() for t in (st.cu_q, st.cu_k, st.tail_q, st.tail_k)
                        if isinstance(t, torch.Tensor)]
        return (lambda: [t.sum() for t in tensors]) if tensors else None

    def graph_ms(fn, label="", q=None):
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
        if args.timeline:
            print(f"  timeline {label}: {timeline(graph.replay, warm=warmer(q))}", flush=True)
        return ms

    warm = torch.randn(2, 1, hq, d, device="cuda", dtype=torch.bfloat16)  # B2: the varlen split launch (B1: slots)
    warm_kv = torch.randn(2, 4096, hkv, d, device="cuda", dtype=torch.bfloat16)
    xt.attention(warm, warm_kv, warm_kv, causal=True, num_splits=2)  # the shipped launchers, from the disk cache
    if spec not in cache._entries:
        raise SystemExit(f"the route did not load {spec.short_name()}; it loaded "
                         f"{[k.short_name() for k in cache._entries]}")
    shipped = {spec: cache._entries[spec]}
    for shape in args.shapes.split(","):
        b, nk = (int(x) for x in shape.split(":"))
        g = torch.Generator(device="cuda").manual_seed(nk + b)
        q = torch.randn(b, 1, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qt.float(), kt.float(), vt.float(), enable_gqa=True).transpose(1, 2)
        sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True), "sdpa", q)
        print(f"{args.layer} B{b} {nk // 1024}k sdpa {sdpa * 1e3:.1f} us", flush=True)
        splits = [int(s) for s in args.splits.split(",")] if b == 1 else [0]
        for split_text, combine_text in variants:
            built = {spec: splits_built.get(_split_variant(split_text, spec)),
                     **combines_built[_combine_variant(combine_text)]}
            for key, fn in built.items():
                if fn is None:
                    cache._entries[key] = shipped[key]
                else:
                    _install(key, fn)
            for s in splits:
                call = lambda: xt.attention(q, k, v, causal=True, num_splits=s)  # noqa: E731
                before = set(cache._entries)
                err = (call().float() - ref).abs().max().item()
                for other in set(cache._entries) - before:  # the route took a launcher the probe did not set
                    print(f"  note: the call also loaded {other.short_name()}", flush=True)
                ms = graph_ms(call, f"{split_text}/{combine_text} S={s or 'auto'}", q)
                print(f"{args.layer} B{b} {nk // 1024}k {split_text}/{combine_text} S={s or 'auto'}: "
                      f"{ms * 1e3:.1f} us ({ms / sdpa:.3f} of sdpa), out err {err:.2e}", flush=True)
        for copy_q in (False, True) if args.dense_slots and b == 1 else ():
            label = f"dense-slots{'-copyq' * copy_q} S={args.dense_slots}"
            for key in ckeys:  # the shipped combine (this probe's variants replaced the table's launchers)
                cache._entries.pop(key, None)
            try:
                call, _ = dense_slots(args.layer, q, k, v, args.dense_slots, copy_q)
                err = (call().float() - ref).abs().max().item()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001  (a refused TMA descriptor: report it, time the other variant)
                print(f"{args.layer} B{b} {nk // 1024}k {label}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            ms = graph_ms(call, label, q)
            print(f"{args.layer} B{b} {nk // 1024}k {label}: {ms * 1e3:.1f} us ({ms / sdpa:.3f} of sdpa), "
                  f"out err {err:.2e}", flush=True)


if __name__ == "__main__":
    main()
