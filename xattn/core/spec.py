"""Compile keys and the support matrix of the xattn kernel launchers.

A :class:`KernelSpec` is everything that changes the generated code of one launcher:
kernel family, pass, dtype, head dims, GQA ratio, causal, sliding window, varlen,
target arch and the versions of the libraries that produce the code. Batch, sequence
lengths and head counts are NOT part of it: launchers are compiled with symbolic
shapes, so one compile serves every size.

:func:`supports` is the single support check. Front ends route on it, warnings
quote it, tests skip on it.
"""

from __future__ import annotations

import functools
import hashlib
import numbers
from dataclasses import dataclass, field
from importlib import metadata

__all__ = ["KernelSpec", "supports", "family_for", "canonical_mask", "window_side", "library_versions", "FAMILIES",
           "DTYPES"]

FAMILIES = ("ffpa", "fa4")
DIRECTIONS = ("fwd", "bwd")
DTYPES = ("float16", "bfloat16")
ARCHES = ("sm_90a",)

FFPA_MIN_HEAD_DIM = 320
FFPA_MAX_HEAD_DIM = 512
FFPA_HEAD_DIM_MULTIPLE = 16
FFPA_FWD_TILE_M = 64  # ffpa_attn.cute._utils.SM90_FWD_TILE_M; GQA heads are packed into it
# FA4 sm90 has tuned tile configs for these (head_dim, head_dim_v) pairs.
FA4_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256))

_VERSIONED_DISTRIBUTIONS = (
    "xattn",
    "nvidia-cutlass-dsl",
    "apache-tvm-ffi",
    "ffpa-attn",
    "flash-attn-4",
    "quack-kernels",
)


@functools.cache
def library_versions() -> tuple[tuple[str, str], ...]:
    """``((distribution, version), ...)`` of everything that shapes a compiled launcher."""
    from .. import __version__

    out = [("xattn", __version__)]
    for dist in _VERSIONED_DISTRIBUTIONS[1:]:
        try:
            out.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            out.append((dist, "missing"))
    return tuple(out)


class FieldsHashed:
    """Base of the frozen dataclass compile keys (``KernelSpec`` and the split route's launchers'): the launch path
    looks a launcher up by its key on every call, so the key's hash is computed once, in ``__post_init__``. A
    subclass says ``__hash__ = FieldsHashed.cached_hash`` in its body (a dataclass's own hash would replace it)."""

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f) for f in self.__dataclass_fields__)))

    def cached_hash(self) -> int:
        return self._hash


