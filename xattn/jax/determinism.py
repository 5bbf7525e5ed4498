"""Deterministic mode for the JAX front end, the counterpart of ``torch.use_deterministic_algorithms``.

Which launchers are nondeterministic is decided once, in :mod:`xattn.core.determinism`: the FA4
backward (fp32 reduce-add of dQ over key blocks and, under GQA, of dK/dV over a group's q heads).
The forwards and the FFPA backward are bitwise reproducible.

The mode is read when an xattn function is called (for a function under ``jax.jit``: when it is
traced; a jitted function already traced keeps what it saw) and is part of the call's static
config, so a new trace under another mode never reuses a backward traced under the old one:

* ``XATTN_DETERMINISTIC=1`` (or ``true``/``on``): tracing such a backward raises ``RuntimeError``;
* ``XATTN_DETERMINISTIC=warn``: it warns (``UserWarning``) and runs;
* ``XATTN_DETERMINISTIC=0`` (or ``false``/``off``): nothing, whatever ``XLA_FLAGS`` say;
* unset: on when ``XLA_FLAGS`` asks XLA for deterministic GPU ops
  (``--xla_gpu_deterministic_ops=true`` or ``--xla_gpu_exclude_nondeterministic_ops=true``),
  which XLA cannot enforce inside a custom call; else off.
"""

from __future__ import annotations

import os
import warnings

from xattn.core.determinism import nondeterministic_op
from xattn.core.spec import KernelSpec

__all__ = ["deterministic_mode", "check_backward"]

_ON, _OFF = ("1", "true", "on", "yes", "raise"), ("0", "false", "off", "no")
_XLA_FLAGS = ("--xla_gpu_deterministic_ops", "--xla_gpu_exclude_nondeterministic_ops")


def _xla_flag_on(flags: str) -> bool:
    state = {}
    for token in flags.split():
        name, _, value = token.partition("=")
        if name in _XLA_FLAGS:  # the last spelling of a flag wins, as in XLA's parser
            state[name] = value.lower() in ("", "true", "1")
    return any(state.values())


def deterministic_mode() -> str:
    """``"raise"``, ``"warn"`` or ``"off"`` from ``XATTN_DETERMINISTIC`` / ``XLA_FLAGS`` (module docstring)."""
    value = os.environ.get("XATTN_DETERMINISTIC", "").strip().lower()
    if value in _ON:
        return "raise"
    if value == "warn":
        return "warn"
    if value in _OFF:
        return "off"
    if value:
        raise ValueError(f"XATTN_DETERMINISTIC: expected 1, warn or 0, got {os.environ['XATTN_DETERMINISTIC']!r}")
    return "raise" if _xla_flag_on(os.environ.get("XLA_FLAGS", "")) else "off"


def check_backward(spec: KernelSpec, mode: str | None = None) -> None:
    """Raise or warn (per ``mode``, default :func:`deterministic_mode`) when ``spec`` is a nondeterministic backward."""
    op = nondeterministic_op(spec)
    if op is None:
        return
    mode = deterministic_mode() if mode is None else mode
    if mode == "off":
        return
    message = (f"{op} does not have a deterministic implementation, but deterministic mode is on "
               f"(XATTN_DETERMINISTIC / XLA_FLAGS); set XATTN_DETERMINISTIC=warn to run it anyway, or use "
               f"backend='reference' for this call")
    if mode == "raise":
        raise RuntimeError(message)
    warnings.warn(message, UserWarning, stacklevel=3)
