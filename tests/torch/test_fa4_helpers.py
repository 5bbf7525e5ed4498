"""FA4 helpers (CPU, core replaced by the fp64 reference stand-in): segment layout worked examples, the
SDPA layout of the helpers (shapes where heads != sequence, so a transposed layout cannot pass),
document-causal attention against an explicitly masked reference, the per-step layout cache, the
flash_attn-style entry points of ``_load_fa4`` and the errors for what cannot be right."""

import ast
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch

from xattn.torch import fa4, fa4_interface

from . import stubs
from .fa4_reference import causal_mask, document_causal_mask, sdpa_reference

F64 = torch.float64


@pytest.fixture(autouse=True)
def stub_core(monkeypatch):
    stubs.install(monkeypatch)
    fa4._LAYOUT_CACHE.clear()
    fa4._LAYOUT_GENERATION[:] = [None, None]


def _rand(*shape, seed=0, grad=False):
    t = torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))
    return t.requires_grad_(grad)


@pytest.mark.parametrize("ids, q_len, start, q_lens, k_lens", [
    ([[1, 1, 1, 2, 2, 2, 2, 0]], 2, 4, [0, 2, 0, 0], [3, 3, 1, 1]),
    ([[1, 1, 1, 2, 2, 2, 2, 0]], 8, 0, [3, 4, 1], [3, 4, 1]),
    # row 0: one run (ends at the shard end); row 1: runs 1 | 2,2 | 0, the shard covers 2,0
    ([[5, 5, 5, 5], [1, 2, 2, 0]], 2, 2, [2, 0, 1, 1], [4, 1, 2, 1]),
])
def test_varlen_segments(ids, q_len, start, q_lens, k_lens):
    got_q, got_k = fa4._varlen_segments(torch.tensor(ids), q_len, start)
    assert (got_q, got_k) == (q_lens, k_lens)
    assert sum(got_k) == torch.tensor(ids).numel() and sum(got_q) == q_len * len(ids)


def test_shard_outside_keys_is_refused():
    with pytest.raises(ValueError, match="outside"):
        fa4._varlen_segments(torch.tensor([[1, 1, 1]]), 2, 2)
    with pytest.raises(ValueError, match="q_global_start"):
        fa4._varlen_layout(torch.tensor([[1, 1]]), torch.tensor([[1, 1, 1]]), 2)


def test_varlen_layout_values_device_dtype_and_step_cache():
    kv = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 4, 4, 0, 0]])
    cu_q, cu_k, max_q, max_k = layout = fa4._varlen_layout(kv[:, 4:], kv, 4)
    q_lens, k_lens = fa4._varlen_segments(kv, 4, 4)
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.device == kv.device
    assert cu_q.tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert cu_k.tolist() == [0, *torch.tensor(k_lens).cumsum(0).tolist()]
    assert (max_q, max_k) == (max(q_lens), max(k_lens)) and isinstance(max_q, int)
    assert fa4._varlen_layout(kv[:, 4:], kv, 4) is layout                      # same step: cached
    assert fa4._varlen_layout(kv[:, 4:], kv[:, :], 4) is layout                # a view of the same ids too
    assert fa4._varlen_layout(kv[:, 4:].clone(), kv.clone(), 4) is layout      # equal values: the same layout
    assert fa4._LAYOUT_GENERATION[0] is not kv                                # a private copy, not the caller's
    kv[1, 6:] = 4                                                             # in place: a new step
    fresh = fa4._varlen_layout(kv[:, 4:], kv, 4)
    assert fresh is not layout and fresh[1].tolist() == [0, 3, 7, 8, 12, 16]


