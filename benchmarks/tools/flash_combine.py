"""FlashAttention's combine kernel (``flash_attn.cute.flash_fwd_combine.FlashAttentionForwardCombine``) as an xattn
combine launcher: the one xattn shipped until session 26, kept for ``decode_tile_probe.py`` to compare the shipped
one-pass combine (:mod:`xattn.core.combine_sm90`) against. Compile-time only here; never in the disk cache."""

import contextlib

from xattn.core.symbolic import CUTE_DTYPES, compile_launcher  # noqa: E402  (pins the DSL arch first)

import cutlass.cute as cute  # noqa: E402
from cutlass import Float32  # noqa: E402
from flash_attn.cute.flash_fwd_combine import FlashAttentionForwardCombine  # noqa: E402
from quack.compile_utils import make_fake_tensor  # noqa: E402

from xattn.core.split_kv import LOG_MAX_PARTIALS  # noqa: E402


class _Combine:
    def __init__(self, kernel):
        self.kernel = kernel

    @cute.jit
    def __call__(self, mO_partial: cute.Tensor, mLSE_partial: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 unused: Float32, stream):
        self.kernel(mO_partial, mLSE_partial, mO, mLSE, None, None, None, None, None, stream)


@contextlib.contextmanager
def _launches_with_pdl():
    """Every CuTeDSL launch traced in the block gets ``use_pdl=True`` (FlashAttention's combine hard-codes its
    launch options but this one)."""
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


def compile_flash_combine(spec, pdl: bool, threads: int, stages: int):
    """FlashAttention's ``FlashAttentionForwardCombine`` compiled for ``spec`` with the combine launcher's signature
    (:mod:`xattn.core.combine_sm90`), ``threads`` per CTA and ``stages`` partial tiles in flight: the combine xattn
    shipped until session 26, kept here to compare against."""
    dtype, dv = CUTE_DTYPES[spec.dtype], spec.head_dim_v
    k_block = 64 if dv <= 64 else 128  # 16-bit partials: 16 bytes a thread cover threads * 8 / k_block rows
    kernel = FlashAttentionForwardCombine(dtype, dtype, dv, 1, tile_m=threads * (128 // dtype.width) // k_block,
                                          k_block_size=k_block, log_max_splits=LOG_MAX_PARTIALS, num_threads=threads,
                                          stages=stages)
    sym, div = cute.sym_int, 128 // dtype.width
    p, b, n, h = sym(), sym(), sym(), sym()
    tensors = (make_fake_tensor(dtype, (p, b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (p, b, n, h), divisibility=1, leading_dim=2),
               make_fake_tensor(dtype, (b, n, h, dv), divisibility=div),
               make_fake_tensor(Float32, (b, n, h), divisibility=1, leading_dim=1))
    with _launches_with_pdl() if pdl else contextlib.nullcontext():
        return compile_launcher(_Combine(kernel), tensors)
