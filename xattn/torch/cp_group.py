"""Which process group Hugging Face's ``"ffpa"`` layers shard the sequence over (context parallelism).

Hand-over, either way:

* ``with xattn.torch.context_parallel(group): model(...)`` -- CP for the block;
* ``xattn.torch.set_context_parallel_group(group)`` then the seed's
  ``setup_ffpa_backend(cp_size=group size, has_packed_sequence=False)`` -- CP until
  ``setup_ffpa_backend(1, ...)``. Without a handed-over group, ``setup_ffpa_backend`` takes the
  default (world) group when its size is ``cp_size``.

While a group is active every ``"ffpa"`` layer receives this rank's shard in the layout of
:func:`xattn.torch.ring.shard_sequence` (``input_ids``, ``position_ids`` from
:func:`~xattn.torch.ring.sequence_positions`, labels): global layers run :func:`~xattn.torch.ring.ring_attention`,
sliding layers its halo exchange. Anything that cannot run sharded raises: there is no exact fallback
on a shard.
"""

from __future__ import annotations

import contextlib

__all__ = ["context_parallel", "set_context_parallel_group", "active_group", "activate"]

_HANDED_OVER = None  # from set_context_parallel_group
_ACTIVE = None  # the group "ffpa" layers use now, or None (no CP)


def set_context_parallel_group(group) -> None:
    """Hand over the context-parallel process group for a later ``setup_ffpa_backend(cp_size > 1, ...)``."""
    global _HANDED_OVER
    _HANDED_OVER = group


def active_group():
    """The active context-parallel group, or None."""
    return _ACTIVE


def activate(cp_size: int):
    """Turn CP on for ``cp_size`` ranks (the handed-over group, else the world group) or off (``cp_size == 1``).
    Returns the group. Raises ValueError when no group of that size is available."""
    global _ACTIVE
    if cp_size == 1:
        _ACTIVE = None
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"cp_size={cp_size}: torch.distributed is not initialised; init_process_group first, then "
                         "hand over the group with xattn.torch.set_context_parallel_group(group)")
    group = _HANDED_OVER if _HANDED_OVER is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size != cp_size:
        raise ValueError(f"cp_size={cp_size}: the context-parallel group has {size} ranks; hand over a group of "
                         f"{cp_size} with xattn.torch.set_context_parallel_group(group)")
    _ACTIVE = group
    return group


@contextlib.contextmanager
def context_parallel(group=None):
    """Run ``"ffpa"`` layers context-parallel over ``group`` (default: the world group) inside the block."""
    global _ACTIVE
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context_parallel: torch.distributed is not initialised; init_process_group first")
    previous, _ACTIVE = _ACTIVE, group if group is not None else dist.group.WORLD
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = previous
