"""xattn.jax.dot_product_attention as a drop-in for jax.nn.dot_product_attention (CPU): every accepted
argument against jax.nn's XLA implementation, forward, residual and gradients under jit, through the
NumPy stand-in launchers (backend="kernel") and the reference; the fallbacks to jax.nn's / Flax's own
implementation (a warning per reason, ``strict=True`` raises); the refusals by type and message."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi

from . import numpy_launcher

QL, KL = [5, 8, 3], [7, 10, 9]  # valid prefixes: q <= kv per row (exact with causal on the kernels too)

# (name, T, S, jax.nn keywords); seq lengths given as "q"/"kv" markers, filled with QL/KL below
CASES = [
    ("full_gqa", 7, 11, {}),
    ("causal_nq_lt_nk", 6, 10, dict(is_causal=True)),
    ("causal_nq_gt_nk", 10, 6, dict(is_causal=True)),
    ("window_int", 9, 9, dict(local_window_size=2)),
    ("window_tuple_causal_nq_lt_nk", 6, 10, dict(local_window_size=(3, 1), is_causal=True)),
    ("window_tuple_nq_gt_nk", 10, 6, dict(local_window_size=(1, 2))),
    ("window_covers_all", 6, 10, dict(local_window_size=(50, 50))),
    ("q_lengths_causal", 8, 10, dict(is_causal=True, query_seq_lengths="q")),
    ("kv_lengths", 8, 10, dict(key_value_seq_lengths="kv")),
    ("both_lengths", 8, 10, dict(query_seq_lengths="q", key_value_seq_lengths="kv")),
    ("both_lengths_causal", 8, 10, dict(is_causal=True, query_seq_lengths="q", key_value_seq_lengths="kv")),
    ("both_lengths_window", 8, 10, dict(local_window_size=(2, 1), query_seq_lengths="q", key_value_seq_lengths="kv")),
]
WINDOWED = {"window_int", "window_tuple_causal_nq_lt_nk", "window_tuple_nq_gt_nk", "both_lengths_window"}
# what runs on jax.nn's XLA implementation instead of the kernels, per head dim: FFPA has no window; a window with
# key_value_seq_lengths has no single kernel window
FALLBACKS = {64: {"both_lengths_window": "local_window_size with key_value_seq_lengths"},
             320: {**{n: "sliding window at head_dim 320" for n in WINDOWED},
                   "both_lengths_window": "local_window_size with key_value_seq_lengths"}}
PATHS = [("kernel", 64), ("kernel", 320), ("reference", 64)]  # FA4, FFPA (stand-in), pure jnp


@pytest.fixture
def stand_in():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    yield
    _ffi.set_launcher_provider(None)


def _qkv(lead, t, s, d, n=4, kh=2, dtype=jnp.float16, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, (*lead, t, n, d), dtype), jax.random.normal(k2, (*lead, s, kh, d), dtype),
            jax.random.normal(k3, (*lead, s, kh, d), dtype))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _lengths(kw):
    table = {"q": jnp.array(QL, jnp.int32), "kv": jnp.array(KL, jnp.int32)}
    lens = {n: table[kw.pop(n)] for n in ("query_seq_lengths", "key_value_seq_lengths") if n in kw}
    return kw, lens


def _run(fn, q, k, v, lens):
    """``(out, residual), grads``, one jit: grads of sum(out * w) over the rows that see a key
    (residual > -1e30; jax.nn averages every value uniformly in the others, xattn gives 0)."""
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(q, k, v, lens):
        out, res = fn(q, k, v, return_residual=True, **lens)
        seen = jax.lax.stop_gradient(res.astype(jnp.float32)) > -1e30
        return (out.astype(jnp.float32) * w * seen[..., None]).sum(), (out, res)
    (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v, lens)
    return outs, grads


def _compare(ours_fn, q, k, v, kw, lens, tol):
    """ours vs jax.nn (XLA, float32 of the same inputs): rows that see a key agree, the others are 0 / -inf."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    theirs_fn = functools.partial(jax.nn.dot_product_attention, implementation="xla", **kw)
    (out, res), grads = _run(functools.partial(ours_fn, **kw), q, k, v, lens)
    (their_out, their_res), their_grads = _run(theirs_fn, *f32, lens)
    assert out.shape == q.shape and res.shape == q.shape[:-1] and res.dtype == k.dtype
    out, res = np.asarray(out, np.float32), np.asarray(res, np.float32)
    seen = np.asarray(their_res) > -1e30  # [..., T, N]: rows that see at least one key
    assert _rel(out[seen], their_out[seen]) < tol and _rel(res[seen], their_res[seen]) < tol
    assert (out[~seen] == 0).all() and (res[~seen] == -np.inf).all()
    for ours, theirs in zip(grads, their_grads):
        assert _rel(ours, theirs) < tol


