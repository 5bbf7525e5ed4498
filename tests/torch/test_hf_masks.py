"""The "ffpa" mask factory is exact: for every mask HF builds (causal, sliding, bidirectional, packed,
padding, KV-cache offsets), what the kernels would attend to under the returned plan equals HF's own
SDPA mask, element for element; everything else falls back to that very mask. The factory returns
``torch.Tensor | BlockMask | None`` (NeMo's annotation): a :class:`PlannedMask` (HF's mask, carrying
the plan) or HF's own mask; never None (NeMo's None for plain causal layers leaves the mask to the
layer's kwargs, which can contradict it)."""

import logging
import random

import pytest
import torch

mu = pytest.importorskip("transformers.masking_utils")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import mask_factory, masks, support  # noqa: E402
from xattn.torch.hf.kernel_mask import KernelMask, PlannedMask, plan_without_mask  # noqa: E402
from xattn.torch.hf.masks import describe  # noqa: E402


def plan_of(got, args) -> KernelMask | None:
    """The plan the attention function runs for a factory result: a PlannedMask's, for None the causal
    (bottom-right) plan it builds from the module; None for a plain tensor mask (SDPA runs it)."""
    if isinstance(got, PlannedMask):
        assert got.shape == (args["batch_size"], 1, args["q_length"], args["kv_length"]) and got.dtype == torch.bool
        return got.plan
    if got is None:
        q = torch.empty(args["batch_size"], 1, args["q_length"], 1)
        k = torch.empty(args["batch_size"], 1, args["kv_length"], 1)
        return plan_without_mask(q, k, (None, 0))
    assert type(got) is torch.Tensor
    return None


def kernel_visibility(plan: KernelMask) -> torch.Tensor:
    """``[B, Nq, Nk]`` bool: what the kernels attend to under ``plan`` (bottom-right windows per segment)."""
    b, nq = plan.batch_size, plan.q_length
    stop = plan.kv_length if plan.kv_stop is None else plan.kv_stop
    nk = stop - plan.kv_start
    left, right = plan.window
    vis = torch.zeros(b * nq, b * nk, dtype=torch.bool)
    if plan.varlen:
        cq, ck = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
        segments = list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))
    else:
        segments = [(r * nq, (r + 1) * nq, r * nk, (r + 1) * nk) for r in range(b)]
    for q0, q1, k0, k1 in segments:
        lq, lk = q1 - q0, k1 - k0
        for i in range(lq):
            for j in range(lk):
                rel = j - (i + lk - lq)
                if (left is None or rel >= -left) and (right is None or rel <= right):
                    vis[q0 + i, k0 + j] = True
    blocks = vis.reshape(b, nq, b, nk)
    assert not any(blocks[r, :, s].any() for r in range(b) for s in range(b) if r != s), "crosses rows"
    full = torch.zeros(b, nq, plan.kv_length, dtype=torch.bool)
    full[:, :, plan.kv_start:stop] = torch.stack([blocks[r, :, r] for r in range(b)])
    return full


def hf_truth(**args) -> torch.Tensor:
    return mu.sdpa_mask(**args, allow_is_causal_skip=False)[:, 0]


