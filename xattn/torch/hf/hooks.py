"""NeMo's hooks: the functions of :mod:`xattn.torch.ffpa_attention` its routing looks up when a call runs.

NeMo's module routes every call through its own module-level functions, and NeMo's tests (and its users')
replace them there, ``monkeypatch.setattr(ffpa_attention, "_get_sdpa", fake)`` or ``mock.patch.object``:

* ``_get_sdpa()`` / ``_get_eager()`` / ``_get_flex()``: the fallback functions (None where missing);
* ``_is_block_mask(mask)``: whether a layer runs on FlexAttention;
* ``_ffpa_low_level_ready()``: whether the kernels can run;
* ``_get_ffpa_high_level()``: ``(fn, backend)``, NeMo's dense path (``fn`` has SDPA's signature);
* ``register_ffpa_attention()``: what ``setup_ffpa_backend`` calls.

xattn's routing asks :func:`replaced` for each one when it needs it, so a replacement on the facade takes
effect on the next call. Without one the implementation module's own function runs, as that module holds it
now (xattn's tests replace those). The cost per call is a dict lookup and an attribute lookup; nothing is
imported.
"""

from __future__ import annotations

import sys

__all__ = ["FACADE", "HOOKS", "remember", "replaced"]

FACADE = "xattn.torch.ffpa_attention"
HOOKS = ("_get_sdpa", "_get_eager", "_get_flex", "_is_block_mask", "_ffpa_low_level_ready", "_get_ffpa_high_level",
         "register_ffpa_attention")
_PUBLISHED: dict[str, object] = {}  # what the facade published under each hook name, when it was imported


def remember(namespace: dict) -> None:
    """Record the facade's own hooks (its globals at import): anything else found there later is a replacement."""
    _PUBLISHED.update({name: namespace[name] for name in HOOKS})


def replaced(name: str):
    """What a caller put on the facade in place of hook ``name``, or None while the facade holds its own."""
    facade = sys.modules.get(FACADE)
    if facade is None or name not in _PUBLISHED:
        return None
    fn = getattr(facade, name, None)
    return None if fn is None or fn is _PUBLISHED[name] else fn
