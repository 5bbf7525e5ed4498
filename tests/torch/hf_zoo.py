"""A zoo of tiny random Hugging Face models run with ``attn_implementation="ffpa"``, shared by
test_hf_zoo.py (CPU, kernels replaced by the fp64 stand-in) and test_hf_zoo_gpu.py (real kernels).

Each :class:`Case` is one model family and one input pattern. :func:`compare` runs it three
times on the SAME low-precision-rounded weights: the reference implementation ("sdpa", or
"eager" where the model has no SDPA path) in fp32 (the truth) and in low precision, and "ffpa"
in low precision. Parity is judged noise-relative (as tests/torch/gemma.py): "ffpa" must be
about as close to the truth as the reference implementation in the same precision. The route is
recorded too: the kernel calls of the "ffpa" run (family, mask kind) and the fallbacks xattn logged
("ffpa fallback to TARGET: ... (reason='REASON')", NeMo's format); :func:`assert_case` checks both against the case.

Weights are well conditioned: every ``nn.Linear`` gets std ``in_features ** -0.5``, so attention
scores and logits are O(1) and a wrong mask shows above the bf16 noise.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from tests.reference import rel_err
from xattn.torch import ffpa_attention as fa
from xattn.torch.hf import routing

__all__ = ["Case", "Row", "CASES", "compare", "assert_case", "table", "pytest_params"]

V = 96  # vocab of every text model
_GEN = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True,
            pad_token_id=0, eos_token_id=None, disable_compile=True)


@dataclass
class Case:
    """``make() -> (model class, fresh config)``; ``inputs(device) -> kwargs``; ``run(model, kwargs)``
    -> ``{name: tensor}`` (the outputs that matter; ``"tokens"`` for generate). The route it must take:
    ``kernels`` = kernel launches of the "ffpa" run by mask kind (``causal``, ``window``, ``full``), all
    of family ``kernel_family``, and the fallbacks xattn logs (``"reason->target"``). ``ref``: the
    implementation "ffpa" must match; ``xfail``: why the case fails today (a known bug)."""

    id: str
    family: str
    make: Callable
    inputs: Callable
    run: Callable
    kernels: dict = field(default_factory=dict)
    fallbacks: tuple = ()
    ref: str = "sdpa"
    kernel_family: str = "fa4"
    xfail: str | None = None
    fixed_impls: dict = field(default_factory=dict)  # sub-configs that keep one implementation (Gemma 4's audio)
    grad: bool = False  # run() differentiates (a training step); else it runs under no_grad


@dataclass
class Row:
    family: str
    case: str
    route: str
    reason: str
    err_ffpa: float
    err_sdpa: float
    max_diff: float  # max |ffpa - reference in the same precision|: 0 = bitwise the fallback
    calls: list = field(default_factory=list)  # (family, kind) of each kernel launch
    fallbacks: list = field(default_factory=list)  # "reason->target", in logging order


# --- running and judging ----------------------------------------------------------------------

@contextlib.contextmanager
def _observe(calls: list, fallbacks: list):
    """Record the kernel calls (``xattn.torch.hf.routing.attention``) and the fallback log lines of xattn."""
    kernel = routing.attention

    def counting(q, k, v, **kw):
        windowed = kw.get("window_size", (None, None)) != (None, None)
        calls.append((kw.get("family"), "window" if windowed else "causal" if kw.get("causal") else "full"))
        return kernel(q, k, v, **kw)

    class Grab(logging.Handler):
        def emit(self, record):
            if getattr(record, "reason", None) is not None:  # NeMo's record: reason and target attributes
                fallbacks.append(f"{record.reason}->{record.target}")

    log, handler = logging.getLogger(fa.__name__), Grab(logging.WARNING)
    routing.attention, level = counting, log.level
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        routing.attention = kernel
        log.removeHandler(handler)
        log.setLevel(level)


def _outputs(case: Case, impl: str, dtype, weights, device):
    from transformers.initialization import no_init_weights

    cls, config = case.make()
    with no_init_weights():  # the weights come next
        model = cls._from_config(config, attn_implementation=_impls(case, impl))
    model.load_state_dict(weights)
    model.to(device, dtype).eval()
    assert model.config._attn_implementation == impl
    with contextlib.nullcontext() if case.grad else torch.no_grad():
        return case.run(model, case.inputs(device))


def _impls(case: Case, impl: str):
    """``attn_implementation`` for the case: one name, or per sub-config where some keep a fixed one."""
    if not case.fixed_impls:
        return impl
    _, config = case.make()
    subs = {name: impl for name in getattr(config, "sub_configs", {}) if getattr(config, name, None) is not None}
    return {"": impl, **subs, **case.fixed_impls}


def _condition(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=m.in_features ** -0.5)
    gemma4 = str(getattr(model.config, "model_type", "")).startswith("gemma4")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("mm_input_projection_weight"):  # Gemma 3's projector, x @ W, zero-initialised
                torch.nn.init.normal_(p, std=p.shape[0] ** -0.5)
            if gemma4 and n.endswith("q_norm.weight"):  # Gemma 4 scales by 1.0 after q/k RMS norm: scores
                p.mul_(0.1)                               # ~ sqrt(head_dim) would be one-hot; x0.1 keeps them O(1)


def compare(case: Case, device, dtype=torch.bfloat16) -> Row:
    """Run the case (truth, reference in ``dtype``, "ffpa" in ``dtype``) and return its :class:`Row`."""
    fa.register_ffpa_attention()
    torch.manual_seed(0)
    cls, config = case.make()
    model = cls._from_config(config, attn_implementation=_impls(case, case.ref))
    _condition(model)
    weights = {n: t.to(dtype) if t.is_floating_point() else t for n, t in model.state_dict().items()}
    truth = _outputs(case, case.ref, torch.float32, weights, device)
    low = _outputs(case, case.ref, dtype, weights, device)
    calls, fallbacks = [], []
    fa._FALLBACK_WARNED.clear()
    with _observe(calls, fallbacks):
        ffpa = _outputs(case, "ffpa", dtype, weights, device)
    if "tokens" in truth:
        truth, low, ffpa = _agreeing(truth, low, ffpa)
    diff = max(float((ffpa[n].float() - low[n].float()).abs().max()) for n in ffpa)
    route = "kernels" if calls and not fallbacks else "fallback" if fallbacks and not calls else \
        "kernels+fallback" if calls else "none"
    return Row(case.family, case.id, route, ", ".join(fallbacks), _err(ffpa, truth), _err(low, truth), diff,
               calls, fallbacks)


def _err(out: dict, truth: dict) -> float:
    return rel_err(torch.cat([out[n].double().flatten() for n in truth]),
                   torch.cat([truth[n].double().flatten() for n in truth]))


def _agreeing(truth, low, ffpa):
    """Greedy tokens must equal the truth's; a low-precision run may leave it only at a near tie
    (the truth's top-2 logit gap under 4x the reference's own logit noise). Returns the step
    logits of each row up to its first disagreement (later steps see different prefixes)."""
    t_tok, t_log = truth["tokens"], truth["logits"]  # [B, S], [S, B, V]
    noise = (low["logits"].float() - t_log.float()).abs().amax(-1)  # [S, B]
    top2 = t_log.float().topk(2, -1).values
    gap = top2[..., 0] - top2[..., 1]
    keep = torch.ones_like(t_tok, dtype=torch.bool)
    for name, run in (("reference", low), ("ffpa", ffpa)):
        for b, s in (run["tokens"] != t_tok).nonzero().tolist():
            if keep[b, s:].any():
                tie = gap[s, b] < 4 * noise[:s + 1, b].max()
                assert tie, f"{name} greedy token {s} of row {b} differs from the truth's (gap {gap[s, b]:.3g})"
                keep[b, s:] = False
    pick = lambda r: {"logits": r["logits"].transpose(0, 1)[keep]}  # noqa: E731
    return pick(truth), pick(low), pick(ffpa)


_ECHO = "4d_mask->sdpa"  # logged again when a layer gets the SDPA mask the factory fell back to


def assert_case(case: Case, row: Row, exact=True, slack=1.5, floor=2e-3):
    """The route the case expects, and "ffpa" no further from the truth than ``slack`` x the
    reference in the same precision (plus ``floor``); with ``exact``, a pure fallback must be
    bitwise the reference (the same function on the same mask)."""
    kinds = {}
    for _, kind in row.calls:
        kinds[kind] = kinds.get(kind, 0) + 1
    assert kinds == case.kernels, f"kernel launches by kind: {kinds}, expected {case.kernels}"
    families = set(case.kernel_family.split("+"))
    assert {f for f, _ in row.calls} <= families, row.calls
    reasons = [f for f in row.fallbacks if f != _ECHO or len(row.fallbacks) == 1]
    assert sorted(reasons) == sorted(case.fallbacks), f"fallbacks logged: {row.fallbacks}"
    assert row.err_ffpa <= slack * row.err_sdpa + floor, (row.err_ffpa, row.err_sdpa)
    assert row.err_sdpa < 0.05, "the reference itself is far from the truth: the harness is broken"
    if exact and not row.calls:
        assert row.max_diff == 0.0, f"a pure fallback differs from {case.ref} by {row.max_diff}"


def table(rows) -> str:
    """The rows as a text table; "err" is relative to the fp32 truth, "err sdpa" is the reference
    implementation's own (``sdpa`` or ``eager``), "max diff" is max |ffpa - reference| in low precision."""
    head = ("family", "case", "route", "reason", "err ffpa", "err sdpa", "max diff")
    cells = [head] + [(r.family, r.case, r.route, r.reason or "-", f"{r.err_ffpa:.2e}", f"{r.err_sdpa:.2e}",
                       f"{r.max_diff:.1e}") for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    return "\n".join(" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)


def pytest_params():
    """The cases as pytest params (id "family: case"; a known bug -> strict xfail)."""
    import pytest

    return [pytest.param(c, id=f"{c.family}: {c.id}",
                         marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
            for c in CASES]


# --- inputs -----------------------------------------------------------------------------------

def _ids(b, n, seed=1, low=3):
    return torch.randint(low, V - 8, (b, n), generator=torch.Generator().manual_seed(seed))


def _pad(b, n, left=(), right=()):
    """2D padding mask [b, n]: row i loses ``left[i]`` tokens on the left, ``right[i]`` on the right."""
    mask = torch.ones(b, n, dtype=torch.long)
    for i, p in enumerate(left):
        mask[i, :p] = 0
    for i, p in enumerate(right):
        mask[i, n - p:] = 0
    return mask


def _text(b=2, n=12, left=(3,), right=()):
    def inputs(device):
        return dict(input_ids=_ids(b, n).to(device), attention_mask=_pad(b, n, left, right).to(device))
    return inputs


def _logits(model, kw):
    """LM logits at the real (non-pad) positions."""
    mask = kw.get("attention_mask")
    logits = model(**kw).logits
    return {"logits": logits[mask.bool()] if mask is not None and mask.dim() == 2 else logits}


def _hidden(model, kw):
    return {"hidden": model(**kw).last_hidden_state[kw["attention_mask"].bool()]}


def _generate(**extra):
    def run(model, kw):
        out = model.generate(**kw, **_GEN, **extra)
        return {"tokens": out.sequences[:, -len(out.logits):], "logits": torch.stack(out.logits)}
    return run


# --- models -----------------------------------------------------------------------------------

def llama(head_dim=64, layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)


def modernbert(layers=3, window=8):
    """Layers global, local, local; ``local_attention=8``: each token sees +-4 (bidirectional)."""
    from transformers import ModernBertConfig, ModernBertModel

    return ModernBertModel, ModernBertConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
        local_attention=window, global_attn_every_n_layers=3, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)


def bart():
    from transformers import BartConfig, BartForConditionalGeneration

    return BartForConditionalGeneration, BartConfig(
        vocab_size=V, d_model=128, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)


def gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM, GptOssConfig(
        vocab_size=V, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,  # default length: YaRN stays quiet
        experts_implementation="eager")  # grouped_mm may not take the fp32 truth on every device


def llama4():
    """Layer 0 chunked (RoPE, chunks of 4), layer 1 full causal (NoPE); MoE on layer 1 only."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM, Llama4TextConfig(
        vocab_size=V, hidden_size=128, intermediate_size=128, intermediate_size_mlp=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=4,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, experts_implementation="eager")


IMAGE, BOI, EOI = V - 3, V - 5, V - 4


def _gemma3_text_config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, sliding_window=4, query_pre_attn_scalar=64,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)


def gemma3_text():
    """Sliding (window 4) + full layer, head_dim 64."""
    from transformers import Gemma3ForCausalLM

    return Gemma3ForCausalLM, _gemma3_text_config()


def gemma3(vision_heads=1):
    """The text model of :func:`gemma3_text` and one SigLIP layer (head_dim 64 / ``vision_heads``), 2 x 2
    patches -> 4 image tokens (projector pooling 1)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=vision_heads,
                  image_size=28, patch_size=14)
    return Gemma3ForConditionalGeneration, Gemma3Config(
        text_config=_gemma3_text_config().to_dict(), vision_config=vision, mm_tokens_per_image=4,
        image_token_index=IMAGE, boi_token_index=BOI, eoi_token_index=EOI)


def _gemma3_inputs(device):
    """Row 0: text, [BOI, 4 image tokens, EOI], text; row 1 left-padded by 2."""
    ids = _ids(2, 14)
    ids[:, 3], ids[:, 4:8], ids[:, 8] = BOI, IMAGE, EOI
    mask = _pad(2, 14, left=(0, 2))
    pixels = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(2))
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), pixel_values=pixels.to(device),
                token_type_ids=(ids == IMAGE).long().to(device))


