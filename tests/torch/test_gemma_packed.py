"""Packed and left-padded batches through a tiny Gemma 4 with its real layer mix (5 sliding : 1 full) on
the CPU: the kernel route (fp64 stand-in kernels) equals each document alone, judged against fp64
sdpa as sdpa itself is (tests/torch/gemma_packed.py)."""

import logging

import pytest
import torch

pytest.importorskip("transformers.models.gemma4")

from tests.reference import rel_err  # noqa: E402
from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import call_plan, support  # noqa: E402

from . import gemma_packed as gp, stubs  # noqa: E402

LENGTHS = [7, 11, 6]  # every document longer than the window (5)


@pytest.fixture
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


def _ids(n, seed=1):
    return torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("route", ["position_ids", "cu_seq_lens"])
def test_packed_documents_equal_each_document_alone(kernels, route, caplog):
    ids = _ids(sum(LENGTHS))
    with caplog.at_level(logging.WARNING):
        errs = gp.compare(gp.packed_runs(ids, LENGTHS, route, "cpu"),
                          gp.packed_runs(ids, LENGTHS, "position_ids", "cpu"),
                          gp.alone_runs(ids, LENGTHS, "cpu"), "cpu", torch.bfloat16, sum(LENGTHS))
    print(gp.summary(errs, f"packed ({route})"))
    assert "ffpa fallback" not in caplog.text
    assert {c for c in stubs.CALLS} == {("fwd", "fa4"), ("fwd", "ffpa"), ("bwd", "fa4"), ("bwd", "ffpa")}
    gp.assert_no_worse(errs)


def test_left_padded_batch_equals_each_row_alone(kernels, caplog):
    ids = _ids(3 * 20).reshape(3, 20)
    keep = torch.ones(3, 20, dtype=torch.bool)
    keep[1, :6] = False
    keep[2, :13] = False
    with caplog.at_level(logging.WARNING):
        errs = gp.compare(gp.padded_runs(ids, keep), gp.padded_runs(ids, keep), gp.padded_alone_runs(ids, keep, "cpu"),
                          "cpu", torch.bfloat16, int(keep.sum()))
    print(gp.summary(errs, "left-padded"))
    assert "ffpa fallback" not in caplog.text
    gp.assert_no_worse(errs)


def test_packed_position_ids_with_a_cache_follow_the_mask_and_say_so(kernels, caplog):
    ids = _ids(sum(LENGTHS))
    run = gp.packed_runs(ids, LENGTHS, "position_ids", "cpu")[0]
    run.update(use_cache=True)
    run.pop("keep")
    fa.register_ffpa_attention()
    state = gp.weights(torch.bfloat16)
    with caplog.at_level(logging.WARNING):
        out = gp.build("ffpa", state, "cpu", torch.bfloat16)(**run).logits.double()
        ref = gp.build("sdpa", state, "cpu", torch.bfloat16)(**run).logits.double()
    truth = gp.build("sdpa", state, "cpu", torch.float64)(**run).logits
    assert caplog.text.count("(reason='packed_position_ids')") == 1
    assert rel_err(out, truth) <= 1.5 * rel_err(ref, truth) + 2e-3


def test_the_check_catches_documents_that_see_each_other(kernels, monkeypatch):
    """Mutation: ignore the cu_seq_lens documents -> the judgement must fail."""
    monkeypatch.setattr(call_plan, "_packed_kwargs", lambda *a: None)
    ids = _ids(sum(LENGTHS))
    errs = gp.compare(gp.packed_runs(ids, LENGTHS, "cu_seq_lens", "cpu"),
                      gp.packed_runs(ids, LENGTHS, "position_ids", "cpu"), gp.alone_runs(ids, LENGTHS, "cpu"),
                      "cpu", torch.bfloat16, sum(LENGTHS))
    with pytest.raises(AssertionError):
        gp.assert_no_worse(errs)
