"""Count the framework kernels (torch ops that compute) a call enqueues around xattn's launches, on the CPU with the
stand-ins: every such op is a kernel launch on the decode step's critical path on a GPU."""

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from xattn.torch import ops

# ops that move or compute data (views, allocations and metadata ops are free)
_COMPUTING = {"cat", "clone", "copy_", "fill_", "zero_", "gather", "index_select", "clamp", "clamp_", "arange",
              "floor_divide", "floor_divide_", "sub", "add", "add_", "mul", "mul_", "where", "constant_pad_nd",
              "_to_copy", "searchsorted", "minimum", "stack", "masked_fill_", "ge", "take"}


class _Kernels(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops, self.inside = [], 0  # ops of a stand-in launch are the kernel's, not the call's

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if not self.inside and (torch.Tag.pointwise in func.tags or name in _COMPUTING):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting(monkeypatch):
    """Yields the list of framework kernels enqueued inside the block (xattn's launches, stand-ins, not counted)."""
    seen = _Kernels()

    def quiet(launch):
        def run(*args, **kwargs):
            seen.inside += 1
            try:
                return launch(*args, **kwargs)
            finally:
                seen.inside -= 1
        return run
    monkeypatch.setattr(ops, "LAUNCH", {name: quiet(fn) for name, fn in ops.LAUNCH.items()})
    with seen:
        yield seen.ops
