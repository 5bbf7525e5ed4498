"""A :class:`PlannedMask` edited in place (issue #42) is run as it reads: the attention function never launches
a plan that disagrees with the mask's values (an edited mask runs on SDPA), however the edit was made (on the
mask, through a view, a query slice or the plan's SDPA mask, under inference mode). Clones stay plain, mutable
tensors. CPU: the core is the fp64 reference stand-in (tests/torch/stubs.py)."""

import gc

import pytest
import torch

mu = pytest.importorskip("transformers.masking_utils")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import support  # noqa: E402
from xattn.torch.hf.kernel_mask import PlannedMask  # noqa: E402

from . import stubs  # noqa: E402

LEFT_PADDED = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8]).bool()
BAND = (torch.arange(8)[None, :] > torch.arange(8)[:, None] - 3)[None, None]  # [1, 1, Nq, Nk]: a 3-key window


@pytest.fixture
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


class _Layer(torch.nn.Module):
    is_causal = True


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 512, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(2, 2, 8, 512, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def _sdpa_as_it_reads(q, k, v, mask, scale):
    """fp64 SDPA on the mask's values ``[B, 1, Nq, Nk]``, rows that see no key 0; ``[B, Nq, Hq, Dv]``."""
    mask = mask.clone()
    k, v = (t.double().repeat_interleave(q.shape[1] // k.shape[1], 1) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q.double(), k, v, attn_mask=mask, scale=scale)
    return out.nan_to_num(0.0).masked_fill(~mask.any(-1)[..., None], 0.0).transpose(1, 2)


def _set_column(m):
    m[..., 5] = False


def _through_a_row_view(m):
    m[1][..., 3] = False


def _through_a_torch_view(m):
    rows = m.transpose(-1, -2)
    rows &= BAND.logical_not()


def _through_a_composite_view(m):  # swapaxes, flatten: one op at the mask under inference mode
    m.swapaxes(-1, -2)[..., 4, :] = False
    m.flatten()[5] = True


def _through_the_sdpa_mask(m):
    m.plan.sdpa_mask()[:, :, :, 4] = False


EDITS = [
    pytest.param(_set_column, id="setitem"),
    pytest.param(lambda m: m.masked_fill_(BAND.logical_not(), False), id="masked_fill_"),
    pytest.param(lambda m: m.logical_and_(BAND), id="logical_and_"),
    pytest.param(lambda m: m.copy_(torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)), id="copy_"),
    pytest.param(lambda m: torch.logical_and(m, BAND, out=m), id="out="),
    pytest.param(lambda m: m.__iand__(BAND), id="&="),
    pytest.param(_through_a_row_view, id="row-view"),
    pytest.param(_through_a_torch_view, id="transpose-view"),
    pytest.param(_through_a_composite_view, id="swapaxes-flatten-views"),
    pytest.param(lambda m: m.view(16, 8).fill_diagonal_(False), id="fill_diagonal_-on-a-view"),
    pytest.param(_through_the_sdpa_mask, id="plan.sdpa_mask"),
]


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("edit", EDITS)
def test_edited_planned_mask_runs_as_it_reads(kernels, edit, inference):
    q, k, v = _inputs()
    with torch.inference_mode(inference):
        mask = fa.ffpa_mask(2, 8, 8, mask_function=mu.causal_mask_function, attention_mask=LEFT_PADDED)
        assert isinstance(mask, PlannedMask) and mask.plan.varlen
        before = mask.clone()
        edit(mask)
        assert not torch.equal(mask.clone(), before), "the edit must change the mask"
        out, _ = fa.ffpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.05)
    torch.testing.assert_close(out.double(), _sdpa_as_it_reads(q, k, v, mask, 0.05), atol=2e-2, rtol=2e-2)
    assert not any(call[0] == "fwd" for call in stubs.CALLS), "an edited mask must not run its stale plan"


@pytest.mark.parametrize("edited", ["parent", "slice", "dropped parent"])
def test_query_slices_share_the_edit(kernels, edited):
    """HF's query slice ``mask[:, :, start:, :]`` (a planned child, whose values are a view of the parent's) and
    its parent both see an edit made through either of them, also once the edited parent is gone."""
    q, k, v = _inputs()
    mask = fa.ffpa_mask(2, 8, 8, mask_function=mu.causal_mask_function, attention_mask=LEFT_PADDED)
    child = mask[:, :, 3:, :]
    assert isinstance(child, PlannedMask)
    if edited == "dropped parent":
        rows = mask.transpose(-1, -2)
        rows[..., 6, :] = False
        del rows, mask
        gc.collect()
        want = child.clone()
    else:
        (mask if edited == "parent" else child)[..., 6] = False
        want = mask.clone()[:, :, 3:]
        out, _ = fa.ffpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.05)
        torch.testing.assert_close(out.double(), _sdpa_as_it_reads(q, k, v, mask, 0.05), atol=2e-2, rtol=2e-2)
    assert not want[..., 6].any()
    part, _ = fa.ffpa_attention_forward(_Layer(), q[:, :, 3:], k, v, child, scaling=0.05)
    torch.testing.assert_close(part.double(), _sdpa_as_it_reads(q[:, :, 3:], k, v, want, 0.05), atol=2e-2,
                               rtol=2e-2)
    assert not any(call[0] == "fwd" for call in stubs.CALLS)


def test_clones_are_plain_and_leave_the_plan_running(kernels):
    """``clone()`` / ``to(...)`` return plain mutable tensors; editing them changes neither the mask nor its
    route (a mask that was only read still runs on the kernels)."""
    q, k, v = _inputs()
    mask = fa.ffpa_mask(2, 8, 8, mask_function=mu.causal_mask_function, attention_mask=LEFT_PADDED)
    truth = mu.sdpa_mask(2, 8, 8, mask_function=mu.causal_mask_function, attention_mask=LEFT_PADDED,
                         allow_is_causal_skip=False)
    for copy in (mask.clone(), mask.to(torch.uint8), mask.to(torch.float32)):
        assert type(copy) is torch.Tensor
        copy[..., 5] = 0
    assert torch.equal(mask.clone(), truth)
    out, _ = fa.ffpa_attention_forward(_Layer(), q, k, v, mask, scaling=0.05)
    assert ("fwd", "ffpa") in stubs.CALLS
    torch.testing.assert_close(out[:, 2:].double(), _sdpa_as_it_reads(q, k, v, truth, 0.05)[:, 2:], atol=2e-2,
                               rtol=2e-2)
