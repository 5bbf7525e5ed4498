"""HF continuous batching (``generate_batch``) on xattn's kernels (issue #44, item 3), on the CPU stand-ins: the
``"ffpa_flash"`` registration, packed prefill chunks mixed with decoding steps, sliding and full layers, layers
reusing another layer's keys (their cu_seqlens come as a dict). bf16, judged by values: the log-probability CB
reports for each generated token against fp32 of the same (rounded) weights teacher-forced on those tokens, next to
transformers' own bf16 sdpa continuous batching judged the same way (the yardstick)."""

import pytest
import torch

pytest.importorskip("transformers")

from xattn.torch import ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import continuous_batching as cb, support  # noqa: E402

from . import stubs  # noqa: E402

PROMPTS = [[2, 5, 7, 9, 11, 13, 3], [2, 4, 6], [2, 8, 8, 8, 8, 8, 8, 8, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    fa._FALLBACK_WARNED.clear()


def _model(head_dim: int, shared: int, sliding: bool = True):
    from transformers import AutoModelForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(  # one head dim for every layer: transformers' CB cache sizes all full layers alike
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=head_dim, global_head_dim=head_dim, sliding_window=4,
        layer_types=["sliding_attention" if sliding else "full_attention", "full_attention"] * 2,
        max_position_embeddings=256,
        num_kv_shared_layers=shared, vocab_size_per_layer_input=64, hidden_size_per_layer_input=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("q_norm.weight"):
                p.fill_(0.1)  # scores in a sane range: the log-probabilities compare to fp32 noise
    return net


def _run(net):
    from transformers import GenerationConfig

    config = cb.batching_config(page_size=16, num_blocks=64, max_batch_tokens=16,
                                return_logprobs=True)  # 16 tokens a step: prefill chunks mix with decoding
    gen = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = net.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=config)
    assert all(r.error is None for r in out.values()), [r.error for r in out.values()]
    return [(r.generated_tokens, r.logprobs) for r in sorted(out.values(), key=lambda r: int(r.request_id[4:]))]


def _teacher_forced(truth, runs):
    """Per request, fp32 log-probabilities of its generated tokens after its prompt (one forward each)."""
    out = []
    for prompt, (tokens, _) in zip(PROMPTS, runs):
        seq = torch.tensor([prompt + tokens])
        with torch.no_grad():
            logp = torch.log_softmax(truth(input_ids=seq, use_cache=False).logits[0].double(), -1)
        out.append([logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)])
    return out


def _err(runs, truth_logprobs):
    return max(abs(a - b) for (_, got), want in zip(runs, truth_logprobs) for a, b in zip(got, want))


@pytest.mark.parametrize("head_dim, family", [(64, "fa4"), (384, "ffpa")])
@pytest.mark.parametrize("shared", [0, 2], ids=["own-keys", "kv-shared-layers"])
def test_generate_batch_on_xattn_vs_fp32(head_dim, family, shared):
    net = _model(head_dim, shared).to(torch.bfloat16)
    truth = _model(head_dim, shared)
    truth.load_state_dict({k: v.float() for k, v in net.state_dict().items()})  # the same rounded weights
    sdpa = _run(net)
    stubs.CALLS.clear()
    cb.enable_continuous_batching(net)
    ours = _run(net)
    assert ("fwd", family) in stubs.CALLS  # the (stand-in) kernels ran, not a fallback
    assert [len(t) for t, _ in ours] == [8] * len(PROMPTS)
    err, yardstick = _err(ours, _teacher_forced(truth, ours)), _err(sdpa, _teacher_forced(truth, sdpa))
    assert err <= 1.5 * yardstick + 0.02, (err, yardstick)


def test_the_name_is_one_continuous_batching_accepts():
    from transformers import AttentionInterface

    assert "flash" in cb.NAME and cb.register_continuous_batching() == cb.NAME
    assert AttentionInterface._global_mapping[cb.NAME] is cb.attention_forward


def block_table_decode(d: int, ps: int, window, device="cpu", dtype=torch.float64):
    """HF's decode fast path as transformers' FlashAttention path calls it (one token per request, ``block_table``
    with the layer's page views, key/value the new rows only, -1 in unused table slots) through the adapter:
    returns ``(out [1, 3, Hq, D], [(fp64 reference [1, 1, Hq, D], appended in place)] per request, call)``."""
    from types import SimpleNamespace

    from tests.reference import attention as ref_attention

    g = torch.Generator(device=device).manual_seed(d + ps)
    mk = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)  # noqa: E731
    hq, hkv, pages, max_blocks = 4, 2, 12, 5
    past = [37, 0, ps * 2]  # keys already cached per request
    k_cache, v_cache = mk(pages, ps, hkv, d), mk(pages, ps, hkv, d)
    table = torch.full((3, max_blocks), -1, dtype=torch.int32)
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(d)).tolist()
    for i, n in enumerate(past):
        used = n // ps + 1
        table[i, :used] = torch.tensor(order[:used], dtype=torch.int32)
        order = order[used:]
    table = table.to(device)
    cu_k = torch.tensor([0, *torch.tensor([n + 1 for n in past]).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    query, key, value = mk(1, hq, 3, d), mk(1, hkv, 3, d), mk(1, hkv, 3, d)
    module = SimpleNamespace(is_causal=True, layer_type="full_attention")
    kw = {} if window is None else {"sliding_window": window}

    def call(**extra):
        return cb.attention_forward(module, query, key, value, None, block_table=table, k_cache=k_cache,
                                    v_cache=v_cache, cu_seq_lens_k=cu_k, cu_seq_lens_q=torch.arange(4, device=device),
                                    max_length_q=1, max_length_k=max(past) + 1, scaling=0.3, dropout=0.0,
                                    read_index=None, write_index=None, **kw, **extra)

    out, weights = call()
    assert weights is None and out.shape == (1, 3, hq, d)
    refs = []
    for i, n in enumerate(past):
        rows = k_cache[table[i, :n // ps + 1].long()].flatten(0, 1)[:n + 1]
        vrows = v_cache[table[i, :n // ps + 1].long()].flatten(0, 1)[:n + 1]
        appended = torch.equal(rows[n], key[0, :, i]) and torch.equal(vrows[n], value[0, :, i])
        want, _ = ref_attention(query[:, :, i:i + 1].transpose(1, 2), rows[None], vrows[None], scale=0.3,
                                causal=True, window=(None if window is None else window - 1, 0))
        refs.append((want, appended))
    return out, refs, call


@pytest.mark.parametrize("family, d, ps, window", [("ffpa", 512, 64, None), ("fa4", 64, 16, None), ("fa4", 64, 16, 5)])
def test_block_table_decode_appends_and_attends_over_the_pages(family, d, ps, window):
    """The adapter on HF's decode fast path (:func:`block_table_decode`): the rows appended through the table, the
    attention over the pages equal to fp64 on the gathered keys; softcap raises (no paged kernel has it)."""
    out, refs, call = block_table_decode(d, ps, window)
    assert ("paged", family) in stubs.CALLS
    for i, (want, appended) in enumerate(refs):
        assert appended, i
        torch.testing.assert_close(out[:, i:i + 1], want, atol=1e-6, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="softcap"):
        call(softcap=30.0)


def test_batching_config_across_transformers_versions(monkeypatch):
    """``batching_config`` speaks both spellings: ``page_size`` (5.25 here) and ``block_size`` with no
    ``auto_switch_to_flash`` (5.17, the H200's transformers); an unknown keyword still raises."""
    import dataclasses

    import transformers.generation as generation

    now = cb.batching_config(page_size=16, num_blocks=8)
    assert (now.page_size, now.num_blocks, now.auto_switch_to_flash) == (16, 8, False)

    @dataclasses.dataclass
    class Before:  # transformers 5.17's fields that matter here
        block_size: int = 256
        num_blocks: int | None = None

    monkeypatch.setattr(generation, "ContinuousBatchingConfig", Before)
    assert cb.batching_config(page_size=64, num_blocks=4) == Before(block_size=64, num_blocks=4)
    with pytest.raises(TypeError):
        cb.batching_config(page_size=64, auto_switch_to_flash=True)


def test_older_continuous_batching_contract_is_refused_by_name(monkeypatch):
    """transformers 5.17's continuous batching (``"paged|sdpa"``-style functions that update the cache) is refused
    with the reason before any generate call, not deep inside HF's attention-name check."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert cb.unsupported_reason() is None  # the transformers installed here (5.25)
    keys = ALL_ATTENTION_FUNCTIONS.valid_keys()
    monkeypatch.setattr(type(ALL_ATTENTION_FUNCTIONS), "valid_keys", lambda self: [*keys, "paged|sdpa"])
    with pytest.raises(RuntimeError, match="update the paged cache themselves"):
        cb.enable_continuous_batching(_model(64, 1, False))
