"""Which launchers give the same bits run to run: the one decision both front ends alert on.

Read from the sm90 kernel sources that xattn compiles (``ffpa-attn`` 0.2.4, ``flash-attn-4``
4.0.0b36); ``tests/core/test_determinism.py`` re-reads them so an upgrade cannot drift silently.

* **Forward, both families: deterministic.** Every CTA owns one output tile (query block x head x
  batch), runs its key loop in a fixed order and writes out/lse with plain stores; there is no
  split-KV combine and no atomic.
* **FFPA backward: deterministic, for every config (GQA and varlen included).** The dK/dV kernel
  (``_dkdv_d512_sm90.py``, ``_dkdv_d384_sm90.py``; the generic one subclasses the d512 one) gives
  each CTA one (key block, kv head, batch) tile and loops over the q heads of its GQA group and the
  query blocks in order, accumulating in registers; dK/dV leave with a plain TMA store
  (``CopyBulkTensorTileS2GOp``). The dQ kernel (``_dq_*_sm90.py``) owns (query block, q head,
  batch) and loops over the key blocks the same way. No reduce-add, no atomic.
* **FA4 backward: not deterministic, for every config.** ``flash_bwd_sm90.py`` gives each CTA one
  (key block, q head, batch) tile; ``dQaccum_store`` adds the CTA's dQ partial to the fp32
  ``dq_accum`` with ``cp.reduce.async.bulk .add.f32`` (``cpasync_reduce_bulk_add_f32``), so every
  query block collects one partial per key block in scheduling order (MHA too). Under GQA the
  dK/dV partials of the group's q heads are reduce-added into ``dk_accum``/``dv_accum`` the same
  way. fp32 addition is not associative, so the low bits depend on the order. The kernel has a
  ``deterministic=True`` mode on sm90 (semaphores ``dQ/dK/dV_semaphore`` that serialise the adds,
  as ``flash_attn.cute.interface`` wires it), but xattn's launchers (``fa4_sm90.py``) compile
  ``deterministic=False`` and carry no semaphore buffers.
"""

from __future__ import annotations

import functools

from .spec import KernelSpec

__all__ = ["nondeterministic_op"]


@functools.lru_cache(maxsize=256)
def nondeterministic_op(spec: KernelSpec) -> str | None:
    """``None`` when ``spec``'s launcher gives bitwise identical results run to run on the same
    inputs, else the op name an alert should quote (why, in words)."""
    if spec.direction != "bwd" or spec.family != "fa4":
        return None
    what = "dQ over key blocks" + (", dK/dV over the GQA group" if spec.qhead_per_kvhead > 1 else "")
    return f"xattn backward (FA4 sm90 {spec.short_name()}: fp32 reduce-add of {what})"