def _padding(rng, b, length, side):
    keep = torch.ones(b, length, dtype=torch.long)
    for r in range(b):
        n = rng.randrange(0, length // 2 + 1)
        if side == "left" and n:
            keep[r, :n] = 0
        elif side == "right" and n:
            keep[r, -n:] = 0
    return keep


def _mask_function(rng, kind):
    w = rng.randrange(1, 6)
    return {"causal": mu.causal_mask_function,
            "sliding": mu.sliding_window_causal_mask_function(w),
            "bidirectional": mu.bidirectional_mask_function,
            "sliding_bidirectional": mu.sliding_window_bidirectional_mask_function(w)}[kind]


CASES = [(kind, side, cache) for kind in ("causal", "sliding", "bidirectional", "sliding_bidirectional")
         for side in ("none", "left", "right") for cache in ("none", "dynamic", "static")]


@pytest.mark.parametrize("kind, side, cache", CASES, ids=["-".join(c) for c in CASES])
def test_factory_equals_hf_sdpa_mask(kind, side, cache, caplog):
    """Random sizes per case; the KernelMask must reproduce HF's mask exactly, or the factory must
    return HF's mask itself (with a warning naming why)."""
    rng = random.Random(hash((kind, side, cache)) % 1000)
    routed = 0
    for _ in range(12):
        b, nq = rng.randrange(1, 4), rng.randrange(1, 9)
        past = 0 if cache == "none" else rng.randrange(1, 8)
        kv_len = nq + past + (rng.randrange(1, 6) if cache == "static" else 0)
        seen = nq + past
        keep = None if side == "none" else _padding(rng, b, seen, side)
        if keep is not None and cache == "static":
            keep = keep  # shorter than kv_len: HF pads it with zeros (empty cache slots)
        args = dict(batch_size=b, q_length=nq, kv_length=kv_len, q_offset=past, kv_offset=0,
                    mask_function=_mask_function(rng, kind),
                    attention_mask=None if keep is None else keep.bool())
        truth = hf_truth(**args)
        fa._FALLBACK_WARNED.clear()
        with caplog.at_level(logging.WARNING):
            got = fa.ffpa_mask(**args)
        plan = plan_of(got, args)
        if plan is not None:
            routed += 1
            assert torch.equal(kernel_visibility(plan), truth), (args, got)
            assert torch.equal(plan.sdpa_mask()[:, 0], truth)
            if got is not None:  # the tensor itself reads as HF's mask (built on first read)
                assert torch.equal(got[:, 0, :, :], truth) and bool(got.all()) == bool(truth.all())
                _assert_query_slices_exact(got, truth)
        else:
            assert torch.equal(got[:, 0], truth) and "ffpa fallback" in caplog.text
    if side != "right" or kind.startswith("bidirectional"):
        assert routed >= 6, f"only {routed}/12 masks reached the kernels"


def test_packed_documents_from_position_ids_are_exact():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    psm = mu.find_packed_sequence_indices(pos)
    for inner in (mu.causal_mask_function, mu.sliding_window_causal_mask_function(2)):
        fn = inner
        if hasattr(mu, "remap_positions_for_packed_sequence"):
            fn = mu.remap_positions_for_packed_sequence(fn, pos)
        fn = mu.and_masks(fn, mu.packed_sequence_mask_function(psm))
        args = dict(batch_size=2, q_length=9, kv_length=9, mask_function=fn)
        got = fa.ffpa_mask(**args)
        assert isinstance(got, PlannedMask) and got.plan.varlen
        plan = got.plan
        assert plan.cu_seqlens_q.tolist() == [0, 3, 5, 9, 15, 18]
        assert torch.equal(kernel_visibility(plan), hf_truth(**args))
        _assert_query_slices_exact(got, hf_truth(**args))


def _assert_query_slices_exact(mask: PlannedMask, truth: torch.Tensor) -> None:
    """``mask[:, :, -n:, :]`` (how Gemma 4's KV-shared layers slice masks for ``logits_to_keep``) stays a
    PlannedMask that runs exactly the last ``n`` rows of HF's mask, for every n."""
    plan = mask.plan
    for n in range(1, plan.q_length + 1):
        part = mask[:, :, -n:, :]
        assert isinstance(part, PlannedMask) and part.shape == (plan.batch_size, 1, n, plan.kv_length)
        assert part.plan.q_length == n
        assert torch.equal(kernel_visibility(part.plan), truth[:, -n:]), (n, part)
        assert torch.equal(part.plan.sdpa_mask()[:, 0], truth[:, -n:])
        assert torch.equal(part[:, 0], truth[:, -n:])


def test_planned_mask_reads_as_the_sdpa_mask_everywhere():
    """Code written for NeMo's / HF's tensor masks (``.all()``, other slices, ``.to``, ``~``, SDPA) reads
    a PlannedMask as the exact SDPA mask; the plan survives ``.bool()`` and the query slice only."""
    keep = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    args = dict(batch_size=2, q_length=6, kv_length=6, mask_function=mu.sliding_window_causal_mask_function(3),
                attention_mask=keep.bool())
    got, truth = fa.ffpa_mask(**args), mu.sdpa_mask(**args, allow_is_causal_skip=False)
    assert isinstance(got, PlannedMask) and isinstance(got, torch.Tensor)
    assert got.shape == truth.shape and got.dtype == torch.bool and got.dim() == 4 and got.device == truth.device
    assert got.bool() is got
    assert torch.equal(got[0], truth[0]) and type(got[0]) is torch.Tensor  # not the query slice: a tensor
    assert torch.equal(got[:, :, :, -2:], truth[:, :, :, -2:])
    assert not bool(got.all()) and bool(got.any())
    assert torch.equal(got.to(torch.float32), truth.float()) and torch.equal(~got, ~truth)
    q = torch.randn(2, 3, 6, 8)
    assert torch.equal(torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=got),
                       torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=truth))
    assert "PlannedMask(" in repr(got)


