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
now (xattn's tests replace those). Each default says which hook it is where it is defined (:func:`default`),
so the facade stays imports only. The cost per call is a dict lookup and an attribute lookup; nothing is
imported.
"""

from __future__ import annotations

import sys

__all__ = ["FACADE", "HOOKS", "default", "replaced"]

FACADE = "xattn.torch.ffpa_attention"
HOOKS = ("_get_sdpa", "_get_eager", "_get_flex", "_is_block_mask", "_ffpa_low_level_ready", "_get_ffpa_high_level",
         "register_ffpa_attention")
_PUBLISHED: dict[str, object] = {}  # xattn's own function under each hook name: what the facade imports


def default(name: str):
    """Decorator: the function is xattn's own for hook ``name`` (the facade publishes it); anything else found
    under that name on the facade later is a caller's replacement."""
    if name not in HOOKS:
        raise ValueError(f"{name!r} is not one of NeMo's hooks {HOOKS}")

    def mark(fn):
        _PUBLISHED[name] = fn
        return fn
    return mark


def replaced(name: str):
    """What a caller put on the facade in place of hook ``name``, or None while the facade holds its own."""
    facade = sys.modules.get(FACADE)
    if facade is None or name not in _PUBLISHED:
        return None
    fn = getattr(facade, name, None)
    return None if fn is None or fn is _PUBLISHED[name] else fn
