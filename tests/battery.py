"""The bad-input battery's shared pieces: one :class:`Case` per bad input, its expected outcome, and the
pytest marks that make the tally countable without a script::

    pytest --co -q -m "bad_input and not gpu"                 # bad inputs tried (CPU battery)
    pytest --co -q -m "bad_input and named_error and not gpu" # ... whose outcome is a named error

A case's outcome is EITHER a named error (``error`` + words its message must contain, the argument's
name first) OR a correct result (``error=None``: compared with the fp64 reference). Every case is
followed by a good call in the same process, checked against the reference too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest

NAMED_ERRORS = (TypeError, ValueError, NotImplementedError)


@dataclass(frozen=True)
class Case:
    """``make(device)`` builds the call's arguments; ``error`` None means: the result must be right.

    ``bwd_error``: the forward is right and the backward refuses by name (e.g. an FA4 backward
    without a kernel for the config). ``gpu``: the case also runs in the GPU battery (its kernel
    config is precompiled there, or it is refused before any compile)."""

    make: Callable[[str], Any]
    error: type[Exception] | None = None
    words: tuple[str, ...] = ()
    bwd_error: type[Exception] | None = None
    gpu: bool = True
    extra: dict = field(default_factory=dict)


def case(id: str, make, error=None, *words, bwd_error=None, gpu=True, **extra):
    """A ``pytest.param`` of the battery, marked ``bad_input`` (and ``named_error`` when refused by name)."""
    assert error is None or issubclass(error, NAMED_ERRORS), error
    marks = [pytest.mark.bad_input] + ([pytest.mark.named_error] if error is not None else [])
    return pytest.param(Case(make, error, tuple(words), bwd_error, gpu, extra), id=id, marks=marks)


def gpu_cases(params):
    """The battery's params that the GPU battery runs too (same ids, marked ``gpu``)."""
    return [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.gpu]) for p in params if p.values[0].gpu]


def unmarked(params):
    """The same cases without the tally's marks, for other tests that reuse them (counted once)."""
    return [pytest.param(*p.values, id=p.id) for p in params]


def raises(exc, *words):
    """pytest.raises that also requires every word in the message (any order)."""
    return pytest.raises(exc, match="".join(rf"(?=[\s\S]*{re.escape(w)})" for w in words))
