"""The fuzz configuration space: a fixed pool of launchers; everything else drawn per configuration.

Every distinct :class:`~xattn.core.spec.KernelSpec` is a separately compiled launcher (FFPA ~25-50 s,
FA4 ~5-10 s on a CPU), while batch, sequence lengths and head counts are dynamic. So a configuration
picks its kernel from :data:`POOL` (30 forward/backward pairs, 60 launchers: :func:`launcher_pool`,
which ``scripts/prefill_gpu_cache.py --fuzz`` compiles ahead of the GPU run) and draws the rest:
batch, Nq != Nk (1, small, not a multiple of any tile, sometimes one), heads at the pool entry's
GQA ratio, packed batches over the whole documented varlen contract (empty and length-1 documents,
self-attention documents, rows after ``cu[-1]`` on either side so ``Tq != Tk``, ``max_seqlen_q/k``
looser than the longest document on either side, one cu_seqlens object for q and k or two), memory layouts (permuted
``[B, H, N, D]`` storage, padded head dim, a slice of wider head storage), softmax scale, and the
front end's own choices (entry point, stream, mask spelling, jit).

Seeds: the base seed is ``XATTN_FUZZ_SEED`` (default :data:`DEFAULT_SEED`); configuration ``i`` of a
front end gets ``config_seed(base, front_end, i)``, and ``draw(front_end, seed)`` rebuilds it from
that seed alone, so ``XATTN_FUZZ_ONLY=<seed>[,<seed>...]`` reruns one failing configuration.
``XATTN_FUZZ_N`` configurations per front end (default 1000); ``XATTN_FUZZ_START=k`` runs configurations k..N-1 only
(a run cut short by a device call's time limit resumes there); ``XATTN_FUZZ_SHARD=i/k`` keeps every k-th of those,
from the i-th on (``scripts/gpu_run.sh fuzz-shards-<front end>`` runs k processes side by side and merges their
rows with ``python -m tests.fuzz.results merge``). The drop-in front ends (``hf``, ``fa4-doc``,
``jax-nn``) draw their argument forms in ``forms.py`` from the same seeds.

Imports neither torch nor jax (the prefill script imports it).
"""

from __future__ import annotations

import hashlib
import math
import os
import random
from dataclasses import dataclass, field

from xattn.core.spec import KernelSpec, supports

__all__ = ["POOL", "FRONT_ENDS", "PoolEntry", "Config", "Limits", "GPU_LIMITS", "CPU_LIMITS", "launcher_pool",
           "config_seed", "draw", "configs", "env_settings", "selected_indices", "selection_note", "spellings",
           "refusals", "DEFAULT_SEED", "DEFAULT_N", "FORM_FRONT_ENDS", "ALL_FRONT_ENDS"]

DEFAULT_SEED = 20261201
DEFAULT_N = 1000
FRONT_ENDS = ("core", "core-jax", "torch", "jax")  # xattn's own entry points, on the launcher pool
FORM_FRONT_ENDS = ("hf", "fa4-doc", "jax-nn")  # the drop-ins, over their peers' argument forms (forms.py)
ALL_FRONT_ENDS = FRONT_ENDS + FORM_FRONT_ENDS
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class PoolEntry:
    """One forward/backward launcher pair: everything that is compiled in."""

    family: str
    dtype: str
    head_dim: int
    head_dim_v: int
    g: int  # q heads per kv head
    causal: bool = False
    varlen: bool = False
    window: tuple = (None, None)

    def spec(self, direction: str) -> KernelSpec:
        return KernelSpec(self.family, direction, self.dtype, self.head_dim, self.head_dim_v, self.g,
                          self.causal, self.varlen, *self.window)

    @property
    def mask(self) -> str:
        if self.causal:
            return "causal"
        if self.window != (None, None):
            return "w{}_{}".format(*self.window)
        return "full"

    @property
    def name(self) -> str:
        return (f"{self.family}-d{self.head_dim}x{self.head_dim_v}-g{self.g}-{self.mask}-"
                f"{'varlen' if self.varlen else 'dense'}-{_SHORT_DTYPE[self.dtype]}")


