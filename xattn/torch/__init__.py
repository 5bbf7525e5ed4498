"""xattn.torch: the xattn kernels for PyTorch (custom ops ``torch.ops.xattn.fwd/bwd`` + autograd).

Hugging Face registration and the FA4 helpers are issue #3's next steps.
"""

from .attention import attention, attention_with_lse

__all__ = ["attention", "attention_with_lse"]
