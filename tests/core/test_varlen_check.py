"""Checked varlen inputs in the core (CPU): the cu_seqlens rules and their messages, the vectorised
summary against the pure-Python one, the DLPack host copy on several producers, the env var /
keyword precedence, and the core entry points (launch stubbed) checking only in checked mode."""

import random
import re

import numpy as np
import pytest
import torch

import xattn.core as xc
from xattn.core import api
from xattn.core import varlen_check as vc
from xattn.core.checks import Problem

I32 = torch.int32
GOOD_Q, GOOD_K = [0, 5, 5, 12, 20], [0, 4, 10, 10, 16]  # Tq 20, Tk 16; an empty segment each
TQ, TK, MAXQ, MAXK = 20, 16, 8, 6

# (id, cu_seqlens_q, cu_seqlens_k, message fragment naming the argument, the first bad index and values)
VIOLATIONS = [
    pytest.param([3, 5, 5, 12, 20], GOOD_K, "cu_seqlens_q[0] = 3: must be 0", id="q-start"),
    pytest.param([0, 5, 15, 12, 11], GOOD_K, "cu_seqlens_q[3] = 12 < cu_seqlens_q[2] = 15: must be non-decreasing",
                 id="q-decreasing-first-index"),
    pytest.param([0, 5, 5, 12, 21], GOOD_K, "cu_seqlens_q[4] = 21 > Tq = 20", id="q-end-beyond-T"),
    pytest.param([0, 9, 9, 12, 20], GOOD_K,
                 "cu_seqlens_q[1] - cu_seqlens_q[0] = 9 > max_seqlen_q = 8: segment 0 is longer", id="q-segment"),
    pytest.param(GOOD_Q, [-1, 4, 10, 10, 16], "cu_seqlens_k[0] = -1: must be 0", id="k-start"),
    pytest.param(GOOD_Q, [0, 4, 10, 9, 16], "cu_seqlens_k[3] = 9 < cu_seqlens_k[2] = 10", id="k-decreasing"),
    pytest.param(GOOD_Q, [0, 4, 10, 10, 17], "cu_seqlens_k[4] = 17 > Tk = 16", id="k-end-beyond-T"),
    pytest.param(GOOD_Q, [0, 4, 4, 11, 16], "cu_seqlens_k[3] - cu_seqlens_k[2] = 7 > max_seqlen_k = 6: segment 2",
                 id="k-segment"),
    pytest.param([0, 21, 5, 12, 20], [0, 4, 10, 9, 16], "cu_seqlens_q[2] = 5 < cu_seqlens_q[1] = 21",
                 id="q-reported-before-k"),
    pytest.param([1, 0, 5, 12, 30], GOOD_K, "cu_seqlens_q[0] = 1", id="start-reported-before-order-and-end"),
]


def np_ops():
    return vc.ArrayOps(first_true=np.argmax, take=lambda x, i: x[i], stack=lambda v: np.stack(v).astype(np.int64))


def _message(cu_q, cu_k, max_q=MAXQ, max_k=MAXK, tq=TQ, tk=TK):
    """The message the host path raises for these lists, or None."""
    flat = vc.host_summary(cu_q, tq, max_q) + vc.host_summary(cu_k, tk, max_k)
    try:
        vc.raise_first(flat, len(cu_q) - 1, tq, tk, max_q, max_k)
    except vc.CuSeqlensError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("cu_q, cu_k, fragment", VIOLATIONS)
