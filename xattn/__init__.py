"""xattn: Hopper attention for PyTorch and JAX (FFPA head_dim 320-512, FA4 head_dim <= 256).

``xattn.core`` is the framework-neutral kernel layer on DLPack buffers; front ends
(``xattn.torch``, ``xattn.jax``) wrap it. ``python -m xattn info`` says what runs here.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
