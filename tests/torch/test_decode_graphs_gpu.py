"""Graph-captured decode on the GPU (issue #25): HF ``generate()`` with a ``StaticCache``, compiled as HF compiles
it (``torch.compile(mode="reduce-overhead")``: CUDA graphs), through "ffpa" on the real kernels (FA4 on the
sliding d256 layers, FFPA on the full d512 ones), against fp32 "sdpa" of the same weights.

The logits of every decode step are judged against fp32 "sdpa" run teacher-forced on the same tokens, next
to bf16 "sdpa" (the yardstick: the error bf16 itself makes); the greedy tokens must be fp32's wherever fp32's
top-2 margin is clear of that noise. The compiled step must trace without a graph break, in at most 2 graphs,
replayed (not re-recorded) per token, with no fallback."""

import pytest
import torch

pytest.importorskip("transformers")

from tests.reference import rel_err  # noqa: E402
from xattn.torch import ffpa_attention as fa  # noqa: E402

from . import decode  # noqa: E402
from .test_decode_graphs import RUN_TOL, STEP_TOL  # noqa: E402  (what they rest on is measured there)
from .hf_gpu import hf_gpu  # noqa: E402,F401  (autouse: skips without the kernels)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("prompt", [decode.PROMPT, 1100], ids=["fused", "split-kv"])
def test_graph_decode_vs_fp32(prompt, monkeypatch):
    """At 1100 prompt tokens the full layers' decode steps take the split-KV route (its memoised cu_seqlens
    must stay out of the CUDA-graph trees' pool)."""
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from xattn.torch import split_kv

    splits = []
    real = split_kv.split_forward
    monkeypatch.setattr(split_kv, "split_forward", lambda *a, **kw: splits.append(a[0]) or real(*a, **kw))
    ids = decode.prompt("cuda", prompt)
    net = decode.model("ffpa", "cuda")
    cache = StaticCache(config=net.config, max_cache_len=ids.shape[1] + decode.NEW)
    torch._dynamo.reset()
    counters.clear()
    tokens, logits = decode.generate(net, ids, graphs=True, cache=cache)
    recorded = counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0)
    again, logits_again = decode.generate(net, ids, graphs=True, cache=cache)  # the same cache: graphs replayed
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert counters["inductor"].get("cudagraph_recorded_non_static_inputs", 0) == recorded, "re-recorded a graph"
    assert not fa._FALLBACK_WARNED, fa._FALLBACK_WARNED
    assert torch.equal(again, tokens) and torch.equal(logits_again, logits)
    assert bool(splits) == (prompt > decode.PROMPT), splits[:1]

    truth = decode.teacher_forced_logits(decode.model("sdpa", "cuda", torch.float32), ids, tokens)
    yardstick = decode.teacher_forced_logits(decode.model("sdpa", "cuda"), ids, tokens)
    err, noise = rel_err(logits, truth), rel_err(yardstick, truth)
    assert err <= 1.5 * noise + 1e-3, (err, noise)
    if prompt > decode.PROMPT:  # this tiny model's logits after 1100 tokens have no clear top-1: values only
        return
    top2 = truth.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 4 * (yardstick - truth).abs().amax()
    assert clear.any(), "no step with a clear top-1: the check would test nothing"
    assert torch.equal(tokens[clear], truth.argmax(-1)[clear])


def test_graph_and_eager_decode_vs_fp32():
    """The compiled static-cache decode and the eager dynamic-cache decode, each judged by its logits against
    fp32 "sdpa" of the same (bf16-rounded) weights, teacher-forced on the tokens that path generated: within the
    CPU test's bf16 tolerances, or twice what bf16 "sdpa" teacher-forced on them makes, if more. Not by token
    equality: the graphs fuse the model's other ops differently, a near tie may flip a greedy token, and the two
    sequences then part."""
    ids = decode.prompt("cuda")
    net = decode.model("ffpa", "cuda")
    truth = decode.model("sdpa", "cuda", torch.float32)
    truth.load_state_dict(net.state_dict())
    bf16_sdpa = decode.model("sdpa", "cuda")
    bf16_sdpa.load_state_dict(net.state_dict())

    def step_err(logits, want):  # per step, max |logits - want| / max |want|
        return (logits - want).abs().amax(-1) / want.abs().amax(-1)

    for name, graphs in (("eager", False), ("compiled", True)):
        tokens, logits = decode.generate(net, ids, graphs=graphs)
        want = decode.teacher_forced_logits(truth, ids, tokens)
        noise = decode.teacher_forced_logits(bf16_sdpa, ids, tokens)
        err, noise_err = step_err(logits, want), step_err(noise, want)
        assert err.max() <= max(STEP_TOL, 2 * noise_err.max()), (name, err.tolist(), noise_err.tolist())
        assert rel_err(logits, want) <= max(RUN_TOL, 2 * rel_err(noise, want)), (name, rel_err(logits, want))
    assert not fa._FALLBACK_WARNED, fa._FALLBACK_WARNED


def test_left_padded_batch_decode_on_the_packed_split_route(monkeypatch):
    """Eager decoding of a left-padded batch (1100 and 800 real tokens: packed documents of different lengths) on
    the real kernels: the full layers' steps take the packed split-KV route by the rule, and the logits (fixed
    tokens fed step by step) are as close to fp32 "sdpa" of the same weights as bf16 "sdpa" is."""
    from xattn.torch import split_kv

    packed = []
    real = split_kv.packed_split_forward
    monkeypatch.setattr(split_kv, "packed_split_forward", lambda *a, **k: packed.append(1) or real(*a, **k))
    ids = torch.cat([decode.prompt("cuda", 1100), decode.prompt("cuda", 1101)[:, :1100]])
    mask = torch.ones_like(ids)
    mask[1, :300] = 0
    tokens = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(5)).cuda()
    net = decode.model("ffpa", "cuda")
    got = decode.padded_step_logits(net, ids, mask, tokens)
    assert packed, "the decode steps did not take the packed split route"
    truth = decode.model("sdpa", "cuda", torch.float32)
    truth.load_state_dict(net.state_dict())
    noise_net = decode.model("sdpa", "cuda")
    noise_net.load_state_dict(net.state_dict())
    want = decode.padded_step_logits(truth, ids, mask, tokens)
    noise = decode.padded_step_logits(noise_net, ids, mask, tokens)
    assert rel_err(got, want) <= 1.5 * rel_err(noise, want) + 1e-3, (rel_err(got, want), rel_err(noise, want))
    assert not fa._FALLBACK_WARNED, fa._FALLBACK_WARNED