def test_plain_causal_mask_is_planned_and_wins_over_contradicting_kwargs(monkeypatch):
    """Plain causal layers get a PlannedMask too (not NeMo's None): the layer's kwargs may contradict the
    mask (``is_causal=False``, a ``sliding_window``), and SDPA runs the mask. Found by the GPU fuzz."""
    from . import stubs

    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    for args in (dict(batch_size=2, q_length=4, kv_length=4), dict(batch_size=1, q_length=1, kv_length=9, q_offset=8),
                 dict(batch_size=2, q_length=18, kv_length=25, q_offset=7)):
        got = fa.ffpa_mask(**args, mask_function=mu.causal_mask_function)
        assert isinstance(got, PlannedMask) and got.plan.causal
        assert torch.equal(got[:, 0], hf_truth(mask_function=mu.causal_mask_function, **args))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 512, generator=g).to(torch.bfloat16) for h, n in ((4, 18), (2, 25), (2, 25)))
    mask = fa.ffpa_mask(2, 18, 25, q_offset=7)

    class Layer(torch.nn.Module):
        is_causal = True
    out, _ = fa.ffpa_attention_forward(Layer(), q, k, v, mask, scaling=0.05, is_causal=False, sliding_window=16)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(2, 1),
                                                            v.double().repeat_interleave(2, 1),
                                                            attn_mask=mask.plan.sdpa_mask(), scale=0.05)
    torch.testing.assert_close(out.double(), want.transpose(1, 2), atol=2e-2, rtol=2e-2)


def test_kernel_mask_refuses_other_indexing():
    plan = fa.ffpa_mask(2, 5, 5, attention_mask=torch.tensor([[0, 1, 1, 1, 1]] * 2)).plan
    for index in (0, (slice(None), 0), (slice(None), slice(None), slice(0, 2), slice(None)),
                  (slice(None), slice(None), slice(None, None, 2), slice(None))):
        with pytest.raises(TypeError, match="KernelMask"):
            plan[index]


@pytest.mark.parametrize("name", ["chunked", "or_overlay", "blockwise", "custom"])
def test_patterns_without_an_exact_kernel_form_get_hf_mask(name, caplog):
    fns = {
        "chunked": lambda: mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long)),
        "or_overlay": lambda: mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: k == 0),
        "blockwise": lambda: mu.or_masks(mu.causal_mask_function,
                                         mu.blockwise_overlay(torch.tensor([[-1, 0, 0, -1, -1, -1]] * 2))),
        "custom": lambda: (lambda b, h, q, k: (q - k) % 2 == 0),
    }
    args = dict(batch_size=2, q_length=6, kv_length=6, mask_function=fns[name]())
    assert describe(args["mask_function"]) is None
    fa._FALLBACK_WARNED.clear()
    with caplog.at_level(logging.WARNING):
        got = fa.ffpa_mask(**args, use_vmap=True)
    assert "(reason='mask_function')" in caplog.text
    assert torch.equal(got, mu.sdpa_mask(**args, use_vmap=True, allow_is_causal_skip=False))


def test_describe_reads_hf_windows():
    assert describe(mu.causal_mask_function).left is None and describe(mu.causal_mask_function).right == 0
    p = describe(mu.sliding_window_causal_mask_function(5))
    assert (p.left, p.right) == (4, 0)  # kv > q - 5
    p = describe(mu.sliding_window_bidirectional_mask_function(3))
    assert (p.left, p.right) == (3, 3)  # |q - kv| <= 3
    p = describe(mu.bidirectional_mask_function)
    assert (p.left, p.right) == (None, None)


def test_flex_setting_builds_the_sliding_block_mask(monkeypatch):
    monkeypatch.setattr(mask_factory, "SLIDING_BACKEND", "flex")
    built = {}
    monkeypatch.setattr(mu, "flex_attention_mask", lambda **kw: built.update(kw) or "block-mask")
    keep = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]).bool()
    fn = mu.sliding_window_causal_mask_function(2)
    assert fa.ffpa_mask(2, 4, 4, mask_function=fn, attention_mask=keep) == "block-mask"
    assert built["mask_function"] is fn and built["attention_mask"] is keep  # padding travels with it
    assert isinstance(fa.ffpa_mask(2, 4, 4, attention_mask=keep), PlannedMask)  # full layers stay on kernels
    monkeypatch.setattr(mask_factory, "SLIDING_BACKEND", "flax")
    with pytest.raises(ValueError, match="XATTN_SLIDING_BACKEND must be 'flex', 'sdpa' or 'fa4'"):
        fa.ffpa_mask(2, 4, 4, mask_function=fn)


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("backend", ["flex", "sdpa", "fa4", "SDPA", None])
def test_config_sliding_backend_as_nemo(monkeypatch, backend):
    """``config.ffpa_sliding_attn_backend`` (NeMo's knob) picks the non-causal layers' backend, over
    ``XATTN_SLIDING_BACKEND``; causal layers stay on the kernels whatever it says."""
    monkeypatch.setattr(mask_factory, "SLIDING_BACKEND", "fa4")
    monkeypatch.setattr(mu, "flex_attention_mask", lambda **kw: "block-mask")
    config = _Config(model_type="gemma4_text", ffpa_sliding_attn_backend=backend)
    keep = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
    args = dict(batch_size=2, q_length=5, kv_length=5, mask_function=mu.sliding_window_causal_mask_function(2),
                attention_mask=keep)
    got = fa.ffpa_mask(**args, config=config)
    want = {"flex": "block-mask", "sdpa": "tensor", "SDPA": "tensor", "fa4": "planned", None: "planned"}[backend]
    if want == "block-mask":
        assert got == "block-mask"
    elif want == "tensor":
        assert type(got) is torch.Tensor and torch.equal(got, mu.sdpa_mask(**args, allow_is_causal_skip=False))
    else:
        assert isinstance(got, PlannedMask)
    assert isinstance(fa.ffpa_mask(2, 5, 5, attention_mask=keep, config=config), PlannedMask)