def test_each_violation_names_the_argument_and_first_bad_index(cu_q, cu_k, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        vc.check_host(torch.tensor(cu_q, dtype=I32), torch.tensor(cu_k, dtype=I32), TQ, TK, MAXQ, MAXK)


def test_good_inputs_pass_including_limits():
    vc.check_host(torch.tensor(GOOD_Q, dtype=I32), torch.tensor(GOOD_K, dtype=I32), TQ, TK, MAXQ, MAXK)
    exact = [0, 8, 16, 20, 20]  # segments of exactly max_seqlen, end == T
    vc.check_host(torch.tensor(exact, dtype=I32), torch.tensor([0, 6, 12, 16, 16], dtype=I32), TQ, TK, 8, 6)
    vc.check_host(torch.tensor([0, 20], dtype=I32), torch.tensor([0, 3], dtype=I32), TQ, TK)  # no max given
    vc.check_host(torch.tensor([0, 3], dtype=I32), torch.tensor([0, 3], dtype=I32), 2 ** 40, 2 ** 40, 2 ** 40, 2 ** 40)


def test_metadata_rules():
    with pytest.raises(vc.CuSeqlensDtypeError, match="cu_seqlens_q: expected dtype int32, got int64") as info:
        vc.check_host(torch.tensor(GOOD_Q), torch.tensor(GOOD_K, dtype=I32), TQ, TK)
    assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k: expected a 1-D tensor [S + 1], got shape (1, 5)")):
        vc.check_host(torch.tensor(GOOD_Q, dtype=I32), torch.tensor([GOOD_K], dtype=I32), TQ, TK)
    with pytest.raises(ValueError, match="cu_seqlens_q: expected shape .S . 1. with S >= 1 segments, got .1,."):
        vc.check_host(torch.tensor([0], dtype=I32), torch.tensor([0], dtype=I32), TQ, TK)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k: expected shape (5,) like cu_seqlens_q")):
        vc.check_host(torch.tensor(GOOD_Q, dtype=I32), torch.tensor(GOOD_K[:3], dtype=I32), TQ, TK)


@pytest.mark.parametrize("producer", ["torch", "numpy", "jax", "torch-strided"])
def test_host_copy_through_dlpack_on_producers(producer):
    bad = [0, 20, 17, 20, 20]
    if producer == "torch":
        make = lambda v: torch.tensor(v, dtype=I32)  # noqa: E731
    elif producer == "numpy":
        make = lambda v: np.asarray(v, np.int32)  # noqa: E731
    elif producer == "jax":
        jnp = pytest.importorskip("jax.numpy")
        make = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    else:
        make = lambda v: torch.tensor([x for x in v for _ in (0, 1)], dtype=I32)[::2]  # noqa: E731
    vc.check_host(make(GOOD_Q), make(GOOD_K), TQ, TK, MAXQ, MAXK)
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[2] = 17 < cu_seqlens_q[1] = 20")):
        vc.check_host(make(bad), make(GOOD_K), TQ, TK)


def test_one_host_copy_when_q_and_k_share_cu_seqlens(monkeypatch):
    copies = []
    real = vc._host_ints
    monkeypatch.setattr(vc, "_host_ints", lambda x, name: copies.append(name) or real(x, name))
    cu = torch.tensor([0, 4, 10], dtype=I32)
    vc.check_host(cu, cu, 10, 10, 6, 6)
    assert copies == ["cu_seqlens_q"]
    vc.check_host(cu, cu.clone(), 10, 10, 6, 6)
    assert copies == ["cu_seqlens_q", "cu_seqlens_q", "cu_seqlens_k"]


def test_vectorised_summary_equals_host_summary():
    rng = random.Random(0)
    for _ in range(300):
        s = rng.randint(1, 6)
        cu = sorted(rng.randint(0, 30) for _ in range(s + 1))
        if rng.random() < 0.5:  # break a rule somewhere
            j = rng.randint(0, s)
            cu[j] = rng.randint(-3, 40)
        total, mx = rng.randint(0, 35), rng.choice([None, rng.randint(0, 20)])
        host = vc.host_summary(cu, total, mx)
        for ops, arr in ((np_ops(), np.asarray(cu, np.int32)), (_torch_ops(), torch.tensor(cu, dtype=I32))):
            assert [int(x) for x in vc.summary(ops, arr, total, mx)] == host, (cu, total, mx)


def _torch_ops():
    from xattn.torch.varlen_check import _OPS
    return _OPS


def test_messages_match_the_documented_example():
    cu = [0, 10, 20, 17, 30]
    msg = _message(cu, [0, 1, 2, 3, 4], max_q=None, tq=30)
    assert msg == "cu_seqlens_q[3] = 17 < cu_seqlens_q[2] = 20: must be non-decreasing"
    assert _message(GOOD_Q, GOOD_K) is None


def test_checking_env_and_keyword_precedence(monkeypatch):
    monkeypatch.delenv(vc.ENV_VAR, raising=False)
    assert vc.checking() is False and vc.checking(True) is True and vc.checking(False) is False
    for value, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)):
        monkeypatch.setenv(vc.ENV_VAR, value)
        assert vc.checking() is on and vc.checking(False) is False and vc.checking(True) is True
    with pytest.raises(TypeError, match="check_inputs: expected None or a bool, got int"):
        vc.checking(1)


# --- the core entry points, with the launch stubbed (CPU) ----------------------------------