@pytest.mark.parametrize("backend, d", PATHS, ids=[f"{b}-d{d}" for b, d in PATHS])
@pytest.mark.parametrize("name, t, s, kw", CASES, ids=[c[0] for c in CASES])
def test_matches_jax_nn(stand_in, backend, d, name, t, s, kw):
    kw, lens = _lengths(dict(kw))
    reason = FALLBACKS.get(d, {}).get(name) if backend == "kernel" else None
    # the NumPy stand-in takes fp16; jax.nn's XLA call cannot run fp16 under jit on the CPU, bf16 it can
    dtype = jnp.float32 if backend == "reference" else jnp.float16 if reason is None else jnp.bfloat16
    q, k, v = _qkv((3,), t, s, d, dtype=dtype)
    ours = functools.partial(xj.dot_product_attention, scale=0.3, backend=backend)
    if reason is not None:  # jax.nn's own XLA implementation runs it: exactly its result, after a warning
        xj.nn._FALLBACK_WARNED.clear()
        with pytest.warns(UserWarning, match=reason):
            out = jax.jit(functools.partial(ours, **kw))(q, k, v, **lens)
        theirs = jax.jit(functools.partial(jax.nn.dot_product_attention, scale=0.3, **kw))(q, k, v, **lens)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(theirs, np.float32))
        with pytest.raises(NotImplementedError, match=reason):
            jax.jit(functools.partial(ours, strict=True, **kw))(q, k, v, **lens)
        return
    _compare(ours, q, k, v, dict(kw, scale=0.3), lens, 1e-5 if backend == "reference" else 1e-2)


def _with_lead(fn, lead):
    """fn on inputs with leading dims ``lead``, called with and returning flat [B, ...] arrays."""
    up = lambda x: x.reshape(*lead, *x.shape[1:])  # noqa: E731
    down = lambda x: x.reshape(-1, *x.shape[len(lead):])  # noqa: E731

    def wrapped(q, k, v, return_residual=False, **kw):
        kw = {n: up(x) if n.endswith("_lengths") else x for n, x in kw.items()}
        res = fn(up(q), up(k), up(v), return_residual=return_residual, **kw)
        return tuple(map(down, res)) if return_residual else down(res)
    return wrapped


LEADS = [((2, 3), "key_value_seq_lengths", [9, 6, 7, 8, 9, 6]), ((), "query_seq_lengths", [4])]


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("lead, name, lengths", LEADS, ids=["lead_2x3", "3d"])
def test_leading_dims_and_3d_inputs(stand_in, backend, lead, name, lengths):
    dtype = jnp.float32 if backend == "reference" else jnp.float16
    q, k, v = _qkv((len(lengths),), 6, 9, 64, dtype=dtype)
    ours = _with_lead(functools.partial(xj.dot_product_attention, backend=backend), lead)
    lens = {name: jnp.array(lengths, jnp.int32)}
    _compare(ours, q, k, v, dict(is_causal=True), lens, 1e-5 if backend == "reference" else 1e-2)


def test_reference_bias_and_mask_arrays():
    q, k, v = _qkv((2,), 7, 11, 32, dtype=jnp.float32)
    bias = jax.random.normal(jax.random.PRNGKey(3), (2, 4, 7, 11))
    mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.7, (1, 4, 7, 11)).at[..., 0].set(True)
    ours = functools.partial(xj.dot_product_attention, backend="reference")
    _compare(ours, q, k, v, dict(bias=bias, mask=mask), {}, 1e-5)
    theirs = jax.jit(functools.partial(jax.nn.dot_product_attention, is_causal=True))(q, k, v, bias, mask)
    ours = jax.jit(functools.partial(xj.dot_product_attention, is_causal=True, backend="reference"))
    assert _rel(ours(q, k, v, bias, mask), theirs) < 1e-5


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_rows_that_see_no_key_give_zero_and_minus_inf(stand_in, backend):
    q, k, v = _qkv((2,), 6, 8, 64)
    kv_len, q_len = jnp.array([0, 8], jnp.int32), jnp.array([6, 2], jnp.int32)
    out, res = jax.jit(lambda q, k, v: xj.dot_product_attention(
        q, k, v, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, return_residual=True, backend=backend))(q, k, v)
    assert (out[0] == 0).all() and (res[0] == -jnp.inf).all()  # jax.nn: uniform average of every value
    assert (out[1, 2:] == 0).all() and (res[1, 2:] == -jnp.inf).all()  # padded queries: 0, as jax.nn
    assert jnp.isfinite(out[1, :2]).all() and jnp.isfinite(res[1, :2]).all()


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_residual_carries_no_gradient_like_jax_nn(stand_in, backend):
    q, k, v = _qkv((2,), 6, 8, 64)
    res = lambda f: lambda q: f(q, k, v, is_causal=True, return_residual=True)[1].astype(jnp.float32).sum()  # noqa: E731
    ours = jax.grad(res(functools.partial(xj.dot_product_attention, backend=backend)))(q)
    theirs = jax.grad(res(jax.nn.dot_product_attention))(q)
    assert not ours.any() and not theirs.any()