G4_IMAGE, G4_AUDIO, G4_BOI, G4_EOI, G4_BOA, G4_EOA, G4_VIDEO = range(V - 12, V - 5)
G4_PATCH, G4_POOL, G4_MELS = 4, 2, 16


def gemma4(bidirectional_vision=False, audio=False):
    """A tiny multimodal Gemma 4: text (sliding window 4 at head_dim 64 on FA4, full at head_dim 512 on
    FFPA), a 2-layer vision tower (head_dim 64, bidirectional over each image's patches, padded patches
    masked) and optionally the audio tower (eager only in transformers). ``bidirectional_vision``: the
    text's sliding layers see each image block bidirectionally (``use_bidirectional_attention="vision"``)."""
    from transformers import Gemma4AudioConfig, Gemma4Config, Gemma4ForConditionalGeneration, Gemma4TextConfig, \
        Gemma4VisionConfig

    text = Gemma4TextConfig(
        vocab_size=V, vocab_size_per_layer_input=V, hidden_size=128, hidden_size_per_layer_input=16,
        intermediate_size=256, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=512, sliding_window=4,
        max_position_embeddings=128, final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        use_bidirectional_attention="vision" if bidirectional_vision else None)
    vision = Gemma4VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=64, patch_size=G4_PATCH, pooling_kernel_size=G4_POOL,
                                position_embedding_size=64)
    extra = {}
    if audio:
        extra["audio_config"] = Gemma4AudioConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                  subsampling_conv_channels=[G4_MELS, 8], attention_chunk_size=4,
                                                  attention_context_left=5, attention_context_right=0,
                                                  output_proj_dims=48)
    return Gemma4ForConditionalGeneration, Gemma4Config(
        text_config=text, vision_config=vision, image_token_id=G4_IMAGE, audio_token_id=G4_AUDIO,
        boi_token_id=G4_BOI, eoi_token_id=G4_EOI, boa_token_id=G4_BOA, eoa_token_index=G4_EOA,
        video_token_id=G4_VIDEO, **extra)


