"""Symbolic (shape-free) compile arguments shared by every launcher family.

Fake CuTe tensors are built with ``quack.compile_utils.make_fake_tensor``: batch,
sequence and head dims are ``cute.sym_int()`` shared between tensors (so the generated
TVM-FFI wrapper checks that, e.g., q and out agree on B and N), head dims are static,
strides are symbolic with 16-byte divisibility and a unit innermost stride.
"""

from __future__ import annotations

import time

from .device import prepare_dsl_environment

prepare_dsl_environment()  # before cutlass reads its environment (CPU-only machines: sm_90a)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from quack.compile_utils import make_fake_stream, make_fake_tensor  # noqa: E402

from .spec import KernelSpec  # noqa: E402

__all__ = ["CUTE_DTYPES", "Dims", "compile_launcher", "check_dsl_arch"]

CUTE_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}
_F32_ROW_DIV = 4  # workspace rows are padded to the tile: 16-byte aligned rows


class Dims:
    """Fake tensors of one problem family, sharing symbolic dims across all arguments."""

    def __init__(self, spec: KernelSpec):
        self.spec = spec
        self.dtype = CUTE_DTYPES[spec.dtype]
        self.div = 128 // self.dtype.width
        sym = cute.sym_int
        self.b, self.hq, self.hkv = sym(), sym(), sym()
        self.nq, self.nk = sym(), sym()  # dense: per-sequence lengths; varlen: total tokens
        self.b1 = sym()  # varlen: B + 1

    def _lead(self, n):
        return (n,) if self.spec.varlen else (self.b, n)

    def _half(self, n, h, d):
        return make_fake_tensor(self.dtype, (*self._lead(n), h, d), divisibility=self.div)

    def like_q(self):
        return self._half(self.nq, self.hq, self.spec.head_dim)

    def like_k(self):
        return self._half(self.nk, self.hkv, self.spec.head_dim)

    def like_v(self):
        return self._half(self.nk, self.hkv, self.spec.head_dim_v)

    def like_out(self):
        return self._half(self.nq, self.hq, self.spec.head_dim_v)

    def qkv(self):
        return self.like_q(), self.like_k(), self.like_v()

    def lse(self):
        shape = (self.hq, self.nq) if self.spec.varlen else (self.b, self.hq, self.nq)
        return make_fake_tensor(Float32, shape, divisibility=1)

    def out_lse(self):
        return self.like_out(), self.lse()

    def scratch(self, heads: str):
        """fp32 workspace ``[B, H, rows]`` (dense) or ``[H, rows]`` (varlen), rows padded to a tile."""
        h = self.hq if heads == "q" else self.hkv
        shape = (h, cute.sym_int()) if self.spec.varlen else (self.b, h, cute.sym_int())
        return make_fake_tensor(Float32, shape, divisibility=_F32_ROW_DIV)

    def cu_seqlens(self):
        return tuple(make_fake_tensor(Int32, (self.b1,), divisibility=1) for _ in range(2))


def check_dsl_arch(expected: str) -> None:
    """Refuse to compile when CuTeDSL was initialised for another arch than the launcher's."""
    from cutlass.base_dsl.dsl import BaseDSL

    actual = str(BaseDSL._get_dsl().get_arch_enum())
    if actual != expected:
        raise NotImplementedError(
            f"CuTeDSL targets {actual} in this process, xattn launchers need {expected}: set "
            f"CUTE_DSL_ARCH={expected} (or import xattn before cutlass) and restart")


def compile_launcher(launcher, tensors, scalars=(Float32(1.0),), log=None):
    """``cute.compile`` a fixed-signature launcher into a TVM-FFI function.

    ``tensors`` are fake tensors in launcher order, ``scalars`` example runtime scalars;
    the stream is the TVM-FFI environment stream (torch: current stream; XLA: its stream).
    """
    t0 = time.perf_counter()
    fn = cute.compile(launcher, *tensors, *scalars, make_fake_stream(), options="--enable-tvm-ffi")
    if log is not None:
        log(time.perf_counter() - t0)
    return fn