def _e(family, dtype, d, g, mask="full", varlen=False, dv=None):
    causal, window = mask == "causal", ((None, None) if mask in ("full", "causal") else mask)
    return PoolEntry(family, dtype, d, dv or d, g, causal, varlen, window)


BF, FP = "bfloat16", "float16"
# Chosen to cover the space with few compiles: every FA4 head-dim pair, FFPA 320/336/384/448/512 (its
# three kernel classes: d512 SplitD, <= 384, generic), both dtypes per family, GQA 1/2/4/8 per family
# plus FA4 ratios that do not divide a tile (5, 6), full / causal / windows (64, 0),
# (100, 37), (None, 128), dense and varlen in each family. Most FFPA entries are launchers the GPU
# tests already use (cheap to prefill). FFPA with a ratio that does not divide 64 (e.g. 3) is left out:
# its forward does not compile (ffpa_sm90 passes pack_gqa=True; SplitD asserts tile_m % g == 0) although
# supports() accepts it (reported on issue #12).
POOL: tuple[PoolEntry, ...] = (
    _e("ffpa", BF, 512, 1),
    _e("ffpa", BF, 512, 4, "causal", varlen=True),
    _e("ffpa", FP, 512, 8, "causal"),
    _e("ffpa", BF, 512, 2, varlen=True),
    _e("ffpa", FP, 512, 8, "causal", varlen=True),
    _e("ffpa", BF, 320, 2, "causal"),
    _e("ffpa", FP, 320, 1, varlen=True),
    _e("ffpa", BF, 336, 2, "causal"),
    _e("ffpa", FP, 384, 2),
    _e("ffpa", BF, 384, 1, "causal", varlen=True),
    _e("ffpa", BF, 448, 2, "causal"),
    _e("ffpa", FP, 448, 4, varlen=True),
    _e("fa4", BF, 64, 1),
    _e("fa4", FP, 64, 4, "causal", varlen=True),
    _e("fa4", BF, 64, 8, (64, 0)),
    _e("fa4", FP, 96, 2, "causal"),
    _e("fa4", BF, 96, 1, (100, 37), varlen=True),
    _e("fa4", BF, 128, 4, "causal"),
    _e("fa4", FP, 128, 1, varlen=True),
    _e("fa4", BF, 128, 2, (None, 128)),
    _e("fa4", BF, 128, 8),
    _e("fa4", BF, 192, 1, "causal", dv=128),
    _e("fa4", FP, 192, 1, varlen=True, dv=128),
    _e("fa4", BF, 192, 1, (64, 0), dv=128),
    _e("fa4", BF, 192, 5),
    _e("fa4", FP, 192, 1, "causal", varlen=True),
    _e("fa4", BF, 256, 2, "causal", varlen=True),
    _e("fa4", FP, 256, 1),
    _e("fa4", BF, 256, 4, (100, 37)),
    _e("fa4", FP, 256, 6, varlen=True),
)


def launcher_pool() -> list[KernelSpec]:
    """The launchers every fuzz configuration draws from (forward and backward of each pool entry)."""
    return [entry.spec(direction) for entry in POOL for direction in ("fwd", "bwd")]


def split_launchers() -> list:
    """The launchers the split-KV forward of the pool's entries (dense and packed) runs when the fuzz forces it:
    the family's varlen forward (non-causal splits, with the decode tile where the core has one, on q as it is where
    :func:`xattn.core.split_kv.shared_queries` holds, else on q once per slot; causal tail), the slot launch's
    dense non-causal forward (:func:`xattn.core.split_kv.slot_launch`, FA4's on its decode tile), the slot call
    (that launch, FFPA's tail and the combine in one host function: eager 16-bit calls; the batched one for B > 1)
    and the combine
    (:mod:`xattn.core.split_kv`)."""
    import dataclasses

    from xattn.core.split_kv import (BATCHED_SLOT_FAMILIES, COMBINE_CHUNKS, SLOT_FAMILIES, TAIL_SLOT_FAMILIES,
                                     CombineSpec, SlotCallSpec, split_launch_spec)

    out = []
    for s in launcher_pool():
        if s.direction == "fwd" and not s.is_local:
            out += [split_launch_spec(dataclasses.replace(s, varlen=True, causal=c)) for c in (False, True)]
            out.append(split_launch_spec(dataclasses.replace(s, varlen=True, causal=False), shared_q=True))
            if s.family in SLOT_FAMILIES:
                out.append(split_launch_spec(dataclasses.replace(s, varlen=False, causal=False)))
                out += [SlotCallSpec(s.family, s.dtype, s.head_dim, s.head_dim_v, s.qhead_per_kvhead, c, tail, batched)
                        for c in COMBINE_CHUNKS
                        for batched in (False, True) if not batched or s.family in BATCHED_SLOT_FAMILIES
                        for tail in (False, True) if not tail or batched or s.family in TAIL_SLOT_FAMILIES]
            out += [CombineSpec(s.family, s.dtype, s.head_dim_v, c) for c in COMBINE_CHUNKS]
    return list(dict.fromkeys(out))