def _gemma4_image(grid_w, grid_h, max_patches, seed):
    """One image as Gemma 4's processor hands it over: patches ``[max_patches, 3 * p * p]`` in [0, 1] and their
    (x, y) positions, (-1, -1) for padding patches; returns it and its soft-token count."""
    n = grid_w * grid_h
    pixels = torch.zeros(max_patches, 3 * G4_PATCH ** 2)
    pixels[:n] = torch.rand(n, 3 * G4_PATCH ** 2, generator=torch.Generator().manual_seed(seed))
    xs, ys = torch.meshgrid(torch.arange(grid_w), torch.arange(grid_h), indexing="xy")
    pos = torch.full((max_patches, 2), -1, dtype=torch.long)
    pos[:n] = torch.stack([xs.reshape(-1), ys.reshape(-1)], -1)
    return pixels, pos, n // G4_POOL ** 2


def _gemma4_inputs(audio=False, n=20, left=(0, 2)):
    """Two rows, each [text, BOI, image tokens, EOI, text] (row 1 left-padded); the images have 24 of 32 and
    32 of 32 patches (a padded and a full vision row); with ``audio`` row 0 also carries an audio clip."""
    def inputs(device):
        images = [_gemma4_image(6, 4, 32, 3), _gemma4_image(8, 4, 32, 4)]
        ids = _ids(2, n)
        mm = torch.zeros_like(ids)
        for row, (_, _, count) in enumerate(images):
            start = 3 + left[row]
            ids[row, start - 1], ids[row, start:start + count], ids[row, start + count] = G4_BOI, G4_IMAGE, G4_EOI
            mm[row, start:start + count] = 1
        kw = dict(input_ids=ids, attention_mask=_pad(2, n, left=left), mm_token_type_ids=mm,
                  pixel_values=torch.stack([p for p, _, _ in images]),
                  image_position_ids=torch.stack([q for _, q, _ in images]))
        if audio:
            features = torch.randn(2, 24, G4_MELS, generator=torch.Generator().manual_seed(5))
            valid = torch.zeros(2, 24, dtype=torch.bool)
            valid[0, :20] = True  # row 0: 5 audio tokens (two stride-2 convolutions); row 1: none
            tokens = int(valid[0, ::2][::2].sum())
            a = n - tokens - 2
            ids[0, a - 1], ids[0, a:a + tokens], ids[0, a + tokens] = G4_BOA, G4_AUDIO, G4_EOA
            mm[0, a:a + tokens] = 3
            kw.update(input_features=features[:1], input_features_mask=valid[:1])
        return {name: t.to(device) for name, t in kw.items()}
    return inputs