def test_layout_never_stale_when_a_new_ids_tensor_reuses_an_address():
    """Each step's ids tensor dies before the next is made, so CPython hands the next one the same address
    (id) and the same ``_version`` 0: a cache keyed by id + version served the previous step's layout."""
    gen = torch.Generator().manual_seed(3)
    for step in range(60):
        kv = torch.randint(0, 3, (2, 12), generator=gen)   # same shape every step, new values
        got = fa4._varlen_layout(kv[:, 5:], kv, 5)
        q_lens, k_lens = fa4._varlen_segments(kv, 7, 5)
        assert got[0].tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()], step
        assert got[1].tolist() == [0, *torch.tensor(k_lens).cumsum(0).tolist()], step
        del kv, got


def _refill_writers():
    """Ways to rewrite ids in place that torch's version counter does not see (or that have none)."""
    def numpy_write(ids, new):
        ids.numpy()[:] = new.numpy()

    def data_write(ids, new):
        ids.data.copy_(new)

    def inference_write(ids, new):
        ids.copy_(new)
    return [pytest.param(numpy_write, False, id="numpy"), pytest.param(data_write, False, id="data"),
            pytest.param(inference_write, True, id="inference_mode")]


@pytest.mark.parametrize("write, inference", _refill_writers())
def test_layout_follows_ids_refilled_in_place(write, inference):
    """Issue #22 case 4: a refilled kv_doc_ids must never reuse the previous values' segments (the old cache
    keyed on the version counter, which these writes do not bump or which inference tensors lack)."""
    ctx = torch.inference_mode() if inference else torch.no_grad()
    with ctx:
        kv = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0]])
        first = fa4._varlen_layout(kv[:, 4:], kv, 4)
        write(kv, torch.tensor([[1, 2, 2, 2, 3, 3, 0, 0]]))
        got = fa4._varlen_layout(kv[:, 4:], kv, 4)
    q_lens, k_lens = fa4._varlen_segments(torch.tensor([[1, 2, 2, 2, 3, 3, 0, 0]]), 4, 4)
    assert got is not first
    assert got[0].tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert got[1].tolist() == [0, *torch.tensor(k_lens).cumsum(0).tolist()]


def test_q_doc_ids_must_be_the_shard_of_kv_doc_ids():
    kv = torch.tensor([[1, 1, 2, 2, 2, 0]])
    with pytest.raises(ValueError, match="q_doc_ids: must equal"):
        fa4._varlen_layout(torch.tensor([[1, 1, 2]]), kv, 1)
    with pytest.raises(TypeError, match="kv_doc_ids"):
        fa4._varlen_layout(kv[:, :2], kv.float(), 0)
    with pytest.raises(TypeError, match="q_global_start"):
        fa4._varlen_layout(kv[:, :2], kv, 0.0)


@pytest.mark.parametrize("start, nq, d, dv", [(0, 10, 128, 128), (4, 6, 192, 128), (7, 3, 128, 128)])
def test_document_causal_matches_masked_reference(start, nq, d, dv):
    kv_ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 0], [3, 3, 3, 3, 3, 4, 4, 5, 0, 0]])
    q_ids = kv_ids[:, start:start + nq]
    hq = 4 if d == dv else 2  # FA4's sm90 backward runs 192/128 without GQA only (the core refuses it)
    q, k, v = _rand(2, hq, nq, d, seed=1, grad=True), _rand(2, 2, 10, d, seed=2, grad=True), \
        _rand(2, 2, 10, dv, seed=3, grad=True)
    out = fa4.document_causal_fa4_attention(q, k, v, q_ids, kv_ids, start, 0.1)
    assert out.shape == (2, hq, nq, dv)
    ref = sdpa_reference(q, k, v, document_causal_mask(q_ids, kv_ids, start), 0.1, keep_queries=q_ids != 0)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    assert torch.all(out[(q_ids == 0)[:, None].expand_as(out[..., 0])] == 0)   # padding queries zero
    dout = _rand(*out.shape, seed=4)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):  # the core keeps lse in fp32
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("pad_id", [0, -1, -7])
def test_document_causal_zeroes_every_padding_id_and_keeps_no_nan(pad_id):
    """Issue #22 case 5: padding ids are ``<= 0`` (NeMo), not only 0; their rows are 0 even when the
    attention of a padding run is NaN (``masked_fill``, not a multiplication that keeps NaN)."""
    kv_ids = torch.tensor([[pad_id, pad_id, 1, 1, 1, 2, 2, 2, 2, pad_id]])
    q, k, v = _rand(1, 4, 10, 128, seed=1, grad=True), _rand(1, 2, 10, 128, seed=2, grad=True), \
        _rand(1, 2, 10, 128, seed=3, grad=True)
    with torch.no_grad():
        v[:, :, 9] = float("nan")  # a padding key: only the padding run at the end sees it
    out = fa4.document_causal_fa4_attention(q, k, v, kv_ids, kv_ids, 0, 0.1)
    real = kv_ids > 0
    assert torch.all(out[(~real)[:, None].expand_as(out[..., 0])] == 0)
    assert not torch.isnan(out).any()
    ref = sdpa_reference(q, k, v.nan_to_num(0.0), document_causal_mask(kv_ids, kv_ids, 0), 0.1, keep_queries=real)
    torch.testing.assert_close(out[:, :, real[0]], ref[:, :, real[0]], atol=1e-12, rtol=1e-12)