@pytest.mark.parametrize("d", [64, 320])
@pytest.mark.parametrize("t, s, q_len, kv_len",
                         [(8, 6, [8, 6], [6, 3]), (8, 8, [8, 4], [4, 8]), (6, 9, [6, 2], [1, 9])])
def test_kernel_causal_with_kv_lengths_shorter_than_the_queries_is_exact(stand_in, d, t, s, q_len, kv_len):
    """Causal + padding where rows reach past kv_len (jax.nn's own test: q [64, 32], kv [32, 64]): those rows
    see all real keys. Once NaN; now two launches (causal rows, full rows), forward and gradients."""
    q, k, v = _qkv((2,), t, s, d)
    lens = dict(query_seq_lengths=jnp.array(q_len, jnp.int32), key_value_seq_lengths=jnp.array(kv_len, jnp.int32))
    ours = functools.partial(xj.dot_product_attention, backend="kernel")
    _compare(ours, q, k, v, dict(is_causal=True, scale=0.3), lens, 1e-2)


def test_kernel_vmap_and_dtype_cast(stand_in):
    q, k, v = _qkv((2, 3), 6, 10, 64)
    kv_len = jnp.array([[10, 4, 7], [1, 10, 2]], jnp.int32)
    f = lambda q, k, v, n: xj.dot_product_attention(q, k, v, key_value_seq_lengths=n, backend="kernel")  # noqa: E731
    mapped = jax.jit(jax.vmap(f))(q, k, v, kv_len)
    assert _rel(mapped, f(q, k, v, kv_len)) < 1e-6
    g = functools.partial(xj.dot_product_attention, is_causal=True, dtype=jnp.float16, backend="kernel")
    causal = jax.vmap(g)(*(x.astype(jnp.float32) for x in (q, k, v)))  # Flax's dtype: inputs cast, then run
    assert causal.dtype == jnp.float16 and _rel(causal, g(q, k, v)) < 1e-6


def test_implementation_xla_is_honoured():
    q, k, v = _qkv((2, 3), 6, 9, 32, dtype=jnp.float32)
    kv_len = jnp.array([[9, 4, 7], [1, 9, 2]], jnp.int32)
    out, res = xj.dot_product_attention(q, k, v, key_value_seq_lengths=kv_len, is_causal=True, implementation="xla",
                                        return_residual=True)
    flat = [x.reshape(6, *x.shape[2:]) for x in (q, k, v)]
    their_out, their_res = jax.nn.dot_product_attention(*flat, key_value_seq_lengths=kv_len.reshape(6), is_causal=True,
                                                        return_residual=True)
    np.testing.assert_array_equal(out.reshape(their_out.shape), their_out)
    np.testing.assert_array_equal(res.reshape(their_res.shape), their_res)


