"""NeMo AutoModel's unit tests of the two modules xattn replaces, as cases of our own, on the CPU (the kernels
are the fp64 stand-ins where a case needs them to run): ``ffpa_attention``'s routing, fallbacks and their
warnings, registration and mask factory, and ``fa4``'s imports, varlen segments and document-causal layouts.

Most of all the hooks. NeMo's module routes each call through its own module-level functions and NeMo's tests
replace them there (``monkeypatch.setattr(module, "_get_sdpa", fake)``, ``mock.patch.object``), or replace the
function a hook returns (HF Gemma 4's ``eager_attention_forward``); the next call must use the replacement.
Each hook case here fails where the routing does not look the hook up when the call runs.

Where xattn deliberately does more than NeMo (setup with packing and context parallelism, a plan from the mask
factory for causal layers, FA4 as the sliding backend, the kernels for head dims other than 512) the cases
assert what xattn does; docs/torch.md lists those upstream tests. GPU twins: test_nemo_unit_gpu.py.
"""

import logging
from unittest import mock

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.reference import attention as ref_attention, rel_err  # noqa: E402
from xattn.torch import fa4, ffpa_attention as fa  # noqa: E402
from xattn.torch.hf import fallback, support  # noqa: E402

from . import stubs  # noqa: E402
from .fa4_reference import document_causal_mask, sdpa_reference  # noqa: E402

BF16, F64 = torch.bfloat16, torch.float64
# NeMo's tiles for FlexAttention above head dim 256 (its default tiles do not fit in shared memory)
SMALL_FLEX_TILES = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_M1": 32, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 32,
                    "num_stages": 1, "num_warps": 4}


@pytest.fixture(autouse=True)
def fresh_warnings():
    fa._FALLBACK_WARNED.clear()
    yield
    fa._FALLBACK_WARNED.clear()


@pytest.fixture
def kernels(monkeypatch):
    """The kernels "run here": the fp64 stand-ins in place of the launches."""
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None)


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(support, "kernels_available", lambda: "no GPU (test)")


class _Layer(torch.nn.Module):
    """A bare attention layer as NeMo's tests build one: a head dim, a training flag, nothing else (no
    ``num_key_value_groups``, no modeling file with an eager function)."""

    def __init__(self, head_dim: int, training: bool = False, is_causal: bool = True):
        super().__init__()
        self.head_dim, self.is_causal = head_dim, is_causal
        self.train(training)


class _Recorder:
    """An attention function that records its calls and returns zeros shaped as HF's output ``[B, Nq, Hq, Dv]``."""

    def __init__(self):
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append(dict(module=module, query=query, key=key, value=value, mask=attention_mask, **kwargs))
        b, hq, nq, _ = query.shape
        return torch.zeros(b, nq, hq, value.shape[-1], dtype=query.dtype), None


def _qkv(b=1, hq=8, hkv=4, n=16, d=512, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _reasons(caplog) -> list[str]:
    return [r.reason for r in caplog.records if r.name == fa.logger.name]


def _causal_reference(q, k, v, scale):
    """fp64 causal reference of SDPA-layout q/k/v, returned as HF's output ``[B, N, H, D]``."""
    out, _ = ref_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=scale, causal=True)
    return out


# --- hooks: a replacement on the facade is what the next call uses ----------------------------------------

def test_the_facade_holds_xattns_own_hooks_until_replaced(monkeypatch):
    from xattn.torch.hf import hooks

    for name in hooks.HOOKS:
        assert callable(getattr(fa, name)) and hooks.replaced(name) is None, name
    monkeypatch.setattr(fa, "_get_flex", lambda: None)
    assert hooks.replaced("_get_flex") is fa._get_flex and hooks.replaced("_get_sdpa") is None


def test_setup_calls_register_as_the_facade_holds_it():
    with mock.patch.object(fa, "register_ffpa_attention") as register:
        assert fa.setup_ffpa_backend(cp_size=1, has_packed_sequence=False) is None
    register.assert_called_once_with()