def kvcache_launchers() -> list:
    """The launchers the fuzz's ``kvcache:fused`` route runs on the pool's entries (``xt.attention_with_kvcache``
    with device lengths: the family's varlen forward with the entry's mask over the flat cache view); its
    ``kvcache:split-kv`` route runs :func:`split_launchers`' ones."""
    import dataclasses

    return list(dict.fromkeys(dataclasses.replace(s, varlen=True) for s in launcher_pool() if s.direction == "fwd"))


def paged_launchers() -> list:
    """The launchers the fuzz's ``paged`` route runs on the pool's entries (harness.PAGE_SIZES): torch's the entry's
    own mask (one launch; packed entries: the packed-query paged launcher) and the split launches of decoding
    (dense queries: non-causal splits, causal tail); JAX's (Pallas' call) the heads-first pools' launcher."""
    import dataclasses

    from .harness import PAGE_SIZES

    from xattn.core.paged import tma_page_rows
    from xattn.core.split_kv import split_launch_spec

    out = []
    for s in launcher_pool():
        for ps in PAGE_SIZES[s.family] if s.direction == "fwd" else ():
            out += [dataclasses.replace(s, page_size=ps)]
            if not s.is_local:
                out += [dataclasses.replace(s, varlen=False, page_size=ps, causal=c) for c in (False, True)]
                rows = tma_page_rows(s.family, s.head_dim, s.head_dim_v, ps)  # torch's split launches' pages
                out += [split_launch_spec(dataclasses.replace(s, varlen=False, page_size=rows, causal=False)),
                        dataclasses.replace(s, varlen=False, page_size=rows, causal=True)]
                out.append(split_launch_spec(dataclasses.replace(s, varlen=False, page_size=ps, causal=False,
                                                                 kv_heads_first=True)))
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class Limits:
    """Size bounds of drawn shapes. ``max_scores`` bounds sum(B * Hq * Nq * Nk) (the reference's N^2)."""

    max_n: int = 2048
    max_batch: int = 4
    max_heads_q: int = 16
    max_docs: int = 8
    max_scores: int = 1 << 25


GPU_LIMITS = Limits()
CPU_LIMITS = Limits(max_n=40, max_batch=2, max_heads_q=4, max_docs=3, max_scores=1 << 13)
# JAX compiles once per new shape: its shapes come from buckets so that compiles repeat.
_JAX_N = (1, 7, 100, 255, 513, 1000, 1999)
_JAX_T = (1, 9, 130, 400, 777, 1500)
_JAX_DOCS = (1, 3, 6)
_ALIGNED = (64, 128, 192, 256, 512, 1024, 2048)


