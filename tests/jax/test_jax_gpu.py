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
    for a, b in zip(jax.jit(jax.grad(loss(kern), argnums=(0, 1, 2)))(q, k, v),
                    jax.grad(loss(ref), argnums=(0, 1, 2))(*f32)):
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


def _grads(f, *args):
    return jax.grad(lambda *a: (f(*a).astype(jnp.float32) ** 2).sum(), argnums=tuple(range(len(args))))(*args)


@pytest.mark.parametrize("family, d, dv, g, causal", [("ffpa", 512, 512, 4, True), ("fa4", 128, 128, 2, False),
                                                      ("fa4", 192, 128, 1, True)])
def test_low_level_fwd_bwd_use_the_callers_out_and_lse(family, d, dv, g, causal):
    """ffpa_fwd/bwd, fa4_fwd/bwd vs the reference; the backward really reads the given lse:
    lse + ln 2 halves every probability, so dV halves (the ring-attention contract)."""
    q, k, v = _qkv(11, (2, 200, 2 * g, d), (2, 264, 2, d), dv)
    scale = d ** -0.5
    fwd, bwd = (xj.ffpa_fwd, xj.ffpa_bwd) if family == "ffpa" else (xj.fa4_fwd, xj.fa4_bwd)
    out, lse = jax.jit(lambda q, k, v: fwd(q, k, v, scale=scale, causal=causal, backend="kernel"))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    ref_out, ref_lse = fwd(*f32, scale=scale, causal=causal, backend="reference")
    assert _rel(out, ref_out) < 1e-2 and _rel(lse, ref_lse) < 1e-3
    dout = jax.random.normal(jax.random.PRNGKey(12), out.shape, out.dtype)
    run_bwd = jax.jit(lambda lse: bwd(dout, q, k, v, out, lse, scale=scale, causal=causal, backend="kernel"))
    grads = run_bwd(lse)
    ref = bwd(dout.astype(jnp.float32), *f32, out.astype(jnp.float32), lse, scale=scale, causal=causal,
              backend="reference")
    for a, b in zip(grads, ref):
        assert _rel(a, b) < 1e-2
    halved = run_bwd(lse + np.log(2.0))
    assert _rel(halved[2], np.asarray(grads[2], np.float64) / 2) < 1e-2


@pytest.mark.parametrize("family, d, dv, g", [("ffpa", 512, 512, 4), ("fa4", 192, 128, 1), ("fa4", 128, 128, 2)])
def test_varlen_grads_with_zero_length_segments(family, d, dv, g):
    lq, lk = [100, 0, 257, 63], [90, 60, 250, 130]
    cu = lambda ls: jnp.array(np.concatenate([[0], np.cumsum(ls)]), jnp.int32)  # noqa: E731
    q, k, v = _qkv(13, (sum(lq), 2 * g, d), (sum(lk), 2, d), dv)
    kw = dict(max_seqlen_q=257, max_seqlen_k=250, family=family, causal=True)
    run = lambda backend: (lambda q, k, v: xj.varlen_attention(q, k, v, cu(lq), cu(lk), backend=backend, **kw))  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert _rel(jax.jit(run("kernel"))(q, k, v), run("reference")(*f32)) < 1e-2
    for a, b in zip(jax.jit(lambda *a: _grads(run("kernel"), *a))(q, k, v), _grads(run("reference"), *f32)):
        assert _rel(a, b) < 1e-2


def test_packed_segment_ids_fwd_and_grads():
    ids = jnp.array([[1] * 70 + [2] * 100 + [0] * 22, [3] * 192])
    q, k, v = _qkv(14, (2, 192, 8, 512), (2, 192, 2, 512))
    run = lambda backend: (lambda q, k, v: xj.packed_attention(q, k, v, ids, max_segments=8, backend=backend))  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    real = np.asarray(ids != 0)[:, :, None, None]  # padding rows: whatever the contract says, compare the rest
    assert _rel(np.asarray(jax.jit(run("kernel"))(q, k, v), np.float32) * real,
                np.asarray(run("reference")(*f32)) * real) < 1e-2
    for a, b in zip(jax.jit(lambda *a: _grads(run("kernel"), *a))(q, k, v), _grads(run("reference"), *f32)):
        assert _rel(a, b) < 1e-2


def test_sliding_window_flash_attention_fwd_and_grads():
    q, k, v = _qkv(15, (2, 300, 4, 256), (2, 300, 2, 256))
    run = lambda backend: (lambda q, k, v: xj.flash_attention(q, k, v, window_size=(63, 0), backend=backend))  # noqa: E731
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    assert _rel(jax.jit(run("kernel"))(q, k, v), run("reference")(*f32)) < 1e-2
    for a, b in zip(jax.jit(lambda *a: _grads(run("kernel"), *a))(q, k, v), _grads(run("reference"), *f32)):
        assert _rel(a, b) < 1e-2


@pytest.mark.parametrize("start, nq", [(0, 64), (32, 32)])
def test_fa4_helpers_on_the_kernels(start, nq):
    """causal_fa4_attention and document_causal_fa4_attention (left-padded, sharded-query rows)."""
    kv_ids = jnp.array([[0] * 10 + [1] * 24 + [2] * 30, [3] * 64])
    q_ids = kv_ids[:, start:start + nq]
    q, k, v = _qkv(16, (2, nq, 4, 128), (2, 64, 2, 128))
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    doc = lambda backend: (lambda q, k, v: xj.document_causal_fa4_attention(  # noqa: E731
        q, k, v, q_ids, kv_ids, start, 0.1, max_segments=8, backend=backend))
    assert _rel(jax.jit(doc("kernel"))(q, k, v), doc("reference")(*f32)) < 1e-2
    for a, b in zip(jax.jit(lambda *a: _grads(doc("kernel"), *a))(q, k, v), _grads(doc("reference"), *f32)):
        assert _rel(a, b) < 1e-2
    qc, kc, vc = _qkv(17, (2, 64, 4, 128), (2, 64, 2, 128))
    causal = lambda backend: (lambda q, k, v: xj.causal_fa4_attention(q, k, v, 0.1, backend=backend))  # noqa: E731
    assert _rel(jax.jit(causal("kernel"))(qc, kc, vc),
                causal("reference")(*(x.astype(jnp.float32) for x in (qc, kc, vc)))) < 1e-2


@pytest.mark.parametrize("d", [512, 128])
def test_dot_product_attention_matches_jax_nn(d):
    q, k, v = _qkv(18, (2, 256, 8, d), (2, 256, 2, d))
    ours = jax.jit(lambda q, k, v: xj.dot_product_attention(q, k, v, is_causal=True, backend="kernel"))(q, k, v)
    theirs = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, k, v)), is_causal=True,
                                          implementation="xla")
    assert _rel(ours, theirs) < 1e-2
