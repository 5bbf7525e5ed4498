"""Failure isolation in xattn.torch (#12 item 3): after a refused call, a failed compile, or an out-of-memory
while allocating outputs or workspace, the next good call in the same process gives the right answer.

CPU: the real core over the fp64 stand-in launchers (``tests/core/checked_core.py``); a compile fails
through a flaky compiler behind ``xattn.core.cache``; an allocation fails through a ``torch`` whose
``empty``/``full`` raise ``torch.OutOfMemoryError`` once, as seen from ``xattn.torch.ops`` only."""

from __future__ import annotations

import pytest
import torch

import xattn.torch as xt
from tests.battery import unmarked
from tests.core import checked_core
from tests.core.test_failure_isolation import FlakyCompiler
from xattn.core import cache
from xattn.torch import ops

from .test_bad_inputs import DENSE, VARLEN, _dense, _fa4, _varlen, check_result, good_call, run


@pytest.fixture
def compiler(monkeypatch):
    flaky = FlakyCompiler()
    checked_core.install(monkeypatch, compiler=flaky)
    return flaky


class _TorchFailingAlloc:
    """``torch`` as ``xattn.torch.ops`` sees it, with its ``fail_at``-th ``empty``/``full`` raising OOM."""

    def __init__(self, fail_at: int):
        self.fail_at, self.count = fail_at, 0

    def _alloc(self, fn):
        def alloc(*args, **kwargs):
            self.count += 1
            if self.count == self.fail_at:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 200.00 GiB (test)")
            return fn(*args, **kwargs)
        return alloc

    def __getattr__(self, name):
        attr = getattr(torch, name)
        return self._alloc(attr) if name in ("empty", "full") else attr


def _count_allocs(monkeypatch, fn):
    counter = _TorchFailingAlloc(0)
    monkeypatch.setattr(ops, "torch", counter)
    fn()
    monkeypatch.setattr(ops, "torch", torch)
    return counter.count


def _train_step(make, device="cpu"):
    (q, k, v), kw = make(device)
    check_result(xt.attention_with_lse, (q, k, v), kw)


CONFIGS = {"ffpa-dense": _dense(b=1, nq=16, nk=20), "ffpa-causal": _dense(b=1, nq=16, nk=20, causal=True),
           "fa4-gqa-causal": _fa4(b=1, nq=16, nk=20), "fa4-varlen": _varlen()}


@pytest.mark.parametrize("config", CONFIGS)
def test_out_of_memory_in_any_allocation_then_the_next_call_is_right(config, compiler, monkeypatch):
    """Every output and workspace allocation of a training step (forward: out, lse; backward: dq, dk,
    dv and the workspace) fails once in turn: the step raises torch.OutOfMemoryError (nothing else), and
    the next step is right."""
    make = CONFIGS[config]
    n = _count_allocs(monkeypatch, lambda: _train_step(make))
    assert n >= 5  # out, lse, dq, dk, dv (+ workspace)
    for i in range(1, n + 1):
        monkeypatch.setattr(ops, "torch", _TorchFailingAlloc(i))
        with pytest.raises(torch.OutOfMemoryError, match="test"):
            _train_step(make)
        monkeypatch.setattr(ops, "torch", torch)
        _train_step(make)
    good_call()


def test_failed_compile_then_retry_forward_and_backward(compiler):
    """A compile failure of the forward key, then of the backward key: each raises the compiler's error,
    the next step compiles again and is right; keys compiled before are not compiled again."""
    good_call()
    compiled = len(compiler.compiled)
    (q, k, v), kw = _fa4(b=1, nq=16, nk=20)("cpu")
    step = lambda: check_result(xt.attention_with_lse, (q, k, v), kw)  # noqa: E731
    from xattn.torch.ops import _checked

    fwd_spec = _checked("fwd", "fa4", q, k, v, True, -1, -1)[0]
    bwd_spec = _checked("bwd", "fa4", q, k, v, True, -1, -1)[0]
    compiler.fail.append(fwd_spec)
    with pytest.raises(RuntimeError, match="compile failed"):
        step()
    assert fwd_spec not in cache._entries
    compiler.fail.append(bwd_spec)
    with pytest.raises(RuntimeError, match="compile failed"):
        step()  # the forward compiled and ran; the backward's compile failed
    assert fwd_spec in cache._entries and bwd_spec not in cache._entries
    step()
    assert compiler.compiled.count(fwd_spec) == 2 and compiler.compiled.count(bwd_spec) == 2
    good_call()
    assert len(compiler.compiled) == compiled + 4  # the good call's keys were not compiled again


@pytest.mark.parametrize("c", unmarked([p for p in DENSE + VARLEN if p.values[0].error is not None][::4]))
def test_refused_call_then_good_training_step(c, compiler):
    run(c, xt.attention_with_lse, "cpu")
    for make in CONFIGS.values():
        _train_step(make)


def test_refused_backward_then_good_training_step(compiler):
    """A forward that runs and a backward that has no kernel (FA4 192/128 under GQA): the backward's
    NotImplementedError leaves the process able to train."""
    (q, k, v), kw = _dense(d=192, dv=128, causal=True)("cpu")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = xt.attention(q, k, v, **kw)
    with pytest.raises(NotImplementedError, match="head_dim == head_dim_v under GQA"):
        out.sum().backward()
    for make in CONFIGS.values():
        _train_step(make)