@dataclass(frozen=True)
class Config:
    """One fuzz configuration. Dense: ``lens_q``/``lens_k`` are empty; varlen: one entry per document.

    ``layouts`` maps a buffer name to its storage (see ``tests/fuzz/harness.py``); ``options`` holds
    the front end's choices (entry point, stream, mask spelling, jit, ...).
    """

    front_end: str
    seed: int
    entry: PoolEntry
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_kv: int
    scale: float
    lens_q: tuple = ()
    lens_k: tuple = ()
    extra_q: int = 0  # varlen: rows after the last document (cu[-1] < T), on the query / key side
    extra_k: int = 0
    layouts: tuple = ()
    options: tuple = ()
    _opts: dict = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_opts", dict(self.options))

    def opt(self, name: str, default=None):
        return self._opts.get(name, default)

    def layout(self, name: str) -> str:
        return dict(self.layouts).get(name, "contiguous")

    @property
    def heads_q(self) -> int:
        return self.entry.g * self.heads_kv

    @property
    def varlen(self) -> bool:
        return self.entry.varlen

    @property
    def total_q(self) -> int:
        return sum(self.lens_q) + self.extra_q if self.varlen else self.batch * self.seqlen_q

    @property
    def total_k(self) -> int:
        return sum(self.lens_k) + self.extra_k if self.varlen else self.batch * self.seqlen_k

    def scores(self) -> int:
        """Elements of the reference's score matrices, all heads and documents together."""
        if self.varlen:
            return self.heads_q * sum(a * b for a, b in zip(self.lens_q, self.lens_k))
        return self.batch * self.heads_q * self.seqlen_q * self.seqlen_k

    def specs(self) -> tuple[KernelSpec, KernelSpec]:
        return self.entry.spec("fwd"), self.entry.spec("bwd")

    @property
    def id(self) -> str:
        """``s<seed>-<pool entry>``: the test id; ``XATTN_FUZZ_ONLY=<seed>`` reruns it."""
        return f"s{self.seed}-{self.entry.name}"

    def describe(self) -> str:
        shape = (f"docs q={list(self.lens_q)} k={list(self.lens_k)} Tq={self.total_q} Tk={self.total_k} "
                 f"max_seqlen={self.seqlen_q}/{self.seqlen_k}" if self.varlen
                 else f"B={self.batch} Nq={self.seqlen_q} Nk={self.seqlen_k}")
        return (f"{self.front_end} {self.id}: {shape} Hq={self.heads_q} Hkv={self.heads_kv} "
                f"scale={self.scale:.4g} layouts={dict(self.layouts)} options={self._opts}")


