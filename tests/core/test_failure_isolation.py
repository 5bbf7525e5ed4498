"""Failure isolation in the core (#12 item 3): after a refused call, a failed compile, or a failed launch,
the next good call in the same process gives the right answer, and the failed key is retried.

CPU: the real core over the fp64 stand-in launcher (``checked_core.py``); compiles go through
``xattn.core.cache`` with a compiler that fails when told to."""

from __future__ import annotations

import threading

import pytest
import torch

import xattn.core as xc
from xattn.core import cache, checks

from tests.battery import unmarked

from . import checked_core
from .test_bad_inputs import FWD, _fa4, _fwd, call, good_call, run

BF16 = torch.bfloat16


class FlakyCompiler:
    """The stand-in compiler, failing for the specs in ``fail`` (as many times as listed)."""

    def __init__(self):
        self.fail: list = []
        self.compiled: list = []

    def __call__(self, spec):
        self.compiled.append(spec)
        if spec in self.fail:
            self.fail.remove(spec)
            raise RuntimeError(f"compile failed (test): {spec.short_name()}")
        return checked_core.launcher(spec)


@pytest.fixture
def compiler(monkeypatch):
    flaky = FlakyCompiler()
    checked_core.install(monkeypatch, compiler=flaky)
    return flaky


def _spec(make, direction="fwd"):
    fn, bufs, kw = make("cpu")
    return checks.quick_check(fn[:-4], direction, bufs, kw.get("causal", False), None, None, None, None,
                              kw.get("window_size", (None, None)))[0]


def test_refused_calls_leave_the_hot_path_memo_clean(compiler):
    """A call refused after quick_check accepted its q/k/v (the C side refuses out) is memoised under
    q/k/v's metadata; the next good call with the same q/k/v must run right, not inherit anything."""
    fn, bufs, kw = _fwd(b=1, nq=16, nk=20)("cpu")
    for bad in (dict(out=bufs["out"].half()), dict(lse=bufs["lse"][..., :3]), dict(out=bufs["out"][..., ::2])):
        with pytest.raises((TypeError, ValueError)):
            call(fn, {**bufs, **bad}, kw)
    good_call()
    assert len(compiler.compiled) == 1  # one launcher for all of it: refusals compile nothing new


@pytest.mark.parametrize("c", unmarked([p for p in FWD if p.values[0].error is not None][:12]))
def test_refused_call_then_good_call(c, compiler):
    run(c, "cpu", checked_core.LAUNCHES)
    good_call()


def test_failed_compile_is_retried_and_isolated(compiler):
    """The failing key raises the compiler's error, leaves no entry (nor a held lock) behind and compiles
    again on the next call; a key compiled before keeps its launcher; other keys are unaffected."""
    other = _spec(_fa4())
    fn, bufs, kw = _fa4()("cpu")
    call(fn, bufs, kw)  # compile and cache the FA4 key
    before = cache._entries[other]

    spec = _spec(_fwd(b=1, nq=16, nk=20))
    compiler.fail.append(spec)
    with pytest.raises(RuntimeError, match="compile failed"):
        good_call()
    assert spec not in cache._entries and spec not in cache.cached_specs()
    assert not cache._key_locks[spec].locked()
    good_call()  # compiles again, right
    assert compiler.compiled.count(spec) == 2
    assert cache._entries[other] is before and compiler.compiled.count(other) == 1
    call(fn, bufs, kw)  # the other key: still its launcher, still right
    assert compiler.compiled.count(other) == 1


def test_failed_compile_under_racing_threads(compiler):
    """Threads racing for a key whose compile fails once: each gets the error or a right result, and
    the key ends compiled exactly once more."""
    spec = _spec(_fwd(b=1, nq=16, nk=20))
    compiler.fail.append(spec)
    errors, results = [], []

    def worker():
        try:
            good_call()
            results.append(True)
        except RuntimeError as exc:
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and len(results) == 3
    assert compiler.compiled.count(spec) == 2 and spec in cache._entries
    good_call()


@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: out of memory (test)"), MemoryError("test")],
                         ids=["runtime-error", "memory-error"])
def test_failed_launch_is_reported_as_is_and_the_next_call_is_right(compiler, monkeypatch, exc):
    """A launcher that fails (out of memory, a driver error) raises its own error: the core does not
    turn it into a misleading named error; the cached launcher keeps working."""
    good_call()
    spec = _spec(_fwd(b=1, nq=16, nk=20))
    launcher = cache._entries[spec]
    calls = []

    def failing_once(*args):
        if not calls:
            calls.append(1)
            raise exc
        return launcher.function(*args)
    monkeypatch.setitem(cache._entries, spec, cache.Launcher(spec, failing_once, None, 0.0, "compiled"))
    with pytest.raises(type(exc), match="test"):
        good_call()
    good_call()


def test_c_side_refusal_with_valid_python_checks_reraises_the_original(compiler, monkeypatch):
    """If the launcher refuses what every Python check accepts, the core re-raises the launcher's own
    ValueError (it never swallows it), and the process keeps working."""
    good_call()
    spec = _spec(_fwd(b=1, nq=16, nk=20))
    launcher = cache._entries[spec]
    state = []

    def refusing_once(*args):
        if not state:
            state.append(1)
            raise ValueError("Mismatched argument #3 (test)")
        return launcher.function(*args)
    monkeypatch.setitem(cache._entries, spec, cache.Launcher(spec, refusing_once, None, 0.0, "compiled"))
    with pytest.raises(ValueError, match="Mismatched argument #3"):
        good_call()
    good_call()


def test_refused_backward_workspace_then_good_backward(compiler):
    from .test_bad_inputs import BWD

    for p in BWD:
        if p.values[0].error is not None:
            run(p.values[0], "cpu")
    run(BWD[0].values[0], "cpu")  # the baseline backward, checked against the reference
    assert xc.bwd_workspace("ffpa", (1, 16, 4, 512), (1, 20, 1, 512))  # the core's own helpers unaffected
