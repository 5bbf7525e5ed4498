"""Fuzz configurations of the drop-in entry points, drawn over their public argument forms.

The pool front ends (``space.py``) call xattn's own functions on a fixed launcher pool. These call
what replaces a peer, with every argument form a caller of that peer may use:

* ``hf``: ``xattn.torch.ffpa_attention.ffpa_attention_forward`` (HF ``attn_implementation="ffpa"``) in
  SDPA layout, with no mask (``is_causal``, ``sliding_window`` kwargs), a 2D padding mask of any width
  (as wide as the keys, narrower: static cache, wider: sliding-window cache; left or right padding),
  a 4D mask (bool or additive), or the mask the ``"ffpa"`` factory builds from an HF mask function
  (causal, sliding, bidirectional, sliding bidirectional) with cache offsets and padding.
* ``fa4-doc``: NeMo's FA4 helpers, ``document_causal_fa4_attention`` (a query shard of packed rows, runs of
  length 1, padding ids 0 / -1 / -3 at either end) and ``causal_fa4_attention``.
* ``jax-nn``: ``xattn.jax.dot_product_attention`` with ``is_causal``, ``local_window_size`` (an int or a
  pair), ``query_seq_lengths`` / ``key_value_seq_lengths`` (0 and full included), T != S.

A :class:`FormConfig` carries the shapes and the form; ``draw_form(front_end, seed)`` rebuilds it from
its seed. Shapes and windows come from small sets so that the kernels they reach are few (each is a
compile); ``python -m tests.fuzz.record_specs`` lists them for the prefill. Imports neither torch nor jax.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from .space import FORM_FRONT_ENDS, GPU_LIMITS, Limits

__all__ = ["FORM_FRONT_ENDS", "FormConfig", "draw_form"]

BF, FP = "bfloat16", "float16"
_SHORT = {BF: "bf16", FP: "fp16"}

# (head_dim, head_dim_v, q heads per kv head, dtype): mostly launchers the GPU tests compile anyway.
HF_HEADS = ((512, 512, 1, BF), (512, 512, 4, BF), (512, 512, 8, BF), (512, 512, 8, FP), (256, 256, 2, BF),
            (256, 256, 2, FP), (128, 128, 1, BF), (128, 128, 4, FP))
# FA4's sm90 backward has no GQA for 192/128 (a named NotImplementedError): that pair runs MHA only.
DOC_HEADS = tuple((d, dv, g, dt) for d, dv in ((128, 128), (192, 128), (256, 256)) for g in (1, 2, 4) for dt in (BF, FP)
                  if g == 1 or d == dv)
JAX_NN_HEADS = ((128, 128, 1, FP), (128, 128, 2, BF), (256, 256, 2, FP), (512, 512, 4, BF), (512, 512, 1, FP))
HF_SLIDING = {512: 16, 256: 16, 128: 101}  # the model's sliding_window per head dim
JAX_NN_T = (1, 7, 64, 100, 255)
JAX_NN_WINDOWS = (None, 5, (3, 0), (17, 3), (0, 0))


@dataclass(frozen=True)
class FormConfig:
    """One configuration of a drop-in front end: dense shapes ``[B, N, H, D]`` and the argument form."""

    front_end: str
    seed: int
    head_dim: int
    head_dim_v: int
    g: int
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_kv: int
    scale: float
    form: tuple = ()  # (name, value) pairs: the arguments as the caller passes them
    _form: dict = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_form", dict(self.form))

    def arg(self, name: str, default=None):
        return self._form.get(name, default)

    def opt(self, name: str, default=None):  # the pool configurations' accessor, for shared code
        return self.arg(name, default)

    @property
    def heads_q(self) -> int:
        return self.g * self.heads_kv

    @property
    def varlen(self) -> bool:
        return False

    def specs(self) -> tuple:
        return ()  # the kernels are chosen by the entry point; record_specs lists them

    @property
    def id(self) -> str:
        return f"s{self.seed}-{self.front_end}-{self.arg('kind')}-d{self.head_dim}x{self.head_dim_v}-g{self.g}-" \
               f"{_SHORT[self.dtype]}"

    def describe(self) -> str:
        form = {n: v for n, v in self._form.items() if n not in ("keep", "ids", "mask4d")}
        return (f"{self.front_end} {self.id}: B={self.batch} Nq={self.seqlen_q} Nk={self.seqlen_k} "
                f"Hq={self.heads_q} Hkv={self.heads_kv} scale={self.scale:.4g} form={form}")


def _length(rng: random.Random, cap: int, low: int = 1) -> int:
    cap = max(cap, low)
    r = rng.random()
    if r < 0.2:
        return rng.randint(low, min(cap, 9))
    return min(cap, max(low, round(math.exp(rng.uniform(math.log(max(low, 2)), math.log(cap + 0.5))))))


def _padding(rng: random.Random, b: int, width: int, side: str) -> tuple:
    """A ``[B, width]`` 0/1 padding mask as nested tuples (1 = real token)."""
    rows = []
    for _ in range(b):
        pad = 0 if rng.random() < 0.3 else rng.randint(0, max(0, width - 1))
        if rng.random() < 0.05:
            pad = width  # a row without any real token
        row = [1] * width
        if side == "left":
            row[:pad] = [0] * pad
        elif pad:
            row[width - pad:] = [0] * pad
        rows.append(tuple(row))
    return tuple(rows)


def _draw_hf(rng: random.Random, lim: Limits) -> dict:
    d, dv, g, dtype = rng.choice(HF_HEADS)
    kind = rng.choices(["none", "2d", "4d", "factory"], [0.2, 0.35, 0.15, 0.3])[0]
    b = rng.randint(1, 3)
    causal = rng.random() < 0.8
    sliding = HF_SLIDING[d] if rng.random() < 0.4 else None
    form = dict(kind=kind, is_causal=causal, sliding_window=sliding)
    cap = lim.max_n // 4
    if kind == "factory":
        nq = _length(rng, cap)
        past = 0 if rng.random() < 0.4 else _length(rng, cap)
        static_extra = rng.choice([0, 0, _length(rng, 64)])
        nk = nq + past + static_extra
        fn = rng.choice(["causal", "sliding", "bidirectional", "sliding_bidirectional"])
        side = rng.choice(["none", "left", "left", "right"])
        keep = None if side == "none" else _padding(rng, b, nq + past, side)
        form.update(mask_function=fn, window=HF_SLIDING[d] if "sliding" in fn else None, q_offset=past, keep=keep)
    elif kind == "2d":
        nk = _length(rng, cap)
        nq = 1 if rng.random() < 0.3 else rng.randint(1, nk)
        r = rng.random()
        width = nk if r < 0.4 else rng.randint(nq, nk) if r < 0.7 else nk + _length(rng, 64)
        form.update(keep=_padding(rng, b, width, "left" if rng.random() < 0.8 else "right"))
    elif kind == "4d":
        nq, nk = _length(rng, cap), _length(rng, cap)
        form.update(additive=rng.random() < 0.4, mask_seed=rng.randrange(1 << 30))
    else:
        nk = _length(rng, cap)
        nq = nk if rng.random() < 0.5 else _length(rng, cap)
    return dict(head=(d, dv, g, dtype), batch=b, seqlen_q=nq, seqlen_k=nk, form=form)


def _doc_ids(rng: random.Random, n: int, pad_id: int) -> tuple:
    """One row of ``n`` document ids: runs numbered from 1 (some of length 1), padding runs of
    ``pad_id`` at the end and sometimes at the start."""
    ids, doc = [], 1
    if rng.random() < 0.2:
        ids += [pad_id] * rng.randint(1, max(1, n // 4))
    while len(ids) < n:
        if rng.random() < 0.15:
            ids += [pad_id] * rng.randint(1, max(1, n // 3))
            continue
        run = 1 if rng.random() < 0.25 else _length(rng, max(1, n // 2))
        ids += [doc] * run
        doc += 1
    return tuple(ids[:n])


def _draw_doc(rng: random.Random, lim: Limits) -> dict:
    d, dv, g, dtype = rng.choice(DOC_HEADS)
    b = rng.randint(1, 3)
    nk = _length(rng, lim.max_n // 2, low=2)
    if rng.random() < 0.2:
        return dict(head=(d, dv, g, dtype), batch=b, seqlen_q=nk, seqlen_k=nk, form=dict(kind="causal"))
    pad_id = rng.choice([0, 0, -1, -3])
    ids = tuple(_doc_ids(rng, nk, pad_id) for _ in range(b))
    start = 0 if rng.random() < 0.3 else rng.randint(0, nk - 1)
    nq = nk - start if rng.random() < 0.4 else rng.randint(1, nk - start)
    return dict(head=(d, dv, g, dtype), batch=b, seqlen_q=nq, seqlen_k=nk,
                form=dict(kind="document", ids=ids, q_global_start=start, pad_id=pad_id))


def _draw_jax_nn(rng: random.Random, lim: Limits) -> dict:
    d, dv, g, dtype = rng.choice(JAX_NN_HEADS)
    b = rng.choice([1, 2])
    t = rng.choice([x for x in JAX_NN_T if x <= lim.max_n] or [1])
    s = t if rng.random() < 0.6 else rng.choice([x for x in JAX_NN_T if x <= lim.max_n] or [1])
    causal = rng.random() < 0.5
    window = rng.choice(JAX_NN_WINDOWS) if t == s else None  # T != S windows: one compile per shift
    lengths = rng.choice(["none", "q", "kv", "both"])

    def lens(n):
        return tuple(rng.choice([0, n, n, rng.randint(0, n)]) for _ in range(b))
    form = dict(kind=lengths, is_causal=causal, local_window_size=window,
                query_seq_lengths=lens(t) if lengths in ("q", "both") else None,
                key_value_seq_lengths=lens(s) if lengths in ("kv", "both") else None)
    return dict(head=(d, dv, g, dtype), batch=b, seqlen_q=t, seqlen_k=s, form=form)


_DRAWS = {"hf": _draw_hf, "fa4-doc": _draw_doc, "jax-nn": _draw_jax_nn}


def draw_form(front_end: str, seed: int, limits: Limits = GPU_LIMITS) -> FormConfig:
    """The configuration of ``seed`` for a drop-in front end (deterministic)."""
    if front_end not in FORM_FRONT_ENDS:
        raise ValueError(f"front_end: expected one of {FORM_FRONT_ENDS}, got {front_end!r}")
    rng = random.Random(seed)
    lim = limits
    for _ in range(100):  # redraw until the reference's score matrices fit the budget
        drawn = _DRAWS[front_end](rng, lim)
        d, dv, g, dtype = drawn["head"]
        heads_kv = rng.randint(1, max(1, min(2, lim.max_heads_q // g)))
        if drawn["batch"] * g * heads_kv * drawn["seqlen_q"] * drawn["seqlen_k"] <= lim.max_scores:
            break
        lim = Limits(max(2, lim.max_n // 2), lim.max_batch, lim.max_heads_q, lim.max_docs, lim.max_scores)
    scale = 1.0 / math.sqrt(d) * (rng.uniform(0.25, 2.0) if rng.random() < 0.3 else 1.0)
    form = tuple(sorted(drawn["form"].items()))
    return FormConfig(front_end, seed, d, dv, g, dtype, drawn["batch"], drawn["seqlen_q"], drawn["seqlen_k"],
                      heads_kv, scale, form)