@pytest.mark.parametrize("replace", ["hook", "function it returns"])
def test_sdpa_hook_without_a_function_degrades_to_the_eager_hook(no_kernels, monkeypatch, replace):
    """``_get_sdpa()`` giving None: the call runs on ``_get_eager()``'s function (HF Gemma 4's eager), handed a
    view of the layer with ``num_key_value_groups`` (HF's eager functions repeat K/V heads by it)."""
    eager = _Recorder()
    monkeypatch.setattr(fa, "_get_sdpa", lambda: None)
    if replace == "hook":
        monkeypatch.setattr(fa, "_get_eager", lambda: eager)
    else:
        gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
        monkeypatch.setattr(gemma4, "eager_attention_forward", eager)
    q, k, v = _qkv(hq=4, hkv=2, n=8, d=64)
    out, weights = fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.125)
    (call,) = eager.calls
    assert call["module"].num_key_value_groups == 2 and call["module"].head_dim == 64
    assert call["query"] is q and call["scaling"] == 0.125 and call["softcap"] is None
    assert out.shape == (1, 8, 4, 64) and weights is None


def test_softcap_runs_on_the_eager_hook_never_on_sdpa(kernels, monkeypatch, caplog):
    gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
    eager, sdpa = _Recorder(), _Recorder()
    monkeypatch.setattr(gemma4, "eager_attention_forward", eager)
    monkeypatch.setattr(fa, "_get_sdpa", lambda: sdpa)
    q, k, v = _qkv(n=8)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        fa.ffpa_attention_forward(_Layer(512), q, k, v, None, softcap=50.0, scaling=0.0442)
    assert len(eager.calls) == 1 and eager.calls[0]["softcap"] == 50.0 and not sdpa.calls
    assert _reasons(caplog) == ["softcap"] and caplog.records[-1].target == "eager"
    assert not stubs.CALLS


def test_low_level_ready_hook_false_keeps_calls_off_the_kernels(kernels, monkeypatch, caplog):
    q, k, v = _qkv(hq=4, hkv=2, n=12)
    with mock.patch.object(fa, "_ffpa_low_level_ready", return_value=False) as ready, \
            caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, _ = fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05)
    ready.assert_called()
    assert not stubs.CALLS and _reasons(caplog) == ["ffpa_unavailable"]
    assert rel_err(out, _causal_reference(q, k, v, 0.05)) < 1e-2  # SDPA, exact
    fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05)
    assert stubs.CALLS == [("fwd", "ffpa")]  # the hook restored: the kernels again


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_dense_ffpa_calls_a_replaced_high_level_function_as_nemo_does(no_kernels, causal):
    """NeMo's dense path: ``fn, backend = _get_ffpa_high_level()`` then ``fn(q, k, v, attn_mask=None,
    dropout_p=0.0, is_causal=..., scale=..., enable_gqa=True, backend=backend)`` on SDPA layout ``[B, H, N, D]``,
    returning ``[B, Hq, N, D]``; the layer's output is its transpose. ``_ffpa_low_level_ready`` says yes."""
    q, k, v = _qkv()
    backend, calls = object(), []

    def high_level_fn(*args, **kwargs):
        calls.append((args, kwargs))
        return torch.ones(1, 8, 16, 512, dtype=BF16)

    with mock.patch.object(fa, "_ffpa_low_level_ready", return_value=True), \
            mock.patch.object(fa, "_get_ffpa_high_level", return_value=(high_level_fn, backend)):
        out, weights = fa.ffpa_attention_forward(_Layer(512, is_causal=causal), q, k, v, None, dropout=0.0,
                                                 scaling=0.0442)
    ((args, kwargs),) = calls
    assert args == (q, k, v) and kwargs == dict(attn_mask=None, dropout_p=0.0, is_causal=causal, scale=0.0442,
                                                enable_gqa=True, backend=backend)
    assert out.shape == (1, 16, 8, 512) and out.is_contiguous() and bool((out == 1).all()) and weights is None


def test_high_level_hook_without_a_function_falls_back(kernels, monkeypatch, caplog):
    monkeypatch.setattr(fa, "_get_ffpa_high_level", lambda: (None, None))
    q, k, v = _qkv(hq=4, hkv=2, n=12)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, _ = fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05)
    assert not stubs.CALLS and _reasons(caplog) == ["ffpa_attn_func_unavailable"]
    assert rel_err(out, _causal_reference(q, k, v, 0.05)) < 1e-2


