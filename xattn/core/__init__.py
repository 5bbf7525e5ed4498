"""xattn.core: framework-neutral CuTeDSL attention kernels on DLPack buffers.

Imports neither torch nor jax. The destination-passing calls (``ffpa_fwd``, ``ffpa_bwd``,
``fa4_fwd``, ``fa4_bwd``) take inputs AND outputs as DLPack tensors and launch the
compiled fixed-signature launchers; see :mod:`xattn.core.api` for layouts and contracts.
"""

from .device import prepare_dsl_environment

prepare_dsl_environment()  # pin CUTE_DSL_ARCH=sm_90a on GPU-less machines before cutlass loads

from .api import bwd_workspace, fa4_bwd, fa4_fwd, ffpa_bwd, ffpa_fwd  # noqa: E402
from .cache import get_launcher  # noqa: E402
from .spec import KernelSpec, supports  # noqa: E402

__all__ = [
    "ffpa_fwd", "ffpa_bwd", "fa4_fwd", "fa4_bwd", "bwd_workspace",
    "KernelSpec", "supports", "get_launcher",
]