def config_seed(base: int, front_end: str, index: int) -> int:
    """Seed of configuration ``index`` of ``front_end`` under base seed ``base`` (31 bits, stable)."""
    digest = hashlib.sha256(f"xattn-fuzz:{base}:{front_end}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def _length(rng: random.Random, cap: int, low: int = 1) -> int:
    """A sequence length in [low, cap]: tiny, tile-aligned, or log-uniform (rarely a tile multiple)."""
    cap = max(cap, low)
    r = rng.random()
    if r < 0.15:
        return rng.randint(low, min(cap, 16))
    if r < 0.25:
        aligned = [a for a in _ALIGNED if low <= a <= cap]
        if aligned:
            return rng.choice(aligned)
    return min(cap, max(low, round(math.exp(rng.uniform(math.log(max(low, 2)), math.log(cap + 0.5))))))


def _split(rng: random.Random, total: int, parts: int) -> list[int]:
    """``total`` tokens over ``parts`` documents, some empty or of length 1."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    rng.shuffle(lens)
    return lens


def _doc_lengths(rng: random.Random, front_end: str, lim: Limits) -> tuple[list[int], list[int]]:
    if front_end == "jax":  # bucketed totals, random split (documents of 0 and 1 come up often)
        docs = rng.choice([d for d in _JAX_DOCS if d <= lim.max_docs] or [1])
        tq = rng.choice([t for t in _JAX_T if t <= lim.max_n * docs] or [1])
        lens_q = _split(rng, tq, docs)
        if rng.random() < 0.4:  # self-attention documents (the packed GEMM routes' own case)
            return lens_q, list(lens_q)
        tk = tq if rng.random() < 0.4 else rng.choice([t for t in _JAX_T if t <= lim.max_n * docs] or [1])
        return lens_q, _split(rng, tk, docs)
    docs = rng.randint(1, lim.max_docs)
    cap = max(1, lim.max_n // 2)
    lens_q, lens_k = [], []
    for _ in range(docs):
        r = rng.random()
        lq = 0 if r < 0.15 else 1 if r < 0.3 else _length(rng, cap)
        r = rng.random()
        lk = lq if r < 0.35 and lq else 0 if r < 0.45 else 1 if r < 0.5 else _length(rng, cap)
        lens_q.append(lq)
        lens_k.append(lk)
    if rng.random() < 0.4:  # self-attention documents
        return lens_q, list(lens_q)
    return lens_q, lens_k


def _decoding(seed: int, lens_q: list, max_q: int) -> tuple[list, int]:
    """One packed draw in four is a decoding batch (issue #43: vLLM's and HF continuous batching's decode
    steps, the split route's packed case): at most 1-16 queries per document, keeping the draw's empty
    documents and its looser max_seqlen_q. A side generator: every other draw of the seed stays as it was."""
    side = random.Random(f"{seed}:decoding")
    if side.random() >= 0.25:
        return lens_q, max_q
    cap = side.choice([1, 1, 2, 4, 16])
    short = [min(n, cap) for n in lens_q]
    loose = max_q - max(lens_q)
    return short, min(max(short) + loose, 16)


def _varlen_contract(rng: random.Random, front_end: str, lens_q, lens_k) -> tuple[int, int, int, int, list]:
    """What else the varlen contract allows beyond the documents: ``(extra_q, extra_k, max_seqlen_q,
    max_seqlen_k, options)`` with rows after ``cu[-1]`` on either side (so ``Tq != Tk`` even for one
    cu_seqlens), ``max_seqlen`` looser than the longest document (either side, so ``max_seqlen_q !=
    max_seqlen_k`` both ways), and for self-attention documents one cu_seqlens object for q and k."""
    extras = (0, 0, 3, 64) if front_end == "jax" else (0, 0, 1, 7, 40)  # JAX: few shapes, few compiles
    extra_q, extra_k = rng.choice(extras), rng.choice(extras)
    loose = (0, 0, 1, 24) if front_end == "jax" else (0, 0, 1, 5, 33)
    max_q, max_k = max(lens_q) + rng.choice(loose), max(lens_k) + rng.choice(loose)
    options = []
    if list(lens_q) == list(lens_k) and rng.random() < 0.7:
        options.append(("same_cu", True))
    return extra_q, extra_k, max_q, max_k, options


def _layouts(rng: random.Random, names, varlen: bool, front_end: str) -> list[tuple[str, str]]:
    """Storage per buffer: contiguous, heads-major (``[B, H, N, D]`` / ``[H, T, D]`` permuted),
    padded head dim, or a slice of wider head storage. JAX arrays are compact: only "swapped"."""
    out = []
    for name in names:
        if front_end == "jax":
            kinds, weights = ["contiguous", "swapped"], [0.7, 0.3]
            if varlen:
                kinds, weights = ["contiguous"], [1.0]
        elif name == "lse":
            kinds, weights = ["contiguous", f"padded:{rng.choice([1, 3, 8])}"], [0.7, 0.3]
        else:
            kinds = ["contiguous", "swapped", f"padded:{8 * rng.randint(1, 4)}",
                     f"wide:{rng.randint(1, 3)}:{rng.randint(0, 1)}"]
            weights = [0.45, 0.25, 0.15, 0.15]
        kind = rng.choices(kinds, weights)[0]
        if kind != "contiguous":
            out.append((name, kind))
    return out


def spellings(entry: PoolEntry) -> list[tuple[bool, tuple]]:
    """Every public ``(causal, window_size)`` form that means the entry's mask: the canonical one first,
    then FlashAttention-2's ``-1`` for an unbounded side, causality as the window ``(None, 0)``, a causal
    left window as ``causal=True`` with a left side, and right sides that causality clips."""
    left, right = entry.window
    if entry.causal:
        return [(True, (None, None)), (True, (-1, -1)), (False, (None, 0)), (False, (-1, 0)), (True, (None, 5)),
                (True, (-1, 17))]
    if (left, right) == (None, None):
        return [(False, (None, None)), (False, (-1, -1)), (False, (None, -1)), (False, (-1, None))]
    if right == 0:
        return [(False, (left, 0)), (True, (left, None)), (True, (left, -1)), (True, (left, 9))]
    if left is None:
        return [(False, (None, right)), (False, (-1, right))]
    return [(False, (left, right))]


# Forms that must be refused with a named error before any launch: (causal, window_size, error, message).
_REFUSALS_ANY = [(False, (-2, 0), "ValueError", "window_size"), (True, (0, -3), "ValueError", "window_size"),
                 (False, (-64, None), "ValueError", "window_size"), (False, (1.5, 0), "TypeError", "window_size")]
_REFUSALS_FFPA = [(False, (3, 0), "NotImplementedError", "sliding-window"),
                  (True, (3, None), "NotImplementedError", "sliding-window"),
                  (True, (16, -1), "NotImplementedError", "sliding-window"),
                  (False, (16, 16), "NotImplementedError", "sliding-window"),
                  (False, (None, 4), "NotImplementedError", "sliding-window")]


def refusals(front_end: str, entry: PoolEntry) -> list[tuple]:
    """The refused forms a configuration of this entry may try first (none where the entry point takes no
    window: ``xattn.jax.ffpa_attention`` on dense inputs)."""
    if front_end == "jax" and entry.family == "ffpa" and not entry.varlen:
        return []
    return _REFUSALS_ANY + (_REFUSALS_FFPA if entry.family == "ffpa" else [])


def _options(rng: random.Random, front_end: str, entry: PoolEntry) -> list[tuple[str, object]]:
    opts = []
    forms = spellings(entry)
    if front_end == "jax" and entry.family == "ffpa" and not entry.varlen:
        forms = [f for f in forms if f[1] == (None, None)]  # ffpa_attention takes causal only
    if len(forms) > 1 and rng.random() < 0.6:
        opts.append(("spelling", rng.choice(forms[1:])))
    if refusals(front_end, entry) and rng.random() < 0.25:
        opts.append(("refuse", rng.choice(refusals(front_end, entry))))
    if front_end in ("core", "core-jax"):
        opts.append(("stream", rng.choice(["current", "explicit"])))
    if front_end == "core-jax":
        opts.append(("outputs", rng.choice(["torch", "tvm_ffi"])))
    if front_end == "torch":
        entries = ["attention_with_lse"] + (["flash_attn_func"] if entry.family == "fa4" else [])
        opts.append(("entry", rng.choice(entries)))
        opts.append(("family", rng.choice(["auto", "explicit"])))
        if entry.varlen:
            opts.append(("max_seqlen", rng.choice(["exact", "loose"])))
    if front_end == "jax":
        opts.append(("jit", rng.random() < 0.25))
    return opts


def draw(front_end: str, seed: int, limits: Limits = GPU_LIMITS, pool=POOL) -> Config:
    """The configuration of ``seed`` for ``front_end`` (deterministic; independent of any other draw)."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"front_end: expected one of {FRONT_ENDS}, got {front_end!r}")
    rng = random.Random(seed)
    entry = rng.choice(pool)
    lim = limits
    for _ in range(100):  # redraw shapes until the reference's score matrices fit the budget
        hkv_cap = max(1, lim.max_heads_q // entry.g)
        if front_end == "jax":
            heads_kv = rng.choice([h for h in (1, 2) if h <= hkv_cap])
        else:
            heads_kv = rng.randint(1, min(hkv_cap, 4))
        extra_q = extra_k = 0
        contract_options = []
        if entry.varlen:
            lens_q, lens_k = _doc_lengths(rng, front_end, lim)
            if sum(lens_q) == 0:
                lens_q[rng.randrange(len(lens_q))] = 1  # at least one query row
            if sum(lens_k) == 0:
                lens_k[rng.randrange(len(lens_k))] = 1  # some key to attend to
            extra_q, extra_k, nq, nk, contract_options = _varlen_contract(rng, front_end, lens_q, lens_k)
            batch = len(lens_q)
            short, nq = _decoding(seed, lens_q, nq)
            if short != lens_q:  # no longer self-attention documents: two cu_seqlens objects
                lens_q, contract_options = short, [o for o in contract_options if o[0] != "same_cu"]
        else:
            lens_q = lens_k = []
            if front_end == "jax":
                batch = rng.choice([b for b in (1, 2, 3) if b <= lim.max_batch])
                ns = [n for n in _JAX_N if n <= lim.max_n]
                nq = rng.choice(ns)
                nk = nq if rng.random() < 0.3 else rng.choice(ns)
            else:
                batch = rng.randint(1, lim.max_batch)
                nq = _length(rng, lim.max_n)
                nk = nq if rng.random() < 0.3 else _length(rng, lim.max_n)
        cfg_scores = entry.g * heads_kv * (sum(a * b for a, b in zip(lens_q, lens_k)) if entry.varlen
                                           else batch * nq * nk)
        if cfg_scores <= lim.max_scores:
            break
        lim = Limits(max(1, lim.max_n // 2), lim.max_batch, lim.max_heads_q, lim.max_docs, lim.max_scores)
    scale = 1.0 / math.sqrt(entry.head_dim)
    if rng.random() < 0.3:
        scale *= rng.uniform(0.25, 2.0)
    names = ["q", "k", "v"] if front_end == "jax" else ["q", "k", "v", "dout"]
    if front_end in ("core", "core-jax"):
        names += ["out", "lse", "dq", "dk", "dv"]
    layouts = _layouts(rng, names, entry.varlen, front_end)
    if front_end == "core-jax":  # JAX arrays are compact: only the (torch) outputs take layouts
        layouts = [(n, kind) for n, kind in layouts if n in ("out", "lse", "dq", "dk", "dv")]
    options = tuple(_options(rng, front_end, entry)) + tuple(contract_options)
    return Config(front_end, seed, entry, batch, nq, nk, heads_kv, scale, tuple(lens_q), tuple(lens_k), extra_q,
                  extra_k, tuple(layouts), options)


def env_settings() -> tuple[int, int, list[int] | None]:
    """``(base seed, configurations per front end, only these seeds or None)`` from the environment."""
    base = int(os.environ.get("XATTN_FUZZ_SEED", DEFAULT_SEED))
    n = int(os.environ.get("XATTN_FUZZ_N", DEFAULT_N))
    only = os.environ.get("XATTN_FUZZ_ONLY")
    seeds = [int(s.strip().lstrip("s")) for s in only.split(",") if s.strip()] if only else None
    return base, n, seeds


def selected_indices(n: int) -> range:
    """The configuration indices of this process: ``XATTN_FUZZ_START`` .. n-1, every k-th from the i-th under
    ``XATTN_FUZZ_SHARD=i/k`` (0 <= i < k)."""
    start = int(os.environ.get("XATTN_FUZZ_START", 0))  # resume a run cut short: configurations start..n-1
    shard = os.environ.get("XATTN_FUZZ_SHARD", "0/1")
    try:
        i, k = (int(x) for x in shard.split("/"))
    except ValueError:
        raise ValueError(f"XATTN_FUZZ_SHARD={shard!r}: expected 'i/k' with 0 <= i < k") from None
    if not 0 <= i < k:
        raise ValueError(f"XATTN_FUZZ_SHARD={shard!r}: expected 'i/k' with 0 <= i < k")
    return range(start + i, n, k)


def selection_note(n: int) -> str:
    """What :func:`selected_indices` keeps, in words (empty for the whole run)."""
    start, shard = int(os.environ.get("XATTN_FUZZ_START", 0)), os.environ.get("XATTN_FUZZ_SHARD", "0/1")
    parts = [f"configurations {start}-{n - 1}"] if start else []
    if shard != "0/1":
        parts.append(f"shard {shard}")
    return ", ".join(parts)


def configs(front_end: str, n: int | None = None, base: int | None = None, only=None,
            limits: Limits = GPU_LIMITS) -> list[Config]:
    """The configurations of one front end: ``n`` seeded draws, or exactly the seeds in ``only``."""
    env_base, env_n, env_only = env_settings()
    base = env_base if base is None else base
    n = env_n if n is None else n
    only = env_only if only is None else only
    indices = selected_indices(n)
    seeds = list(only) if only else [config_seed(base, front_end, i) for i in indices]
    if front_end in FORM_FRONT_ENDS:
        from .forms import draw_form

        return [draw_form(front_end, s, limits) for s in seeds]
    out = [draw(front_end, s, limits) for s in seeds]
    for cfg in out:
        for spec in cfg.specs():
            assert supports(spec) is None, f"{cfg.id}: pool entry not supported: {supports(spec)}"
    return out