def test_high_level_hook_is_for_dense_ffpa_calls_only(kernels, monkeypatch):
    """FA4 head dims and sliding windows stay on xattn's own path when ``_get_ffpa_high_level`` is replaced."""
    monkeypatch.setattr(fa, "_get_ffpa_high_level", mock.Mock(side_effect=AssertionError("not NeMo's dense path")))
    q, k, v = _qkv(hq=4, hkv=2, n=12, d=128)
    fa.ffpa_attention_forward(_Layer(128), q, k, v, None, scaling=0.05)
    q, k, v = _qkv(hq=4, hkv=2, n=12)
    fa.ffpa_attention_forward(_Layer(512), q, k, v, None, scaling=0.05, sliding_window=4)  # no FFPA window
    assert stubs.CALLS == [("fwd", "fa4")]


def test_block_mask_hook_routes_to_the_flex_hook_not_sdpa(monkeypatch):
    flex, sdpa = _Recorder(), _Recorder()
    monkeypatch.setattr(fa, "_is_block_mask", lambda mask: True)
    monkeypatch.setattr(fa, "_get_flex", lambda: flex)
    monkeypatch.setattr(fa, "_get_sdpa", lambda: sdpa)
    q, k, v = _qkv(d=256)
    marker = object()
    out, weights = fa.ffpa_attention_forward(_Layer(256), q, k, v, attention_mask=marker, scaling=0.0625)
    (call,) = flex.calls
    assert call["mask"] is marker and call["scaling"] == 0.0625 and not sdpa.calls
    assert out.shape == (1, 16, 8, 256) and weights is None


@pytest.mark.parametrize("d, given, expected", [
    pytest.param(512, None, SMALL_FLEX_TILES, id="d512-small-tiles"),
    pytest.param(256, None, None, id="d256-flex-defaults"),
    pytest.param(512, {"BLOCK_M": 64}, {"BLOCK_M": 64}, id="d512-caller-options-kept"),
])
def test_flex_tiles_above_head_dim_256(monkeypatch, d, given, expected):
    flex = _Recorder()
    monkeypatch.setattr(fa, "_is_block_mask", lambda mask: True)
    monkeypatch.setattr(fa, "_get_flex", lambda: flex)
    q, k, v = _qkv(d=d)
    extra = {} if given is None else {"kernel_options": given}
    fa.ffpa_attention_forward(_Layer(d), q, k, v, attention_mask=object(), scaling=0.05, **extra)
    assert flex.calls[0].get("kernel_options") == expected


def test_block_mask_without_flex_raises_and_never_runs_sdpa(monkeypatch):
    sdpa = _Recorder()
    monkeypatch.setattr(fa, "_is_block_mask", lambda mask: True)
    monkeypatch.setattr(fa, "_get_flex", lambda: None)
    monkeypatch.setattr(fa, "_get_sdpa", lambda: sdpa)
    q, k, v = _qkv(d=256)
    with pytest.raises(RuntimeError, match="flex_attention_forward") as err:
        fa.ffpa_attention_forward(_Layer(256), q, k, v, attention_mask=object(), scaling=0.0625)
    assert isinstance(err.value, ImportError) and not sdpa.calls  # also an ImportError, with the pip hint


def test_a_replacement_counts_while_it_is_in_place(kernels, monkeypatch):
    """A hook replaced with ``mock.patch.object`` is used inside the ``with`` only; xattn's own tests may keep
    replacing the implementation module's function (``fallback.get_sdpa``) instead."""
    q, k, v = _qkv(hq=4, hkv=2, n=12, d=64)
    monkeypatch.setattr(fa, "_ffpa_low_level_ready", lambda: False)
    sdpa = _Recorder()
    with mock.patch.object(fa, "_get_sdpa", return_value=sdpa):
        fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.1)
    assert len(sdpa.calls) == 1
    fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.1)
    assert len(sdpa.calls) == 1
    monkeypatch.setattr(fallback, "get_sdpa", lambda: sdpa)
    fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.1)
    assert len(sdpa.calls) == 2


