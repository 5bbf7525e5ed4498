"""Checked varlen inputs in xattn.torch (CPU, the core calls replaced by the reference stubs): every
violation named with its first bad index, the good case unchanged, one host read in checked mode,
the unchecked path never calling the check, env var / keyword precedence, the FA4 drop-ins and
torch.compile."""

import re

import pytest
import torch

import xattn.torch as xt
from xattn.core import varlen_check as vc
from xattn.torch import fa4, ops
from xattn.torch import varlen_check as tvc

from . import stubs

I32 = torch.int32
TQ, TK = 30, 40
GOOD_Q, GOOD_K = [0, 10, 10, 30], [0, 5, 25, 40]
MAXQ, MAXK = 20, 20


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.delenv(vc.ENV_VAR, raising=False)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(TQ, 4, 128, generator=g), torch.randn(TK, 2, 128, generator=g),
            torch.randn(TK, 2, 128, generator=g))


def _run(cu_q, cu_k, fn=xt.attention, **kw):
    q, k, v = _qkv()
    as_tensor = lambda c: c if isinstance(c, torch.Tensor) else torch.tensor(c, dtype=I32)  # noqa: E731
    return fn(q, k, v, causal=True, cu_seqlens_q=as_tensor(cu_q), cu_seqlens_k=as_tensor(cu_k),
              max_seqlen_q=kw.pop("max_seqlen_q", MAXQ), max_seqlen_k=kw.pop("max_seqlen_k", MAXK), **kw)


VIOLATIONS = [
    pytest.param(torch.tensor(GOOD_Q, dtype=torch.int64), GOOD_K, TypeError,
                 "cu_seqlens_q: expected dtype int32, got int64", id="int64"),
    pytest.param([2, 10, 10, 30], GOOD_K, ValueError, "cu_seqlens_q[0] = 2: must be 0", id="not-starting-at-0"),
    pytest.param([0, 10, 20, 17], GOOD_K, ValueError,
                 "cu_seqlens_q[3] = 17 < cu_seqlens_q[2] = 20: must be non-decreasing", id="decreasing"),
    pytest.param([0, 12, 8, 5], GOOD_K, ValueError, "cu_seqlens_q[2] = 8 < cu_seqlens_q[1] = 12",
                 id="decreasing-twice-names-the-first"),
    pytest.param([0, 10, 10, 31], GOOD_K, ValueError, "cu_seqlens_q[3] = 31 > Tq = 30", id="end-beyond-T"),
    pytest.param([0, 5, 26, 30], GOOD_K, ValueError,
                 "cu_seqlens_q[2] - cu_seqlens_q[1] = 21 > max_seqlen_q = 20: segment 1", id="segment-beyond-max"),
    pytest.param(GOOD_Q, [0, 5, 4, 40], ValueError, "cu_seqlens_k[2] = 4 < cu_seqlens_k[1] = 5", id="k-decreasing"),
    pytest.param(GOOD_Q, [0, 5, 25, 41], ValueError, "cu_seqlens_k[3] = 41 > Tk = 40", id="k-end-beyond-T"),
    pytest.param(GOOD_Q, torch.tensor([[0, 5, 25, 40]], dtype=I32), ValueError, "cu_seqlens_k: expected a 1-D",
                 id="k-2d"),
    pytest.param(GOOD_Q, [0, 40], ValueError, "cu_seqlens_k: expected shape (4,) like cu_seqlens_q", id="k-shape"),
]


@pytest.mark.parametrize("cu_q, cu_k, exc, fragment", VIOLATIONS)
def test_checked_mode_names_each_violation(cu_q, cu_k, exc, fragment):
    with pytest.raises(exc, match=re.escape(fragment)):
        _run(cu_q, cu_k, check_inputs=True)
    assert stubs.CALLS == []  # refused before any kernel call


def test_int64_is_both_type_and_value_error():
    with pytest.raises(ValueError) as info:
        _run(torch.tensor(GOOD_Q), GOOD_K, check_inputs=True)
    assert isinstance(info.value, TypeError) and isinstance(info.value, vc.CuSeqlensError)


def test_good_case_passes_and_gives_the_unchecked_result():
    checked = _run(GOOD_Q, GOOD_K, check_inputs=True)
    unchecked = _run(GOOD_Q, GOOD_K)
    assert torch.equal(checked, unchecked)
    out, lse = _run(GOOD_Q, GOOD_K, fn=xt.attention_with_lse, check_inputs=True)
    assert out.shape == (TQ, 4, 128) and lse.shape == (4, TQ)


def test_checked_mode_reads_the_host_once(monkeypatch):
    """Everything is computed on the tensors' device; a single .tolist() brings the verdict back."""
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _n=name, _r=real,
                            **k: reads.append(_n) or _r(self, *a, **k))
    cu_q, cu_k = torch.tensor(GOOD_Q, dtype=I32), torch.tensor(GOOD_K, dtype=I32)
    tvc.check_cu_seqlens(cu_q, cu_k, TQ, TK, MAXQ, MAXK)
    assert reads == ["tolist"]
    reads.clear()
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[2] = 5 < cu_seqlens_q[1] = 10")):
        tvc.check_cu_seqlens(torch.tensor([0, 10, 5, 30], dtype=I32), cu_k, TQ, TK, MAXQ, MAXK)
    assert reads == ["tolist"]


