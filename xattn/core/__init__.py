"""xattn.core: framework-neutral CuTeDSL attention kernels on DLPack buffers.

Imports neither torch nor jax. The destination-passing calls (``ffpa_fwd``, ``ffpa_bwd``,
``fa4_fwd``, ``fa4_bwd``) take inputs AND outputs as DLPack tensors and launch the
compiled fixed-signature launchers; see :mod:`xattn.core.api` for layouts and contracts.
"""

from .api import bwd_workspace, fa4_bwd, fa4_fwd, ffpa_bwd, ffpa_fwd
from .cache import get_launcher
from .spec import KernelSpec, supports

__all__ = [
    "ffpa_fwd", "ffpa_bwd", "fa4_fwd", "fa4_bwd", "bwd_workspace",
    "KernelSpec", "supports", "get_launcher",
]