def _train_step(model, kw):
    """A training step's loss and gradients (every attention projection of the text and vision towers)."""
    labels = kw["input_ids"].masked_fill(kw["attention_mask"] == 0, -100)
    loss = model(**kw, labels=labels).loss
    params = [(n, p) for n, p in model.named_parameters() if "self_attn" in n and n.endswith("proj.weight")]
    grads = torch.autograd.grad(loss, [p for _, p in params])
    return {"loss": loss.detach().reshape(1), **{n: g for (n, _), g in zip(params, grads)}}


def _prefix_lm_inputs(device):
    """A caller's 4D bool mask: causal, with the first 4 tokens bidirectional (prefix LM)."""
    n = 10
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    mask[:4, :4] = True
    return dict(input_ids=_ids(2, n).to(device), attention_mask=mask[None, None].expand(2, 1, n, n).to(device))


def _packed_inputs(device):
    """Two rows of packed documents (position_ids restart; no mask, no cache): lengths 5+7 and 3+4+5."""
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(4)) + list(range(5))])
    return dict(input_ids=_ids(2, 12).to(device), position_ids=pos.to(device), use_cache=False)


def _bart_inputs(device):
    src = _ids(2, 12)
    mask = _pad(2, 12, right=(0, 4))
    src[mask == 0] = 1
    return dict(input_ids=src.to(device), attention_mask=mask.to(device),
                decoder_input_ids=_ids(2, 7, seed=3).to(device))