def _forbid_check(monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("check_cu_seqlens called")
    monkeypatch.setattr(ops, "check_cu_seqlens", forbidden)


def test_unchecked_path_never_calls_the_check(monkeypatch):
    _forbid_check(monkeypatch)
    _run(GOOD_Q, GOOD_K)  # env unset, keyword None
    _run(GOOD_Q, GOOD_K, check_inputs=False)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    _run(GOOD_Q, GOOD_K, check_inputs=False)  # the keyword beats the env var
    q, k, v = _qkv()
    xt.attention(q[None], k[None], v[None], causal=True)  # dense calls never check
    with pytest.raises(AssertionError, match="check_cu_seqlens called"):
        _run(GOOD_Q, GOOD_K)  # None follows the env var
    monkeypatch.setenv(vc.ENV_VAR, "0")
    _run(GOOD_Q, GOOD_K)


def test_env_var_and_keyword_precedence(monkeypatch):
    too_long = [0, 25, 25, 30]
    _run(too_long, GOOD_K)  # unchecked: a too-long segment passes silently (undefined on the GPU)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 17")):
        _run([0, 10, 20, 17], GOOD_K)
    _run(too_long, GOOD_K, check_inputs=False)
    monkeypatch.delenv(vc.ENV_VAR)
    with pytest.raises(ValueError, match="segment 0 is longer than max_seqlen_q"):
        _run(too_long, GOOD_K, check_inputs=True)
    with pytest.raises(TypeError, match="check_inputs: expected None or a bool"):
        _run(GOOD_Q, GOOD_K, check_inputs="yes")


def test_core_does_not_check_again(monkeypatch):
    """attention_op checks on the device; the core's launch entry must not add its host copies (a second
    sync): the core's host check is never reached, while the launch is."""
    import xattn.core.api as core_api

    launched = []
    fwd = ops.LAUNCH["fwd"]
    monkeypatch.setitem(ops.LAUNCH, "fwd", lambda *a, **kw: launched.append(1) or fwd(*a, **kw))

    def host_check(*a, **kw):
        raise AssertionError("the core's host check of cu_seqlens ran")
    monkeypatch.setattr(core_api, "check_host", host_check)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    _run(GOOD_Q, GOOD_K)
    assert launched == [1]


def test_backward_does_not_check_again(monkeypatch):
    q, k, v = (t.requires_grad_() for t in _qkv())
    calls = []
    real = ops.check_cu_seqlens
    monkeypatch.setattr(ops, "check_cu_seqlens", lambda *a: calls.append(1) or real(*a))
    cu_q, cu_k = torch.tensor(GOOD_Q, dtype=I32), torch.tensor(GOOD_K, dtype=I32)
    out = xt.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=MAXQ, max_seqlen_k=MAXK,
                       check_inputs=True)
    out.sum().backward()
    assert calls == [1] and q.grad is not None


def test_fa4_varlen_drop_in_follows_the_env_var(monkeypatch):
    _, varlen = fa4._load_fa4()
    q, k, v = _qkv()
    bad = torch.tensor([0, 10, 20, 17], dtype=I32)
    cu_k = torch.tensor(GOOD_K, dtype=I32)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 17 < cu_seqlens_q[2] = 20")):
        varlen(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=20, causal=True)
    out, _ = varlen(q, k, v, cu_seqlens_q=torch.tensor(GOOD_Q, dtype=I32), cu_seqlens_k=cu_k, causal=True)
    assert out.shape == (TQ, 4, 128)


def test_document_causal_builds_valid_layouts_and_skips_the_check(monkeypatch):
    _forbid_check(monkeypatch)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    q = torch.randn(1, 4, 8, 128)
    kv = torch.randn(1, 2, 8, 128)
    ids = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
    out = fa4.document_causal_fa4_attention(q, kv, kv, ids, ids, 0, 0.1)
    assert out.shape == (1, 4, 8, 128)


def test_torch_compile_unchecked_fullgraph_and_checked_with_graph_break():
    q, k, v = (t.requires_grad_() for t in _qkv())
    cu_k = torch.tensor(GOOD_K, dtype=I32)

    def step(q, k, v, cu_q, check_inputs=None):
        return xt.attention(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=MAXQ,
                            max_seqlen_k=MAXK, check_inputs=check_inputs).square().mean()

    good = torch.tensor(GOOD_Q, dtype=I32)
    torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, good).backward()  # default: no graph break
    checked = torch.compile(step, backend="aot_eager")
    checked(q, k, v, good, True)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[2] - cu_seqlens_q[1] = 21 > max_seqlen_q = 20")):
        checked(q, k, v, torch.tensor([0, 5, 26, 30], dtype=I32), True)