def test_causal_matches_reference_with_gqa():
    q, k, v = _rand(2, 6, 5, 192, seed=1, grad=True), _rand(2, 2, 5, 192, seed=2), _rand(2, 2, 5, 128, seed=3)
    out = fa4.causal_fa4_attention(q, k, v, 0.125)
    assert out.shape == (2, 6, 5, 128) and ("fwd", "fa4") in stubs.CALLS
    torch.testing.assert_close(out, sdpa_reference(q, k, v, causal_mask(2, 5), 0.125), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("nq, nk", [(3, 7), (7, 3)])
def test_causal_with_unequal_lengths_is_fa4s_bottom_right(nq, nk):
    """NeMo passes Nq != Nk to FA4: causal aligned to the bottom-right corner (query i sees j <= i + Nk - Nq);
    queries that see no key (Nq > Nk) give 0."""
    q, k, v = _rand(2, 4, nq, 128, seed=1, grad=True), _rand(2, 2, nk, 128, seed=2), _rand(2, 2, nk, 128, seed=3)
    out = fa4.causal_fa4_attention(q, k, v, scale=0.125)
    i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    mask = (j <= i + nk - nq).expand(2, nq, nk)
    torch.testing.assert_close(out, sdpa_reference(q, k, v, mask, 0.125), atol=1e-12, rtol=1e-12)
    assert out.shape == (2, 4, nq, 128)


@pytest.mark.parametrize("shapes, match", [
    (((2, 4, 6, 128), (1, 2, 6, 128), (1, 2, 6, 128)), "batch"),
    (((2, 4, 6, 128), (2, 3, 6, 128), (2, 3, 6, 128)), "divide"),               # GQA ratio
    (((2, 4, 6, 128), (2, 2, 6, 64), (2, 2, 6, 64)), "head_dim"),
    (((2, 4, 6, 128), (2, 2, 6, 128), (2, 2, 5, 128)), "value"),
    (((2, 4, 6, 128), (2, 6, 128), (2, 6, 128)), "key: expected 4 dims"),
])
def test_causal_refuses_inconsistent_shapes(shapes, match):
    with pytest.raises(ValueError, match=match):
        fa4.causal_fa4_attention(*(torch.zeros(s, dtype=F64) for s in shapes), 0.1)


def test_document_causal_refuses_bad_ids():
    q, k = torch.zeros(1, 2, 3, 128, dtype=F64), torch.zeros(1, 2, 6, 128, dtype=F64)
    kv = torch.tensor([[1, 1, 1, 2, 2, 2]])
    with pytest.raises(ValueError, match="kv_doc_ids: expected shape"):
        fa4.document_causal_fa4_attention(q, k, k, kv[:, 3:], kv[:, 1:], 3, 0.1)
    with pytest.raises(ValueError, match="q_doc_ids: expected shape"):
        fa4.document_causal_fa4_attention(q, k, k, kv, kv, 0, 0.1)


# --- _load_fa4: flash_attn.cute's calling convention on xattn's kernels ----------------------------

def _flash_attn_cute_parameters(name: str) -> list[tuple[str, object]]:
    """(name, default) of a function of flash_attn/cute/interface.py, read from the source without importing it
    (importing cutlass here would fix its target arch for the rest of the session)."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("flash-attn-4 is not installed")
    source = Path(next(iter(spec.submodule_search_locations))) / "cute" / "interface.py"
    fn = next(n for n in ast.parse(source.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    names = [a.arg for a in fn.args.args]
    defaults = [inspect.Parameter.empty] * (len(names) - len(fn.args.defaults)) + \
        [ast.literal_eval(d) for d in fn.args.defaults]
    return list(zip(names, defaults))


@pytest.mark.parametrize("index, name", [(0, "flash_attn_func"), (1, "flash_attn_varlen_func")])
def test_load_fa4_entry_points_take_flash_attn_cute_arguments(index, name):
    fn = fa4._load_fa4()[index]
    ours = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
    assert fn.__name__ == name and ours == _flash_attn_cute_parameters(name)


def test_load_fa4_dense_entry_point():
    dense, varlen = fa4._load_fa4()
    assert fa4._load_fa4() == (dense, varlen) and dense.__name__ == "flash_attn_func"
    q, k, v = _rand(2, 5, 6, 128, seed=1), _rand(2, 7, 2, 128, seed=2), _rand(2, 7, 2, 128, seed=3)
    out, lse = dense(q, k, v, None, None, 0.2, True)                           # positional, as flash_attn
    assert lse is None                                                          # no grad, no return_lse
    mask = torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2             # bottom-right causal
    ref = sdpa_reference(*(t.transpose(1, 2) for t in (q, k, v)), mask.expand(2, 5, 7), 0.2).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    out2, lse2 = dense(q, k, v, softmax_scale=0.2, causal=True, return_lse=True, num_splits=3, pack_gqa=True)
    assert torch.equal(out2, out) and lse2.shape == (2, 6, 5) and lse2.dtype == torch.float32
    _, lse3 = dense(q.requires_grad_(), k, v, softmax_scale=0.2)
    assert lse3 is not None                                                     # kept when grads may flow


def test_load_fa4_varlen_entry_point_and_windows():
    _, varlen = fa4._load_fa4()
    q, k, v = _rand(9, 4, 128, seed=1), _rand(11, 2, 128, seed=2), _rand(11, 2, 128, seed=3)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 5, 11], dtype=torch.int32)
    out, lse = varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, softmax_scale=0.3, causal=True,
                      return_lse=True)                                          # max_seqlen_* derived
    from tests.reference import varlen_attention
    ref, ref_lse = varlen_attention(q, k, v, cu_q, cu_k, scale=0.3, causal=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    unbounded, _ = varlen(q, k, v, None, cu_q, cu_k, 4, 6, softmax_scale=0.3, window_size=(-1, -1))
    torch.testing.assert_close(unbounded, varlen_attention(q, k, v, cu_q, cu_k, scale=0.3)[0])


class _FlashAttnCute:
    """Stands in for ``flash_attn.cute.interface``: records the calls handed over to it."""

    def __init__(self):
        self.calls = []

    def flash_attn_func(self, **kwargs):
        self.calls.append(("flash_attn_func", kwargs))
        return "fa4-dense", None

    def flash_attn_varlen_func(self, **kwargs):
        self.calls.append(("flash_attn_varlen_func", kwargs))
        return "fa4-varlen", None


@pytest.fixture
def flash_attn_cute(monkeypatch):
    fake = _FlashAttnCute()
    real = fa4.import_fa4_modules
    monkeypatch.setattr(fa4_interface, "import_fa4_modules",
                        lambda *names: (fake,) if names == ("flash_attn.cute.interface",) else real(*names))
    return fake


@pytest.mark.parametrize("which, kwargs", [
    ("dense", dict(softcap=1.0)), ("dense", dict(qv=torch.zeros(1))), ("dense", dict(deterministic=True)),
    ("dense", dict(learnable_sink=torch.zeros(4))), ("dense", dict(score_mod=lambda *a: a[0])),
    ("dense", dict(gather_bwd_token_chunk=4)), ("varlen", dict(seqused_k=torch.ones(2, dtype=torch.int32))),
    ("varlen", dict(page_table=torch.zeros(1, 1, dtype=torch.int32))), ("varlen", dict(mask_mod=print)),
    ("varlen", dict(cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32))),  # one side packed
])
def test_load_fa4_hands_what_it_lacks_to_flash_attn_cute(flash_attn_cute, which, kwargs):
    """NeMo's ``_load_fa4`` returns flash_attn.cute's own functions: a call using a feature xattn's launchers
    lack runs there, with every argument as given (defaults included), and nothing runs on xattn's."""
    fn = fa4._load_fa4()[which == "varlen"]
    q = _rand(1, 4, 2, 128)
    assert fn(q, q, q, softmax_scale=0.25, **kwargs)[0] == f"fa4-{which}"
    (name, got), = flash_attn_cute.calls
    assert name == fn.__name__
    assert set(got) == set(inspect.signature(fn).parameters)
    assert got["q"] is q and got["softmax_scale"] == 0.25 and all(got[n] is x for n, x in kwargs.items())
    assert not stubs.CALLS


def test_return_lse_under_autograd_runs_on_flash_attn_cute(flash_attn_cute):
    """flash_attn.cute differentiates through its lse; xattn's has no gradient, so that call is handed over."""
    dense, _ = fa4._load_fa4()
    q = _rand(1, 4, 2, 128, grad=True)
    assert dense(q, q, q, return_lse=True)[0] == "fa4-dense" and flash_attn_cute.calls[0][1]["return_lse"]
    with torch.no_grad():
        assert dense(q, q, q, return_lse=True)[1].shape == (1, 2, 4)  # outside autograd: xattn's kernels
    assert len(flash_attn_cute.calls) == 1


def test_import_fa4_modules():
    import json
    import math

    assert fa4.import_fa4_modules() == ()
    assert fa4.import_fa4_modules("json") == (json,)
    assert fa4.import_fa4_modules("math", "json") == (math, json)
    with pytest.raises(ImportError, match=r"no_such_a .*no_such_b .*flash-attn-4==4\.0\.0b36"):
        fa4.import_fa4_modules("no_such_a", "json", "no_such_b")
    with pytest.raises(TypeError, match="names"):
        fa4.import_fa4_modules(["json"])


def test_causal_fa4_attention_names_its_scale_parameter():
    import torch

    from xattn.torch.fa4 import causal_fa4_attention

    q = torch.randn(1, 2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^scale") as info:
        causal_fa4_attention(q, q, q, scale=float("nan"))
    assert "softmax_scale" not in str(info.value)


def test_fa4_entry_point_judges_the_right_side_that_causal_overrides():
    flash_attn_func, _ = fa4._load_fa4()
    q = _rand(1, 6, 2, 128)
    with pytest.raises(ValueError, match="window_size: the right side"):
        flash_attn_func(q, q, q, causal=True, window_size=(0, -3))
    out, _ = flash_attn_func(q, q, q, causal=True, window_size=(2, 7))  # a right side >= 0: clipped by causal
    ref, _ = flash_attn_func(q, q, q, window_size=(2, 0))
    torch.testing.assert_close(out, ref)