def test_import_fa4_modules_goes_through_safe_import(monkeypatch):
    asked = []

    def safe_import(name):
        asked.append(name)
        return name != "cutlass.cute", None

    monkeypatch.setattr(fa4, "safe_import", safe_import)
    with pytest.raises(ImportError, match=r"could not import cutlass\.cute\. pip install flash-attn-4"):
        fa4.import_fa4_modules("flash_attn.cute.interface", "cutlass.cute")
    assert asked == ["flash_attn.cute.interface", "cutlass.cute"]


def test_safe_import_answers_as_nemos():
    import json

    assert fa4.safe_import("json") == (True, json)
    ok, err = fa4.safe_import("xattn.no_such_module")
    assert not ok and isinstance(err, ImportError)
    with pytest.raises(ImportError, match=r"could not import xattn\.no_such_module \(No module named"):
        fa4.import_fa4_modules("json", "xattn.no_such_module")


# --- which reason is named, and how often ---------------------------------------------------------------

@pytest.mark.parametrize("case, reason", [
    pytest.param(dict(dtype=torch.float32), "dtype", id="float32"),
    pytest.param(dict(training=True, dropout=0.1), "dropout", id="training-dropout"),
    pytest.param(dict(scaling=None), "scaling", id="no-scaling"),
    pytest.param(dict(kernels=False), "ffpa_unavailable", id="no-kernels"),
    pytest.param({}, "4d_mask", id="only-the-mask"),
])
def test_a_4d_mask_call_names_the_first_reason_in_nemos_order(monkeypatch, caplog, case, reason):
    """NeMo checks dtype, softcap, dropout, scaling and the kernels before the mask: a float32 call with a 4D
    mask warns about the dtype. Five calls, one warning."""
    stubs.install(monkeypatch)
    monkeypatch.setattr(support, "kernels_available", lambda: None if case.get("kernels", True) else "no GPU")
    q, k, v = _qkv(dtype=case.get("dtype", BF16))
    mask = torch.zeros(1, 1, 16, 16, dtype=q.dtype)
    sdpa = _Recorder()
    monkeypatch.setattr(fa, "_get_sdpa", lambda: sdpa)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        for _ in range(5):
            fa.ffpa_attention_forward(_Layer(512, training=case.get("training", False)), q, k, v, mask,
                                      dropout=case.get("dropout", 0.0), scaling=case.get("scaling", 0.0442))
    assert _reasons(caplog) == [reason]
    assert len(sdpa.calls) == 5 and all(c["mask"] is mask for c in sdpa.calls) and not stubs.CALLS


@pytest.mark.parametrize("case, reason, target", [
    pytest.param(dict(dtype=torch.float32), "dtype", "sdpa", id="float32"),
    pytest.param(dict(training=True, dropout=0.1), "dropout", "sdpa", id="training-dropout"),
    pytest.param(dict(scaling=None), "scaling", "sdpa", id="no-scaling"),
    pytest.param(dict(softcap=50.0), "softcap", "eager", id="softcap"),
])
def test_each_reason_falls_back_exactly_and_warns_once(kernels, caplog, case, reason, target):
    q, k, v = _qkv(hq=4, hkv=2, n=12, dtype=case.get("dtype", BF16))
    layer = _Layer(512, training=case.get("training", False))
    kw = dict(dropout=case.get("dropout", 0.0), scaling=case.get("scaling", 0.05), softcap=case.get("softcap"))
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        for _ in range(3):
            out, _ = fa.ffpa_attention_forward(layer, q, k, v, None, **kw)
    assert _reasons(caplog) == [reason] and caplog.records[0].target == target and not stubs.CALLS
    assert out.shape == (1, 12, 4, 512)
    if reason in ("dtype", "scaling"):  # deterministic fallbacks: SDPA at the layer's (or SDPA's default) scale
        assert rel_err(out, _causal_reference(q, k, v, 0.05 if kw["scaling"] else 512 ** -0.5)) < 1e-2