@pytest.fixture
def stubbed_core(monkeypatch):
    """ffpa/fa4 fwd/bwd reach the check and the launch on CPU tensors: the validation that would refuse
    CPU buffers and the launcher are replaced; ``launches`` records the launches."""
    launches = []

    def quick(family, direction, raw, causal, cu_q, cu_k, max_q, max_k, window):
        spec = xc.KernelSpec(family, direction, "bfloat16", 128, 128, 1, causal, cu_q is not None)
        return spec, Problem(4, max_q, max_k, raw["q"].shape[0], raw["k"].shape[0], 2, 2, 0)
    monkeypatch.setattr(api, "quick_check", quick)
    monkeypatch.setattr(api, "get_launcher", lambda spec: spec)
    monkeypatch.setattr(api, "_workspace_layout", lambda spec, p: [])
    monkeypatch.setattr(api, "_launch", lambda launcher, problem, *a: launches.append(launcher.direction))
    monkeypatch.delenv(vc.ENV_VAR, raising=False)
    return launches


def _call(entry, cu_q, cu_k, **kw):
    q, k = torch.zeros(TQ, 2, 128, dtype=torch.bfloat16), torch.zeros(TK, 2, 128, dtype=torch.bfloat16)
    varlen = dict(cu_seqlens_q=torch.tensor(cu_q, dtype=I32), cu_seqlens_k=torch.tensor(cu_k, dtype=I32),
                  max_seqlen_q=MAXQ, max_seqlen_k=MAXK, softmax_scale=0.1, **kw)
    if entry in (xc.ffpa_fwd, xc.fa4_fwd):
        entry(q, k, k, q, None, **varlen)
    else:
        entry(q, q, k, k, q, None, q, k, k, workspace=[], **varlen)


ENTRIES = [pytest.param(f, id=f.__name__) for f in (xc.ffpa_fwd, xc.ffpa_bwd, xc.fa4_fwd, xc.fa4_bwd)]


@pytest.mark.parametrize("entry", ENTRIES)
def test_core_entry_points_check_in_checked_mode(entry, stubbed_core):
    bad = [0, 5, 15, 12, 20]
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_q[3] = 12 < cu_seqlens_q[2] = 15")):
        _call(entry, bad, GOOD_K, check_inputs=True)
    assert stubbed_core == []  # refused before the launch
    _call(entry, GOOD_Q, GOOD_K, check_inputs=True)
    assert len(stubbed_core) == 1


@pytest.mark.parametrize("entry", ENTRIES)
def test_core_unchecked_path_never_reads_cu_seqlens(entry, stubbed_core, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("the unchecked path read cu_seqlens")
    monkeypatch.setattr(api, "check_host", forbidden)
    bad = [0, 5, 15, 12, 20]
    _call(entry, bad, GOOD_K)  # default: env unset
    _call(entry, bad, GOOD_K, check_inputs=False)
    monkeypatch.setenv(vc.ENV_VAR, "1")
    _call(entry, bad, GOOD_K, check_inputs=False)  # the keyword wins over the env var
    assert len(stubbed_core) == 3
    with pytest.raises(AssertionError, match="read cu_seqlens"):
        _call(entry, bad, GOOD_K)  # None follows the env var


def test_core_env_var_turns_checking_on(stubbed_core, monkeypatch):
    monkeypatch.setenv(vc.ENV_VAR, "1")
    with pytest.raises(ValueError, match=re.escape("cu_seqlens_k[4] = 17 > Tk = 16")):
        _call(xc.fa4_fwd, GOOD_Q, [0, 4, 10, 10, 17])
    monkeypatch.setenv(vc.ENV_VAR, "0")
    _call(xc.fa4_fwd, GOOD_Q, [0, 4, 10, 10, 17])
    assert stubbed_core == ["fwd"]


def test_real_core_validation_still_runs_first():
    """Without stubs, buffer validation comes first (CPU tensors: the named device error), then the check."""
    q = torch.zeros(TQ, 2, 128, dtype=torch.bfloat16)
    k = torch.zeros(TK, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        xc.fa4_fwd(q, k, k, q.clone(), torch.empty(2, TQ), softmax_scale=0.1,
                   cu_seqlens_q=torch.tensor([0, 15, 12, 20], dtype=I32),
                   cu_seqlens_k=torch.tensor([0, 4, 10, 16], dtype=I32), max_seqlen_q=8, max_seqlen_k=6,
                   check_inputs=True)
