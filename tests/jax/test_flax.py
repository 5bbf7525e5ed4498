"""Flax as users write it: ``attention_fn=xattn.jax.dot_product_attention`` in ``nnx.MultiHeadAttention`` and
linen's ``MultiHeadDotProductAttention``, with Flax's own masks (``make_causal_mask``, padding via
``make_attention_mask``), dropout and ``sow_weights``. Mask arrays, dropout and sown weights run on the
peer's own implementation (exactly its result); ``is_causal=True`` without a mask runs the kernels (here
the NumPy stand-in launchers, fp16)."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import xattn.jax as xj
from xattn.jax import _ffi

from . import numpy_launcher

nnx = pytest.importorskip("flax.nnx")
linen = pytest.importorskip("flax.linen")

FEATURES, HEADS, T = 128, 2, 12  # head dim 64: an FA4 head dim, so is_causal=True reaches the kernels


@pytest.fixture
def stand_in():
    _ffi.set_launcher_provider(numpy_launcher.provider)
    yield
    _ffi.set_launcher_provider(None)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _nnx_pair(attention_fn, dtype=jnp.float32, **kw):
    """(xattn layer, Flax-default layer) with the same parameters."""
    make = lambda fn: nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qkv_features=FEATURES,  # noqa: E731
                                             decode=False, dtype=dtype, rngs=nnx.Rngs(0), attention_fn=fn, **kw)
    return make(attention_fn), make(nnx.dot_product_attention)


def _tokens():
    tokens = jnp.array([[5, 3, 8, 1, 9, 4, 2, 7, 6, 3, 0, 0], [4, 4, 1, 2, 8, 9, 3, 0, 0, 0, 0, 0]])
    x = jax.random.normal(jax.random.PRNGKey(1), (2, T, FEATURES))
    return tokens, x


KERNEL = functools.partial(xj.dot_product_attention, backend="kernel")  # the GPU's route ("auto" there)


def test_nnx_causal_and_padding_masks_train_exactly_as_flax():
    """nnx.make_causal_mask & a padding mask (float masks, as Flax builds them): the call runs on Flax's own
    path through jax.nn (warning once), so loss and gradients are Flax's, bit for bit."""
    ours, flax_default = _nnx_pair(KERNEL)
    tokens, x = _tokens()
    mask = nnx.combine_masks(nnx.make_causal_mask(tokens), nnx.make_attention_mask(tokens > 0, tokens > 0))
    assert mask.dtype == jnp.float32

    def loss(layer, x):
        return (layer(x, mask=mask, deterministic=True) ** 2).mean()
    xj.nn._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="mask/bias arrays have no kernel form"):
        got_loss, got_grads = nnx.value_and_grad(loss)(ours, x)
    want_loss, want_grads = nnx.value_and_grad(loss)(flax_default, x)
    np.testing.assert_array_equal(got_loss, want_loss)
    for g, w in zip(jax.tree.leaves(nnx.state(got_grads)), jax.tree.leaves(nnx.state(want_grads))):
        np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError, match="mask/bias"):  # strict: no fallback
        _nnx_pair(functools.partial(KERNEL, strict=True))[0](x, mask=mask, deterministic=True)


def test_nnx_dropout_and_sow_weights_run_on_flax():
    """Training with attention dropout and ``sow_weights=True`` are Flax's features: its own function runs
    them, with the same rng stream, so the result equals the Flax default layer's."""
    ours, flax_default = _nnx_pair(KERNEL, dropout_rate=0.2)
    _, x = _tokens()
    xj.nn._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="attention dropout"):
        got = ours(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    want = flax_default(x, deterministic=False, rngs=nnx.Rngs(dropout=7))
    np.testing.assert_array_equal(got, want)
    sown, _ = _nnx_pair(KERNEL)
    with pytest.warns(UserWarning, match="sow_weights"):
        sown(x, deterministic=True, sow_weights=True)
    weights = nnx.state(sown, nnx.Intermediate)
    (w,) = jax.tree.leaves(weights)
    assert w.shape == (2, HEADS, T, T) and np.allclose(np.asarray(w).sum(-1), 1.0, atol=1e-5)


def test_nnx_is_causal_without_a_mask_runs_the_kernels(stand_in):
    """The kernel spelling: ``layer(x, is_causal=True)`` and no mask array."""
    ours, flax_default = _nnx_pair(functools.partial(xj.dot_product_attention, backend="kernel"), dtype=jnp.float16)
    _, x = _tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback
        got = ours(x.astype(jnp.float16), is_causal=True, deterministic=True)
    mask = nnx.make_causal_mask(jnp.ones((2, T)))
    want = flax_default(x, mask=mask, deterministic=True)  # fp32 compute (XLA:CPU has no fp16 dot under jit)
    assert got.dtype == jnp.float16 and _rel(got, want) < 1e-2


def test_linen_causal_mask_and_the_kernel_spelling(stand_in):
    """linen's MHA has no is_causal: ``make_causal_mask`` runs Flax's path exactly; the kernel spelling is
    ``functools.partial(xattn.jax.dot_product_attention, is_causal=True)`` without a mask."""
    _, x = _tokens()
    mask = linen.make_causal_mask(jnp.ones((2, T)))
    make = lambda fn, **kw: linen.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=FEATURES,  # noqa: E731
                                                               deterministic=True, attention_fn=fn, **kw)
    params = make(linen.dot_product_attention).init(jax.random.PRNGKey(0), x, mask=mask)
    want = make(linen.dot_product_attention).apply(params, x, mask=mask)
    xj.nn._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="mask/bias"):
        got = make(KERNEL).apply(params, x, mask=mask)
    assert _rel(got, want) < 1e-6  # Flax's path (jax.nn's XLA call), linen's masked softmax: the same math
    causal = functools.partial(xj.dot_product_attention, is_causal=True, backend="kernel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = make(causal, dtype=jnp.float16).apply(params, x.astype(jnp.float16))
    assert fast.dtype == jnp.float16 and _rel(fast, want) < 1e-2