def _raises(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        xj.dot_product_attention(*args, **kw)


def test_refusals(stand_in):
    q, k, v = _qkv((2,), 8, 6, 64)
    _raises(TypeError, "unexpected keyword", q, k, v, sliding_window=4)
    _raises(TypeError, "local_window_size", q, k, v, local_window_size=(1, 2, 3))
    _raises(ValueError, "implementation", q, k, v, implementation="flash")
    _raises(ValueError, "cannot be combined", q, k, v, implementation="xla", backend="kernel")
    _raises(TypeError, "int32", q, k, v, query_seq_lengths=jnp.array([1, 2], jnp.int16))
    _raises(ValueError, "one length per batch row", q, k, v, key_value_seq_lengths=jnp.array([1, 2, 3], jnp.int32))
    _raises(TypeError, "static bool", q, k, v, is_causal=jnp.array(True))
    _raises(ValueError, "multiple of key/value heads", q[..., :3, :], k, v)
    _raises(ValueError, "leading dims", q[None], k[:1][None], v[:1][None])
    _raises(ValueError, "does not broadcast", q, k, v, bias=jnp.ones((3, 1, 8, 6)), backend="reference")
    _raises(TypeError, "strict", q, k, v, strict="yes")
    _raises(NotImplementedError, "return_residual", q, k, v, dropout_rate=0.1, deterministic=False,
            dropout_rng=jax.random.PRNGKey(0), return_residual=True)
    _raises(NotImplementedError, "scale", q, k, v, dropout_rate=0.1, deterministic=False,
            dropout_rng=jax.random.PRNGKey(0), scale=0.5)


def _bf16(lead, t, s, d, **kw):
    return _qkv(lead, t, s, d, dtype=jnp.bfloat16, **kw)


CAUSAL_MASK = jnp.tril(jnp.ones((8, 6), bool), 0)[None, None]
FALLBACK_CASES = [  # (id, args, keywords, match, strict error): the kernels cannot run these exactly
    ("mask", lambda: _bf16((2,), 8, 6, 64), dict(mask=CAUSAL_MASK), "mask/bias", ValueError),
    ("float_mask", lambda: _bf16((2,), 8, 6, 64), dict(mask=CAUSAL_MASK.astype(jnp.float32)), "mask/bias", ValueError),
    ("bias", lambda: _bf16((2,), 8, 6, 64), dict(bias=jnp.linspace(-1, 1, 48).reshape(1, 1, 8, 6)), "mask/bias",
     ValueError),
    ("negative_window", lambda: _bf16((2,), 8, 6, 64), dict(local_window_size=(2, -1)), "negative sides",
     NotImplementedError),
    ("ffpa_window", lambda: _bf16((2,), 8, 6, 384), dict(local_window_size=(2, 1)), "sliding window at head_dim 384",
     NotImplementedError),
    ("head_dim_40", lambda: _bf16((1,), 8, 8, 40), dict(is_causal=True), "head dims 40/40", NotImplementedError),
    ("float32", lambda: _qkv((2,), 8, 6, 64, dtype=jnp.float32), {}, "float32: the kernels take", NotImplementedError),
    ("window_with_lengths", lambda: _bf16((2,), 8, 6, 64),
     dict(local_window_size=2, key_value_seq_lengths=jnp.array([3, 6], jnp.int32)), "with key_value_seq_lengths",
     NotImplementedError),
]


@pytest.mark.parametrize("name, make, kw, match, error", FALLBACK_CASES, ids=[c[0] for c in FALLBACK_CASES])
def test_fallbacks_run_jax_nn_exactly_and_strict_refuses(stand_in, monkeypatch, name, make, kw, match, error):
    """On the kernel route, what no kernel runs exactly is jax.nn's own XLA call: its result bit for bit
    (output and residual), one warning per reason; strict=True / XATTN_STRICT=1 raise the named error."""
    q, k, v = make()
    xj.nn._FALLBACK_WARNED.clear()
    ours = jax.jit(functools.partial(xj.dot_product_attention, backend="kernel", return_residual=True, **kw))
    with pytest.warns(UserWarning, match=match):
        out, res = ours(q, k, v)
    their_kw = dict(kw, mask=kw["mask"].astype(bool)) if "mask" in kw else kw
    their_out, their_res = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="xla",
                                                     return_residual=True, **their_kw))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(their_out, np.float32))
    np.testing.assert_array_equal(np.asarray(res, np.float32), np.asarray(their_res, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        jax.jit(functools.partial(xj.dot_product_attention, backend="kernel", scale=0.7, **kw))(q, k, v)
    with pytest.raises(error, match=match):
        xj.dot_product_attention(q, k, v, backend="kernel", strict=True, **kw)
    monkeypatch.setenv("XATTN_STRICT", "1")
    with pytest.raises(error, match=match):
        xj.dot_product_attention(q, k, v, backend="kernel", **kw)
    assert xj.dot_product_attention(q, k, v, backend="kernel", strict=False, **kw).shape == out.shape


def test_reference_takes_flax_float_masks_as_bool():
    q, k, v = _qkv((2,), 8, 6, 64, dtype=jnp.float32)
    as_float = xj.dot_product_attention(q, k, v, mask=CAUSAL_MASK.astype(jnp.float32), backend="reference")
    as_bool = xj.dot_product_attention(q, k, v, mask=CAUSAL_MASK, backend="reference")
    np.testing.assert_array_equal(as_float, as_bool)


def test_flax_nnx_attention_fn_if_flax_is_installed():
    nnx = pytest.importorskip("flax.nnx")
    fn = functools.partial(xj.dot_product_attention, backend="reference")
    layer = nnx.MultiHeadAttention(num_heads=2, in_features=32, qkv_features=32, decode=False, attention_fn=fn,
                                   rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 6, 32))
    y = layer(x, deterministic=True)
    assert y.shape == (2, 6, 32) and jnp.isfinite(y).all()


def test_flax_linen_attention_fn_if_flax_is_installed():
    nn = pytest.importorskip("flax.linen")
    fn = functools.partial(xj.dot_product_attention, backend="reference")
    layer = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, attention_fn=fn, deterministic=True)
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 6, 32))
    y, _ = layer.init_with_output(jax.random.PRNGKey(0), x)
    ref = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, deterministic=True)
    assert _rel(y, ref.init_with_output(jax.random.PRNGKey(0), x)[0]) < 1e-5
