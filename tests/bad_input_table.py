"""The bad inputs that the torch and JAX batteries share (``tests/torch/test_bad_inputs.py``,
``tests/jax/test_bad_inputs.py`` and their ``_gpu`` twins): one row per case, written once.

A row names a base problem its front end builds (``dense``: FFPA d512 GQA 4; ``fa4``: FA4 d128 GQA 4
causal; ``window``: FA4 d256 GQA 2 with a (63, 0) window; ``varlen``: packed FA4 d128 GQA 4 causal;
``shapes``: shape-only q/k/v of sizes no memory holds), the changes to it (``args``, with ``scale`` for
the front end's scale keyword), an ``edit`` of the built ``(q, k, v), kwargs`` through :class:`Ops`,
and the outcome (a named error and the words its message must hold, ``{scale}`` standing for the
scale keyword; or a correct result). Both front ends run the same validator
(:func:`xattn.core.checks.validate`), so their messages must agree word for word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tests.battery import case

BIG = 2 ** 31  # one past the kernels' 32-bit index range


class Ops:
    """What an edit needs that torch and JAX spell differently."""

    def cast(self, x, dtype: str):  # x in another dtype ("float32", "int64", ...)
        raise NotImplementedError

    def tile_heads(self, x, n: int):  # x with its heads (dim 2) repeated n times
        raise NotImplementedError


@dataclass(frozen=True)
class Row:
    id: str
    base: str
    args: dict = field(default_factory=dict)
    edit: Callable[[Any, Any, Any, dict, Ops], tuple] | None = None  # (q, k, v, kw, ops) -> ((q, k, v), kw)
    error: type[Exception] | None = None
    words: tuple[str, ...] = ()
    bwd_error: type[Exception] | None = None
    gpu: bool = True
    words_by: dict = field(default_factory=dict)  # front end -> words, where the kernels' choice differs


def _kw(**changes):
    """An edit that changes keyword arguments: ``changes[name](value, ops)``."""
    return lambda q, k, v, kw, ops: ((q, k, v), {**kw, **{n: f(kw[n], ops) for n, f in changes.items()}})


def _qkv(f):
    return lambda q, k, v, kw, ops: (f(q, k, v, ops), kw)


TABLE = [
    # empty and zero-length: a correct (empty / 0 and -inf) result, zero gradients
    Row("empty-batch", "dense", dict(b=0)),
    Row("zero-q-len", "dense", dict(nq=0)),
    Row("zero-k-len", "dense", dict(nk=0)),
    Row("zero-k-len-causal", "dense", dict(nk=0, causal=True)),
    Row("zero-q-and-k-len", "dense", dict(nq=0, nk=0)),
    Row("fa4-zero-q-len", "fa4", dict(nq=0)),
    Row("fa4-zero-k-len", "fa4", dict(nk=0)),
    Row("window-zero-k-len", "window", dict(nk=0)),
    Row("fa4-q-longer-than-k", "fa4", dict(nq=12, nk=5)),  # bottom-right causal: 7 rows see no key
    # head dims no kernel has
    Row("head-dim-72", "dense", dict(d=72), error=NotImplementedError, words=("72",),
        words_by={"jax": ("320-512", "72")}),  # torch picks the family by head dim, JAX's ffpa_attention is FFPA
    Row("head-dim-300", "dense", dict(d=300), error=NotImplementedError, words=("320-512", "300")),
    Row("head-dim-600", "dense", dict(d=600), error=NotImplementedError, words=("320-512", "600")),
    Row("head-dim-328", "dense", dict(d=328), error=NotImplementedError, words=("steps of 16", "328")),
    Row("head-dim-0", "dense", dict(d=0), error=NotImplementedError, words=("got 0",),
        words_by={"torch": ("got 0/0",)}),  # the same family choice as head-dim-72
    Row("v-head-dim-384-with-512", "dense", dict(dv=384), error=NotImplementedError, words=("equal", "512 and 384")),
    Row("fa4-192-128-gqa-backward", "fa4", dict(hq=4, hkv=2, d=192, dv=128), bwd_error=NotImplementedError, gpu=False),
    # mismatched q/k/v
    Row("v-len-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, k, v[:, :11])), error=ValueError,
        words=("v:", "expected shape (2, 12, 1, 512)")),
    Row("k-batch-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, k[:1], v[:1])), error=ValueError,
        words=("k:", "expected batch 2")),
    Row("v-heads-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, k, ops.tile_heads(v, 2))), error=ValueError,
        words=("v:", "expected shape (2, 12, 1, 512)")),
    Row("k-head-dim-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, k[..., :384], v)), error=ValueError,
        words=("k:", "head dim D = 512", "(2, 12, 1, 384)")),
    Row("k-dtype-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, ops.cast(k, "float32"), v)),
        error=TypeError, words=("k:", "float32")),
    Row("v-dtype-mismatch", "dense", edit=_qkv(lambda q, k, v, ops: (q, k, ops.cast(v, "float32"))),
        error=TypeError, words=("v:", "float32")),
    Row("gqa-ratio-not-dividing", "dense", dict(hkv=3), error=ValueError, words=("k:", "Hkv=3 must divide Hq=4")),
    Row("zero-kv-heads", "dense", dict(hkv=0), error=ValueError, words=("k:", "Hkv=0")),
    Row("more-kv-than-q-heads", "dense", dict(hq=2, hkv=8), error=ValueError, words=("k:", "Hkv=8 must divide Hq=2")),
    # the softmax scale and the mask arguments
    Row("scale-nan", "dense", dict(scale=math.nan), error=ValueError, words=("{scale}", "nan")),
    Row("scale-zero", "dense", dict(scale=0.0), error=ValueError, words=("{scale}", "positive")),
    Row("scale-negative", "dense", dict(scale=-0.05), error=ValueError, words=("{scale}", "positive")),
    Row("scale-inf", "dense", dict(scale=math.inf), error=ValueError, words=("{scale}", "inf")),
    Row("scale-minus-inf", "dense", dict(scale=-math.inf), error=ValueError, words=("{scale}",)),
    Row("scale-string", "dense", dict(scale="0.05"), error=TypeError, words=("{scale}", "str")),
    Row("causal-string", "dense", dict(causal="no"), error=TypeError, words=("causal", "str")),
    Row("window-not-a-pair", "window", dict(window_size=63), error=TypeError, words=("window_size",)),
    # dtypes and ranks
    Row("fp32", "dense", dict(dtype="float32"), error=TypeError, words=("q:", "float16 or bfloat16", "float32")),
    Row("int32", "dense", dict(dtype="int32"), error=TypeError, words=("q:", "int32")),
    Row("q-rank-3", "dense", edit=_qkv(lambda q, k, v, ops: (q[0], k, v)), error=ValueError, words=("q:", "rank 4")),
    Row("q-rank-5", "dense", edit=_qkv(lambda q, k, v, ops: (q[None], k, v)), error=ValueError,
        words=("q:", "rank 4")),
    Row("q-not-an-array", "dense", dict(b=1, nq=1, hq=2, hkv=1), edit=_qkv(lambda q, k, v, ops: (q.tolist(), k, v)),
        error=TypeError, words=("q:", "list")),
    # sizes past the kernels' 32-bit indexing / the CUDA grid: refused before any allocation
    Row("huge-k-len-2^31", "shapes", dict(q=(1, 8, 4, 512), k=(1, BIG, 1, 512)), error=ValueError,
        words=("k:", "2147483648", "32-bit")),
    Row("huge-q-len-2^31", "shapes", dict(q=(1, BIG, 4, 512), k=(1, 8, 1, 512)), error=ValueError,
        words=("q:", "2147483648")),
    Row("huge-rows-B*N", "shapes", dict(q=(65535, 32769, 4, 512), k=(65535, 8, 1, 512)), error=ValueError,
        words=("q:", "B * N")),
    Row("huge-batch-70000", "shapes", dict(q=(70000, 1, 4, 512), k=(70000, 1, 1, 512)), error=ValueError,
        words=("q:", "batch 70000", "varlen")),
    Row("huge-heads-65536", "shapes", dict(q=(1, 1, 65536, 512), k=(1, 1, 1024, 512)), error=ValueError,
        words=("q:", "65536 heads")),
]

VARLEN_TABLE = [
    Row("varlen-ok-baseline", "varlen"),
    Row("varlen-cu-int64", "varlen", dict(cu_dtype="int64"), error=TypeError, words=("cu_seqlens_q", "int32", "int64")),
    Row("varlen-cu-k-int64", "varlen", edit=_kw(cu_seqlens_k=lambda cu, ops: ops.cast(cu, "int64")), error=TypeError,
        words=("cu_seqlens_k", "int64")),
    Row("varlen-cu-float", "varlen", dict(cu_dtype="float32"), error=TypeError, words=("cu_seqlens_q", "int32")),
    Row("varlen-cu-2d", "varlen",
        edit=_kw(cu_seqlens_q=lambda cu, ops: cu[None], cu_seqlens_k=lambda cu, ops: cu[None]),
        error=ValueError, words=("cu_seqlens_q", "[S + 1]")),
    Row("varlen-cu-length-mismatch", "varlen", edit=_kw(cu_seqlens_k=lambda cu, ops: cu[:2]), error=ValueError,
        words=("cu_seqlens_k", "(3,)")),
    Row("varlen-no-segments", "varlen", dict(cu_q=(0,), cu_k=(0,), tq=10, tk=14), error=ValueError,
        words=("cu_seqlens_q", "S >= 1")),
    Row("varlen-max-seqlen-negative", "varlen", dict(max_q=-1), error=ValueError,
        words=("max_seqlen_q", "non-negative")),
    Row("varlen-zero-tokens", "varlen", dict(cu_q=(0, 0, 0), cu_k=(0, 0, 0), max_q=0, max_k=0)),
    Row("varlen-zero-q-tokens", "varlen", dict(cu_q=(0, 0, 0), max_q=0)),
    Row("varlen-zero-k-tokens", "varlen", dict(cu_k=(0, 0, 0), max_k=0)),
    Row("varlen-document-without-keys", "varlen", dict(cu_k=(0, 0, 14), max_k=14)),
    Row("varlen-document-without-queries", "varlen", dict(cu_q=(0, 0, 10), max_q=10)),
    Row("varlen-rank-4", "varlen", edit=_qkv(lambda q, k, v, ops: (q[None], k[None], v[None])), error=ValueError,
        words=("q:", "rank 3")),
    Row("varlen-scale-nan", "varlen", dict(scale=math.nan), error=ValueError, words=("{scale}",)),
]


def cases(table, front_end: str, build: dict, edit: Callable, ops: Ops, scale: str) -> list:
    """The rows of ``table`` as battery ``case`` params of one front end: ``build[row.base](**args)`` makes
    the inputs (``scale`` is the front end's keyword for the scale), ``edit(make, fn)`` applies an edit
    ``fn(q, k, v, kw) -> ((q, k, v), kw)`` to them."""
    out = []
    for row in table:
        args = {(scale if name == "scale" else name): value for name, value in row.args.items()}
        make = build[row.base](**args)
        if row.edit is not None:
            make = edit(make, lambda q, k, v, kw, f=row.edit: f(q, k, v, kw, ops))
        words = tuple(w.replace("{scale}", scale) for w in row.words_by.get(front_end, row.words))
        out.append(case(row.id, make, row.error, *words, bwd_error=row.bwd_error, gpu=row.gpu))
    return out