def _bart_generate_inputs(device):
    kw = _bart_inputs(device)
    del kw["decoder_input_ids"]
    return kw


def _bart_run(model, kw):
    out = model(**kw)
    return {"logits": out.logits, "encoder": out.encoder_last_hidden_state[kw["attention_mask"].bool()]}


CASES = [
    Case("forward, left padded, d64", "llama", lambda: llama(64), _text(), _logits, dict(causal=2)),
    Case("forward, left padded, d128", "llama", lambda: llama(128), _text(), _logits, dict(causal=2)),
    Case("forward, right padded", "llama", llama, _text(left=(), right=(0, 3)), _logits, fallbacks=("mask->sdpa",)),
    Case("packed documents (position_ids)", "llama", llama, _packed_inputs, _logits, dict(causal=2)),
    Case("generate dynamic, left padded", "llama", llama, _text(n=8), _generate(), dict(causal=10)),
    Case("generate static", "llama", llama, _text(n=8, left=()), _generate(cache_implementation="static"),
         dict(causal=10)),
    Case("generate static, left padded", "llama", llama, _text(n=8), _generate(cache_implementation="static"),
         dict(causal=10)),
    Case("user 4D bool mask", "llama", llama, _prefix_lm_inputs, _logits, fallbacks=("4d_mask->sdpa",)),
    Case("global+local, left padded", "modernbert", modernbert, _text(n=14), _hidden, dict(full=1, window=2)),
    Case("global+local, right padded", "modernbert", modernbert, _text(n=14, left=(), right=(3,)), _hidden,
         dict(full=1), fallbacks=("mask->sdpa",)),
    Case("enc/dec/cross, right padded", "bart", bart, _bart_inputs, _bart_run, dict(full=2, causal=1)),
    Case("generate, right padded source", "bart", bart, _bart_generate_inputs, _generate(),
         dict(full=6, causal=5)),
    Case("sinks (s_aux), left padded", "gpt-oss", gpt_oss, _text(), _logits, fallbacks=("s_aux->eager",),
         ref="eager"),
    Case("chunked + full, left padded", "llama4", llama4, _text(), _logits, dict(causal=1),
         fallbacks=("mask_function->sdpa",)),
    Case("text: generate, sliding 4, left padded", "gemma3", gemma3_text, _text(n=8), _generate(),
         dict(window=5, causal=5)),
    Case("image tokens, left padded", "gemma3", gemma3, _gemma3_inputs, _logits, dict(full=1),
         fallbacks=("mask_function->sdpa",)),
    Case("image tokens, vision d32 (all fallback)", "gemma3", lambda: gemma3(vision_heads=2), _gemma3_inputs,
         _logits, fallbacks=("ffpa_unavailable->sdpa", "mask_function->sdpa")),
    # Gemma 4 multimodal: vision layers (bidirectional, padded patches) run FA4 varlen, the text's sliding layer
    # FA4 with its window, the full layer FFPA at head_dim 512 (left padding: varlen)
    Case("image tokens, left padded", "gemma4", gemma4, _gemma4_inputs(), _logits, dict(full=2, window=1, causal=1),
         kernel_family="fa4+ffpa"),
    Case("image tokens, training step", "gemma4", gemma4, _gemma4_inputs(), _train_step,
         dict(full=2, window=1, causal=1), kernel_family="fa4+ffpa", grad=True),
    Case("image tokens, generate", "gemma4", gemma4, _gemma4_inputs(n=16), _generate(),
         dict(full=2, window=5, causal=5), kernel_family="fa4+ffpa"),
    Case("image tokens, bidirectional vision blocks", "gemma4", lambda: gemma4(bidirectional_vision=True),
         _gemma4_inputs(), _logits, dict(full=2, causal=1), kernel_family="fa4+ffpa",
         fallbacks=("mask_function->sdpa",)),
    Case("image + audio tokens", "gemma4", lambda: gemma4(audio=True), _gemma4_inputs(audio=True), _logits,
         dict(full=2, window=1, causal=1), kernel_family="fa4+ffpa", fixed_impls={"audio_config": "eager"}),
]