def test_config_sliding_backend_refuses_other_values():
    config = _Config(model_type="gemma4_text", ffpa_sliding_attn_backend="flash")
    with pytest.raises(ValueError, match="ffpa_sliding_attn_backend must be 'flex', 'sdpa' or 'fa4', got 'flash'"):
        fa.ffpa_mask(2, 4, 4, mask_function=mu.sliding_window_causal_mask_function(2), config=config)


@pytest.mark.parametrize("model_type", ["gemma4_vision", "gemma4_audio", "siglip_vision_model"])
@pytest.mark.parametrize("backend", ["flex", "sdpa", None])
def test_vision_and_audio_towers_keep_their_padding(monkeypatch, model_type, backend):
    """Sub-encoders share the registry: their masks (bidirectional over padded patches) are planned exactly,
    whatever the text's sliding backend says (NeMo returns None, which drops their padding)."""
    monkeypatch.setattr(mu, "flex_attention_mask", lambda **kw: "block-mask")
    config = _Config(model_type=model_type, ffpa_sliding_attn_backend=backend)
    keep = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]).bool()
    for fn, pad in ((mu.bidirectional_mask_function, keep), (mu.bidirectional_mask_function, None),
                    (mu.sliding_window_bidirectional_mask_function(1), keep)):
        args = dict(batch_size=2, q_length=4, kv_length=4, mask_function=fn, attention_mask=pad)
        got = fa.ffpa_mask(**args, config=config)
        assert got is not None and not isinstance(got, str), got
        plan = plan_of(got, args)
        if plan is None:  # uneven right padding under a window: HF's own mask (the exact fallback)
            assert torch.equal(got[:, 0], hf_truth(**args))
        else:
            assert torch.equal(kernel_visibility(plan), hf_truth(**args))
        if fn is mu.bidirectional_mask_function:
            assert isinstance(got, PlannedMask)  # the towers' own pattern reaches the kernels


def test_padding_mask_is_read_once_per_tensor(monkeypatch):
    """Decode hands one 2D mask to the full and the sliding factory in a step: an all-ones mask is read
    (one host sync) by the first and answers the second; a mask changed in place, a new tensor or an
    inference tensor is read again, and every plan stays exactly HF's mask."""
    reads = []
    real = masks._host_bools
    monkeypatch.setattr(masks, "_host_bools", lambda *f: reads.append(len(f)) or real(*f))
    n, window = 40, 16
    full = dict(batch_size=1, q_length=1, kv_length=n, q_offset=n - 1, kv_offset=0,
                mask_function=mu.causal_mask_function)
    sliding = dict(batch_size=1, q_length=1, kv_length=window, q_offset=n - 1, kv_offset=n - window,
                   mask_function=mu.sliding_window_causal_mask_function(window))

    def planned(args, mask):
        args = dict(args, attention_mask=mask)
        plan = plan_of(fa.ffpa_mask(**args), args)
        assert plan is not None and torch.equal(kernel_visibility(plan), hf_truth(**args))
        return plan

    mask = torch.ones(1, n, dtype=torch.long)
    assert not planned(full, mask).varlen and not planned(sliding, mask).varlen
    assert len(reads) == 1  # the full layer's read answered the sliding layer's
    mask[0, : n - 10] = 0  # in place: left padding that reaches into the window
    assert planned(sliding, mask).varlen and len(reads) == 2
    assert not planned(sliding, torch.ones(1, n, dtype=torch.long)).varlen and len(reads) == 3  # a new tensor
    with torch.inference_mode():
        frozen = torch.ones(1, n, dtype=torch.long)
    planned(full, frozen), planned(sliding, frozen)
    assert len(reads) == 3  # no version counter: read as before, not remembered
    before = len(masks._PADDING_READS)
    del mask
    assert len(masks._PADDING_READS) == before - 1  # forgotten with the tensor
