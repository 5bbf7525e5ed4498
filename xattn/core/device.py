"""What GPU this process sees, through the CUDA driver (cuda-bindings), without torch or jax.

Also sets the CuTeDSL target before cutlass is first used: on a machine without a GPU,
CuTeDSL silently targets sm_100a unless ``CUTE_DSL_ARCH`` says otherwise, so xattn
pins ``sm_90a`` there (the only arch it ships kernels for), which lets a CPU-only
machine (CI, a login node) compile the sm90 launchers.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = ["GpuInfo", "cuda_gpus", "no_gpu_reason", "target_arch", "prepare_dsl_environment"]

SM90_NUM_SMS = 132  # H100/H200 SXM; only used when compiling without a GPU


@dataclass(frozen=True)
class GpuInfo:
    """One CUDA device as the driver reports it (index, name, compute capability, SM count)."""

    index: int
    name: str
    capability: tuple[int, int]
    num_sms: int

    @property
    def arch(self) -> str:
        major, minor = self.capability
        return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


@functools.cache
def _probe() -> tuple[tuple[GpuInfo, ...], str | None]:
    try:
        from cuda.bindings import driver as cu
    except Exception as exc:  # pragma: no cover - cuda-bindings ships with cutlass-dsl
        return (), f"cuda-bindings is not importable ({exc})"
    try:
        (err,) = cu.cuInit(0)
    except Exception as exc:
        return (), f"no NVIDIA driver found (libcuda not loadable: {type(exc).__name__})"
    if err != cu.CUresult.CUDA_SUCCESS:
        return (), f"the CUDA driver failed to initialise ({err.name})"
    err, count = cu.cuDeviceGetCount()
    if err != cu.CUresult.CUDA_SUCCESS or count == 0:
        return (), "the CUDA driver reports no GPU"
    attr = cu.CUdevice_attribute
    gpus = []
    for i in range(count):
        _, dev = cu.cuDeviceGet(i)
        _, raw = cu.cuDeviceGetName(128, dev)
        _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        _, sms = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)
        name = raw.split(b"\0", 1)[0].decode(errors="replace")
        gpus.append(GpuInfo(i, name, (major, minor), sms))
    return tuple(gpus), None


def cuda_gpus() -> tuple[GpuInfo, ...]:
    """The GPUs the CUDA driver reports (empty on a machine without one)."""
    return _probe()[0]


def no_gpu_reason() -> str | None:
    """``None`` when a GPU is visible, else why not, in words."""
    return _probe()[1]


def target_arch() -> str:
    """The arch CuTeDSL compiles for in this process: ``CUTE_DSL_ARCH`` if set, else GPU 0's."""
    env = os.environ.get("CUTE_DSL_ARCH")
    if env:
        return env
    gpus = cuda_gpus()
    return gpus[0].arch if gpus else "sm_90a"


def prepare_dsl_environment() -> str:
    """Pin the CuTeDSL / flash_attn target when there is no GPU; return the target arch.

    Must run before cutlass reads its environment (xattn calls it before importing
    any kernel module). With a GPU present nothing is changed: the DSL detects it.
    """
    if not cuda_gpus():
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        os.environ.setdefault("FLASH_ATTENTION_ARCH", os.environ["CUTE_DSL_ARCH"])
        os.environ.setdefault("FLASH_ATTENTION_NUM_SMS", str(SM90_NUM_SMS))
    return target_arch()