# --- registration ------------------------------------------------------------------------------------------

def test_register_again_once_hf_lost_the_name(monkeypatch):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    fa.register_ffpa_attention()
    for registry in (AttentionInterface._global_mapping, AttentionMaskInterface._global_mapping):
        monkeypatch.delitem(registry, "ffpa")
    assert fa.register_ffpa_attention() is True
    assert fa.register_ffpa_attention() is False
    assert AttentionInterface._global_mapping["ffpa"] is fa.ffpa_attention_forward
    assert AttentionMaskInterface._global_mapping["ffpa"] is fa.ffpa_mask
    assert fa._REGISTERED is True


# --- supersets: what xattn does where NeMo refuses or does less (docs/torch.md lists them) --------------------

def test_setup_accepts_packing_and_asks_for_a_group_for_context_parallelism():
    """NeMo raises ValueError for both; xattn runs packed documents on the kernels, and context parallelism on the
    group handed over (none here: the ValueError names what is missing, not that CP is refused)."""
    with mock.patch.object(fa, "register_ffpa_attention") as register:
        assert fa.setup_ffpa_backend(1, True) is None
    register.assert_called_once_with()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        fa.setup_ffpa_backend(8, False)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_other_than_512_run_on_fa4(kernels, caplog, d):
    """NeMo sends every head dim but 512 to SDPA, silently; xattn runs FA4 there."""
    q, k, v = _qkv(hq=4, hkv=2, n=12, d=d)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        out, _ = fa.ffpa_attention_forward(_Layer(d), q, k, v, None, scaling=0.1)
    assert stubs.CALLS == [("fwd", "fa4")] and not _reasons(caplog)
    assert rel_err(out, _causal_reference(q, k, v, 0.1)) < 1e-2


def test_head_dims_other_than_512_without_kernels_warn_once(no_kernels, caplog):
    q, k, v = _qkv(hq=4, hkv=2, n=12, d=64)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        for _ in range(3):
            out, _ = fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.1)
    assert _reasons(caplog) == ["ffpa_unavailable"]
    assert rel_err(out, _causal_reference(q, k, v, 0.1)) < 1e-2