@dataclass(frozen=True)
class KernelSpec(FieldsHashed):
    """Compile key of one fixed-signature launcher.

    Attributes:
      family: ``"ffpa"`` (head_dim 320-512) or ``"fa4"`` (head_dim <= 256).
      direction: ``"fwd"`` or ``"bwd"`` (a backward launcher runs every kernel of the pass).
      dtype: ``"float16"`` or ``"bfloat16"`` (q, k, v, out, dout, dq, dk, dv).
      head_dim: q/k head dim. head_dim_v: v/out head dim.
      qhead_per_kvhead: Hq // Hkv (1 = MHA).
      causal: bottom-right aligned causal mask (FlashAttention convention).
      varlen: packed ``[T, H, D]`` layout with ``cu_seqlens``.
      window_left / window_right: sliding window (FA4 forward only), ``None`` = unbounded.
      page_size: a paged KV cache's page size (forward; :mod:`xattn.core.paged_sm90`), ``None``: not paged.
      kv_heads_first: the pools are ``[Hkv, num_pages, page_size, D]`` (JAX Pallas' layout), not
        ``[num_pages, page_size, Hkv, D]`` (paged only).
      arch: CuTeDSL target, ``"sm_90a"``.
      versions: library versions, so a disk cache never mixes builds.
    """

    family: str
    direction: str
    dtype: str
    head_dim: int
    head_dim_v: int
    qhead_per_kvhead: int = 1
    causal: bool = False
    varlen: bool = False
    window_left: int | None = None
    window_right: int | None = None
    page_size: int | None = None
    kv_heads_first: bool = False
    arch: str = "sm_90a"
    versions: tuple[tuple[str, str], ...] = field(default_factory=library_versions)

    __hash__ = FieldsHashed.cached_hash

    @property
    def is_local(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def output_fill(self) -> dict[str, float]:
        """Outputs the caller must pre-fill before a launch, ``{name: value}`` (others: any content).

        FFPA skips fully masked tiles and empty segments: its causal/varlen forward needs
        ``out = 0, lse = -inf``, and its backward ``dq = dk = dv = 0``. FA4 writes every row of a dense
        call, but in a varlen call no row after ``cu_seqlens[-1]`` (rows the varlen contract allows: static-shape
        packing pads at the end): its varlen forward needs ``out = 0, lse = -inf`` and its varlen backward
        ``dq = dk = dv = 0`` too (found by the contract fuzz, issue #42).
        """
        if self.family != "ffpa" and not self.varlen:
            return {}
        if self.page_size is not None:  # FFPA skips an entry without keys (its split past the length)
            return {"out": 0.0, "lse": float("-inf")}
        if self.direction == "bwd":
            return {"dq": 0.0, "dk": 0.0, "dv": 0.0}
        return {"out": 0.0, "lse": float("-inf")} if self.causal or self.varlen else {}

    def short_name(self) -> str:
        """Readable, deterministic name, e.g. ``ffpa_fwd_bfloat16_d512x512_g4_causal_dense_sm_90a``."""
        parts = [self.family, self.direction, self.dtype, f"d{self.head_dim}x{self.head_dim_v}",
                 f"g{self.qhead_per_kvhead}", "causal" if self.causal else "full",
                 "varlen" if self.varlen else "dense"]
        if self.page_size is not None:
            parts.append(f"paged{self.page_size}" + ("h" if self.kv_heads_first else ""))
        if self.is_local:
            parts.append(f"w{self.window_left}_{self.window_right}")
        parts.append(self.arch)
        return "_".join(str(p) for p in parts)

    def target_name(self) -> str:
        """Deterministic, process-independent name for an XLA FFI target (includes a version hash)."""
        digest = hashlib.sha256(repr(self.versions).encode()).hexdigest()[:10]
        return f"xattn_{self.short_name()}_{digest}"


def supports(spec: KernelSpec) -> str | None:
    """Return ``None`` when ``spec`` can be compiled, else a one-line reason why not."""
    if spec.family not in FAMILIES:
        return f"unknown kernel family {spec.family!r}; expected one of {FAMILIES}"
    if spec.direction not in DIRECTIONS:
        return f"unknown direction {spec.direction!r}; expected one of {DIRECTIONS}"
    if spec.dtype not in DTYPES:
        return f"dtype {spec.dtype} is not supported; expected float16 or bfloat16"
    if spec.arch not in ARCHES:
        return f"arch {spec.arch} is not supported; xattn ships sm90 kernels ({', '.join(ARCHES)})"
    if not isinstance(spec.qhead_per_kvhead, int) or spec.qhead_per_kvhead < 1:
        return f"qhead_per_kvhead must be a positive int, got {spec.qhead_per_kvhead!r}"
    if spec.causal and spec.is_local:
        return "causal and a sliding window are mutually exclusive (causal is the window (None, 0))"
    if spec.page_size is not None:
        why = _paged_reason(spec)
        if why:
            return why
    elif spec.kv_heads_first:
        return "kv_heads_first describes a paged pool's layout: it needs page_size"
    if spec.family == "ffpa":
        return _ffpa_reason(spec)
    return _fa4_reason(spec)


PAGED_FFPA_TILE = 64  # FFPA's sm90 forward reads keys in 64-row tiles (every head dim): a page holds whole tiles


def _paged_reason(spec: KernelSpec) -> str | None:
    ps = spec.page_size
    if isinstance(ps, bool) or not isinstance(ps, int) or not 16 <= ps <= 256:
        return f"page_size must be an int in 16-256, got {ps!r}"
    if spec.direction != "fwd":
        return "a paged KV cache is read by the forward only (decoding and prefill over the pages; no gradient)"
    if spec.family == "ffpa" and ps % PAGED_FFPA_TILE:
        return (f"FFPA reads keys in {PAGED_FFPA_TILE}-row tiles, so its pages must hold whole tiles: page_size "
                f"a multiple of {PAGED_FFPA_TILE}, got {ps}")
    return None


def _ffpa_head_dims_ok(d: int, dv: int) -> bool:
    return d == dv and FFPA_MIN_HEAD_DIM <= d <= FFPA_MAX_HEAD_DIM and d % FFPA_HEAD_DIM_MULTIPLE == 0


def _ffpa_reason(spec: KernelSpec) -> str | None:
    d, dv = spec.head_dim, spec.head_dim_v
    if d != dv:
        return f"FFPA needs q/k and v head dims equal, got {d} and {dv}"
    if not _ffpa_head_dims_ok(d, dv):
        return (f"FFPA supports head_dim {FFPA_MIN_HEAD_DIM}-{FFPA_MAX_HEAD_DIM} in steps of "
                f"{FFPA_HEAD_DIM_MULTIPLE}, got {d}")
    if spec.is_local:
        return "FFPA has no sliding-window kernel on sm90; use head_dim <= 256 (FA4) for local layers"
    if FFPA_FWD_TILE_M % spec.qhead_per_kvhead:
        return (f"FFPA's sm90 forward packs the {spec.qhead_per_kvhead} q heads per kv head into its "
                f"{FFPA_FWD_TILE_M}-row tile, so the GQA ratio must divide {FFPA_FWD_TILE_M} (1, 2, 4, 8, ...)")
    return None


def _fa4_reason(spec: KernelSpec) -> str | None:
    if (spec.head_dim, spec.head_dim_v) not in FA4_HEAD_DIMS:
        pairs = ", ".join(f"{a}/{b}" for a, b in FA4_HEAD_DIMS)
        return f"FA4 on sm90 supports (head_dim, head_dim_v) in {pairs}; got {spec.head_dim}/{spec.head_dim_v}"
    if spec.direction == "bwd" and spec.qhead_per_kvhead > 1 and spec.head_dim != spec.head_dim_v:
        return (f"FA4's sm90 backward needs head_dim == head_dim_v under GQA; got "
                f"{spec.head_dim}/{spec.head_dim_v} with {spec.qhead_per_kvhead} q heads per kv head")
    for name in ("window_left", "window_right"):
        w = getattr(spec, name)
        if w is not None and (not isinstance(w, int) or w < 0):
            return f"{name} must be a non-negative int or None, got {w!r}"
    return None


def window_side(name: str, value) -> int | None:
    """One side of ``window_size`` as the launchers key it: ``None`` or an int >= 0.

    ``None`` and ``-1`` (FlashAttention-2's spelling) mean unbounded. Other negative values raise
    ``ValueError`` and non-integers ``TypeError``, naming ``window_size`` and the side: a negative
    window that silently meant "unbounded" would change results without a word.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"window_size: the {name} side must be an int or None, got {type(value).__name__} "
                        f"({value!r})")
    value = int(value)
    if value == -1:
        return None
    if value < -1:
        raise ValueError(f"window_size: the {name} side must be >= 0, or None / -1 for unbounded; got {value}")
    return value


def canonical_mask(causal: bool, window_left: int | None, window_right: int | None):
    """One spelling per mask: ``(causal, window_left, window_right)`` as the launchers key them.

    Sides: ``None`` or ``-1`` = unbounded (FlashAttention-2's convention), else an int >= 0; anything
    else raises (see :func:`window_side`). Causal is the window ``(None, 0)``: ``causal=True`` with a
    left window becomes the window ``(left, 0)``, a right window under ``causal=True`` is clipped to 0
    (causal already hides those keys), so ``causal=True`` with ``(-1, -1)`` or ``(None, w)`` stays
    causal; the window ``(None, 0)`` becomes ``causal=True``.
    """
    window_left, window_right = window_side("left", window_left), window_side("right", window_right)
    if causal:
        if window_left is None:
            return True, None, None
        return False, window_left, 0
    if window_left is None and window_right == 0:
        return True, None, None
    return False, window_left, window_right


def family_for(head_dim: int, head_dim_v: int | None = None, sliding: bool = False) -> str | None:
    """The kernel family that serves these head dims (FFPA first, FA4 for sliding windows), or None."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if not sliding and _ffpa_head_dims_ok(head_dim, dv):
        return "ffpa"
    if (head_dim, dv) in FA4_HEAD_DIMS:
        return "fa4"
    return None
