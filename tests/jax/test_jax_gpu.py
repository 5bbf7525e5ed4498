"""xattn.jax on the GPU with the real kernels (XLA FFI): fwd + grads vs the fp32 reference, vmap(grad),
varlen with zero-length segments, torch and JAX giving identical bits, a Flax nnx block training."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
jax = pytest.importorskip("jax")
jnp = jax.numpy

import xattn.jax as xj  # noqa: E402


def _qkv(seed, sq, sk, dv=None, dtype=jnp.bfloat16):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (jax.random.normal(k1, sq, dtype), jax.random.normal(k2, sk, dtype),
            jax.random.normal(k3, (*sk[:-1], dv or sk[-1]), dtype))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


@pytest.mark.parametrize("fn, d, dv, g, causal", [
    (xj.ffpa_attention, 512, 512, 4, True), (xj.ffpa_attention, 384, 384, 1, False),
    (xj.flash_attention, 128, 128, 4, True), (xj.flash_attention, 192, 128, 1, True)])
def test_dense_vs_reference(fn, d, dv, g, causal):
    q, k, v = _qkv(0, (2, 200, 2 * g, d), (2, 264, 2, d), dv)
    loss = lambda f: (lambda q, k, v: (f(q, k, v).astype(jnp.float32) ** 2).sum())  # noqa: E731
    kern = lambda q, k, v: fn(q, k, v, causal=causal, backend="kernel")  # noqa: E731
    ref = lambda q, k, v: fn(q, k, v, causal=causal, backend="reference")  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert _rel(jax.jit(kern)(q, k, v), ref(*f32)) < 1e-2
    for a, b in zip(jax.jit(jax.grad(loss(kern), argnums=(0, 1, 2)))(q, k, v), jax.grad(loss(ref), argnums=(0, 1, 2))(*f32)):
        assert _rel(a, b) < 1e-2


def test_vmap_grad():
    q, k, v = _qkv(1, (3, 2, 128, 8, 512), (3, 2, 128, 2, 512))
    f = lambda q, k, v: (xj.ffpa_attention(q, k, v, causal=True, backend="kernel").astype(jnp.float32) ** 2).sum()  # noqa: E731
    grads = jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1, 2))))(q, k, v)
    for i in range(3):
        one = jax.grad(f, argnums=(0, 1, 2))(q[i], k[i], v[i])
        for a, b in zip(grads, one):
            assert _rel(a[i], b) < 1e-2


def test_varlen_with_zero_length_segments():
    lq, lk = [100, 0, 257, 63], [90, 60, 250, 130]
    cu = lambda ls: jnp.array(np.concatenate([[0], np.cumsum(ls)]), jnp.int32)  # noqa: E731
    q, k, v = _qkv(2, (sum(lq), 8, 512), (sum(lk), 2, 512))
    kw = dict(max_seqlen_q=257, max_seqlen_k=250, family="ffpa", causal=True)
    kern = xj.varlen_attention(q, k, v, cu(lq), cu(lk), backend="kernel", **kw)
    ref = xj.varlen_attention(*(x.astype(jnp.float32) for x in (q, k, v)), cu(lq), cu(lk), backend="reference", **kw)
    assert _rel(kern, ref) < 1e-2


def test_torch_and_jax_give_identical_bits():
    torch = pytest.importorskip("torch")
    import xattn.torch as xt

    q, k, v = _qkv(3, (2, 256, 8, 512), (2, 256, 2, 512))
    out_j = np.asarray(jax.jit(lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True, backend="kernel"))(q, k, v)
                       .astype(jnp.float32))
    tq, tk, tv = (torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().to(torch.bfloat16) for x in (q, k, v))
    out_t = xt.attention(tq, tk, tv, causal=True).float().cpu().numpy()
    assert np.array_equal(out_j, out_t)


def test_flax_nnx_block_trains():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=256, qkv_features=2048, out_features=256,
                                               decode=False, attention_fn=xj.dot_product_attention,
                                               dtype=jnp.bfloat16, rngs=rngs)
            self.out = nnx.Linear(256, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(self.attn(x, deterministic=True).astype(jnp.float32))

    model = Block(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 128, 256))
    y = jax.random.normal(jax.random.PRNGKey(5), (2, 128, 1))

    @nnx.jit
    def step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        opt.update(model, grads)
        return loss
    losses = [float(step(model, opt, x, y)) for _ in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_remat_and_shard_map_on_gpu():
    from jax.sharding import NamedSharding, PartitionSpec as P

    q, k, v = _qkv(6, (2, 256, 8, 512), (2, 256, 2, 512))
    policy = jax.checkpoint_policies.save_only_these_names("xattn_out", "xattn_lse")
    f = lambda q, k, v: (xj.ffpa_attention(q, k, v, causal=True, backend="kernel").astype(jnp.float32) ** 2).sum()  # noqa: E731
    plain = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(plain, remat):
        assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    body = lambda q, k, v: xj.ffpa_attention(q, k, v, causal=True, backend="kernel")  # noqa: E731
    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("x"),) * 3, out_specs=P("x")))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("x")))  # noqa: E731
    g = jax.jit(jax.grad(lambda q, k, v: (sharded(q, k, v).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2)))
    for a, b in zip(g(put(q), put(k), put(v)), plain):
        assert _rel(a, b) < 1e-6