def test_cpu_tensors_on_a_gpu_machine_run_on_the_fallback(monkeypatch, caplog):
    """NeMo's unit tests hand CPU tensors to the layer on its GPU CI machines: where the kernels run (the probe
    says yes, a GPU is there, the core's own launchers are in place) a CPU call falls back, once warned."""
    monkeypatch.setattr(support, "kernels_available", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q, k, v = _qkv(hq=4, hkv=2, n=12, d=64)
    with caplog.at_level(logging.WARNING, logger=fa.logger.name):
        for _ in range(2):
            out, _ = fa.ffpa_attention_forward(_Layer(64), q, k, v, None, scaling=0.1)
    assert _reasons(caplog) == ["ffpa_unavailable"] and "CUDA tensors" in caplog.records[0].getMessage()
    assert rel_err(out, _causal_reference(q, k, v, 0.1)) < 1e-2


def test_factory_plans_causal_layers_where_nemo_returns_none():
    from transformers import masking_utils as mu

    with mock.patch.object(mu, "flex_attention_mask") as flex_mask:
        mask = fa.ffpa_mask(batch_size=1, q_length=8, kv_length=8, mask_function=mu.causal_mask_function,
                            attention_mask=None, device="cpu")
    flex_mask.assert_not_called()
    assert isinstance(mask, torch.Tensor) and mask.plan.causal
    torch.testing.assert_close(mask.to(torch.bool), torch.ones(8, 8, dtype=torch.bool).tril().expand(1, 1, 8, 8))


class _Config:
    model_type = "gemma4_text"

    def __init__(self, backend=None):
        if backend is not None:
            self.ffpa_sliding_attn_backend = backend


@pytest.mark.parametrize("backend", [None, "fa4", "flex"])
def test_sliding_layers_run_where_the_backend_knob_says(backend):
    """NeMo builds a flex BlockMask for every non-causal layer; xattn does when ``ffpa_sliding_attn_backend`` is
    "flex", and plans FA4 (its default) otherwise."""
    from transformers import masking_utils as mu

    sliding = mu.sliding_window_causal_mask_function(4)
    block_mask = object()
    with mock.patch.object(mu, "flex_attention_mask", return_value=block_mask) as flex_mask:
        mask = fa.ffpa_mask(batch_size=1, q_length=8, kv_length=8, mask_function=sliding, attention_mask=None,
                            device="cpu", config=_Config(backend))
    if backend == "flex":
        flex_mask.assert_called_once()
        assert mask is block_mask
    else:
        flex_mask.assert_not_called()
        assert mask.plan.window == (3, 0)


# --- fa4: varlen segments and NeMo's document layouts ---------------------------------------------------

@pytest.mark.parametrize("ids, q_len, start, q_lens, k_lens", [
    pytest.param([[1, 1, 1, 2, 2, 2, 2, 0]], 2, 4, [0, 2, 0, 0], [3, 3, 1, 1], id="shard-splits-its-document"),
    pytest.param([[1, 1, 2, 2], [1, 1, 1, 0]], 4, 0, [2, 2, 3, 1], [2, 2, 3, 1], id="segments-tile-every-row"),
])
def test_varlen_segments_of_nemos_examples(ids, q_len, start, q_lens, k_lens):
    assert fa4._varlen_segments(torch.tensor(ids), q_len, start) == (q_lens, k_lens)


def nemo_layout(name: str, global_len: int) -> torch.Tensor:
    """The document ids of NeMo's GPU cases, scaled to ``global_len`` keys: ``[B, global_len]``."""
    at = lambda frac: int(global_len * frac)  # noqa: E731
    ids = torch.ones(2 if name == "two_rows" else 1, global_len, dtype=torch.int32)
    if name in ("packed", "two_rows"):
        ids[0, at(1 / 3):], ids[0, at(3 / 4):], ids[0, global_len - 3:] = 2, 3, 0
    if name == "two_rows":
        ids[1, at(0.6):], ids[1, at(0.6) + 1:] = 2, 3  # document 2 is one token long
    if name == "left_pad":
        ids[:, :at(0.07)] = 0
    if name == "empty_rank":
        ids[:, global_len // 2:] = 0  # the second half of the keys, so the second shard, is padding only
    return ids


NEMO_CASES = [  # (layout, q_global_start, local length) of NeMo's GPU cases, over 512 keys
    ("causal", 0, 512), ("packed", 0, 512), ("left_pad", 0, 512), ("causal", 0, 256), ("causal", 256, 256),
    ("packed", 256, 256), ("empty_rank", 256, 256), ("two_rows", 128, 256)]


@pytest.mark.parametrize("layout, start, local", [pytest.param(*c, id="-".join(map(str, c))) for c in NEMO_CASES])
def test_document_causal_layouts_of_nemos_cases(monkeypatch, layout, start, local):
    """Forward and gradients of ``document_causal_fa4_attention`` on NeMo's layouts (at 1/16 of its sizes, 192/128
    head dims; FA4's sm90 has no 192/128 backward under GQA) against the masked fp64 reference; padding queries are
    exactly zero."""
    stubs.install(monkeypatch)
    fa4._LAYOUT_CACHE.clear()
    fa4._LAYOUT_GENERATION[:] = [None, None]
    kv_ids = nemo_layout(layout, 32)
    start, local = start // 16, local // 16
    q_ids = kv_ids[:, start:start + local]
    g = torch.Generator().manual_seed(local + start)
    b = kv_ids.shape[0]
    q, k, v = (torch.randn(*s, dtype=F64, generator=g).requires_grad_()
               for s in ((b, 4, local, 192), (b, 4, 32, 192), (b, 4, 32, 128)))
    dout = torch.randn(b, 4, local, 128, dtype=F64, generator=g)
    out = fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, 192 ** -0.5)
    keep = q_ids > 0
    want = sdpa_reference(q, k, v, document_causal_mask(q_ids, kv_ids, start), 192 ** -0.5, keep_queries=keep)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                              torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=name)  # the core keeps lse in fp32
    assert torch.all(out.masked_select(~keep[:, None, :, None]) == 0)
