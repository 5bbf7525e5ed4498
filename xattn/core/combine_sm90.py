"""The combine launcher of the split-KV route: FlashAttention's ``FlashAttentionForwardCombine``
(``flash_attn.cute.flash_fwd_combine``) compiled once per :class:`~xattn.core.split_kv.CombineSpec` with
symbolic sizes and strides.

Launcher signature (glossary of :mod:`xattn.core.split_kv`; tensors are strided views)::

  out_partial [P, B, Nq, Hq, Dv] (dtype), lse_partial [P, B, Nq, Hq] f32 (Nq stride 1),
  out [B, Nq, Hq, Dv] (dtype), lse [B, Nq, Hq] f32 (Nq stride 1)

Every element of out and lse is written; P <= :data:`~xattn.core.split_kv.MAX_PARTIALS`.

With ``pdl`` the kernel is launched with programmatic dependent launch: it may start while the kernel before it
in the stream (the split launch) drains, and waits on ``griddepcontrol`` before it reads the partials (the
kernel's own first step); FlashAttention launches it without.
"""

from __future__ import annotations

import contextlib

from .symbolic import CUTE_DTYPES, compile_launcher  # noqa: F401  (pins the DSL arch first)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from flash_attn.cute.flash_fwd_combine import FlashAttentionForwardCombine  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from .split_kv import LOG_MAX_PARTIALS, CombineSpec  # noqa: E402

__all__ = ["compile_combine"]

_THREADS = 256  # the combine kernel's thread count
_STAGES = 4  # partial O tiles in flight per CTA (FlashAttention's default)


class _Combine:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 unused: Float32, stream):
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, None, None, None, None, None, stream)


PDL = False  # launch the combine with programmatic dependent launch (module docstring)


@contextlib.contextmanager
def launches_with_pdl():
    """Every CuTeDSL kernel launch traced inside the block gets ``use_pdl=True`` (FlashAttention's combine
    hard-codes its launch options; this sets the one it leaves out). The patch is process-wide while the block
    runs: a compile on another thread at the same time would get PDL too, so use it only where PDL is meant for
    everything compiled meanwhile (off by default: :data:`PDL`)."""
    from cutlass.cutlass_dsl import cutlass as dsl

    launch = dsl.KernelLauncher.launch

    def with_pdl(self, *args, **kwargs):
        kwargs.setdefault("use_pdl", True)
        return launch(self, *args, **kwargs)

    dsl.KernelLauncher.launch = with_pdl
    try:
        yield
    finally:
        dsl.KernelLauncher.launch = launch


def compile_combine(spec: CombineSpec, pdl: bool | None = None, threads: int = _THREADS, stages: int = _STAGES):
    """Compile the combine launcher of ``spec`` (``pdl``: launch with programmatic dependent launch; default
    :data:`PDL`; ``threads`` per CTA, ``stages`` partial tiles in flight: the shipped values unless a probe
    names others); returns the compiled TVM-FFI function. Its trailing scalar is unused (every xattn launcher
    ends with one float: the launch path passes the softmax scale)."""
    dtype = CUTE_DTYPES[spec.dtype]
    dv = spec.head_dim_v
    # FlashAttention's head-dim block (64 for Dv <= 64, else 128). The row tile must match the copy's thread
    # layout: 256 threads, each loading 16 bytes, cover 256 * (16 B / element) / k_block rows. FlashAttention's
    # own 8/16 rows are right for its fp32 partials only; xattn's partials are 16-bit (the kernels' out dtype).
    k_block = 64 if dv <= 64 else 128
    tile_m = threads * (128 // dtype.width) // k_block
    if not FlashAttentionForwardCombine.can_implement(dtype, dtype, dv, tile_m, k_block, LOG_MAX_PARTIALS, threads):
        raise NotImplementedError(f"the combine kernel cannot run {spec.short_name()}")
    # num_head only sizes the varlen scheduler's packing; the batched layout used here does not read it
    kernel = FlashAttentionForwardCombine(dtype, dtype, dv, 1, tile_m=tile_m, k_block_size=k_block,
                                          log_max_splits=LOG_MAX_PARTIALS, num_threads=threads, stages=stages)
    sym = cute.sym_int
    p, b, n, h = sym(), sym(), sym(), sym()
    div = 128 // dtype.width
    tensors = (make_fake_tensor(dtype, (p, b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (p, b, n, h), divisibility=1, leading_dim=2),
               make_fake_tensor(dtype, (b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (b, n, h), divisibility=1, leading_dim=1))
    with launches_with_pdl() if (PDL if pdl is None else pdl) else contextlib.nullcontext():
        return compile_launcher(_Combine(kernel), tensors)
