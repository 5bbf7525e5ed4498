"""xattn.jax.paged_attention (Pallas' GPU paged_attention signature and layout) through the real FFI plumbing on
the NumPy stand-in launchers: shuffled block tables with spare pages, partly filled last pages, lengths traced
under jit, GQA, both families, splits; against fp64 of the same keys gathered contiguously, and against the Pallas
peer itself (interpret mode on the CPU) where it runs."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import xattn.jax as xj


def _case(seed, b, hq, hkv, d, ps, max_pages, lengths, spare=3):
    rng = np.random.default_rng(seed)
    num_pages = b * max_pages + spare
    q = rng.standard_normal((b, hq, d)).astype(np.float32) * d ** -0.5
    k_pages = rng.standard_normal((hkv, num_pages, ps, d)).astype(np.float32)
    v_pages = rng.standard_normal((hkv, num_pages, ps, d)).astype(np.float32)
    table = rng.permutation(num_pages)[:b * max_pages].reshape(b, max_pages).astype(np.int32)
    return q, k_pages, v_pages, table, np.asarray(lengths, np.int32)


def _reference(q, k_pages, v_pages, table, lengths):
    """fp64, per sequence: its first lengths[b] keys gathered through the table, no scale (the peer's)."""
    b, hq, d = q.shape
    hkv, _, ps, dv = v_pages.shape
    out = np.zeros((b, hq, dv))
    for i, n in enumerate(lengths):
        if n == 0:
            continue
        k = k_pages[:, table[i]].reshape(hkv, -1, d)[:, :n].astype(np.float64)  # [Hkv, n, D]
        v = v_pages[:, table[i]].reshape(hkv, -1, dv)[:, :n].astype(np.float64)
        qq = q[i].astype(np.float64).reshape(hkv, hq // hkv, d)
        s = np.einsum("hgd,hnd->hgn", qq, k)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[i] = (np.einsum("hgn,hnd->hgd", p / p.sum(-1, keepdims=True), v)).reshape(hq, dv)
    return out


@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("d, hq, hkv, ps, max_pages, lengths", [
    pytest.param(128, 8, 2, 16, 40, [1, 639, 300], id="fa4-g4-ps16"),
    pytest.param(128, 4, 4, 64, 9, [576, 65, 0], id="fa4-mha-ps64-empty"),
    pytest.param(512, 8, 1, 64, 9, [575, 64, 200], id="ffpa-g8-ps64"),
    pytest.param(384, 4, 2, 128, 5, [640, 1], id="ffpa-d384-ps128"),
])
def test_paged_attention_matches_fp64(launcher_calls, num_splits, d, hq, hkv, ps, max_pages, lengths):
    q, k_pages, v_pages, table, n = _case(d + ps, len(lengths), hq, hkv, d, ps, max_pages, lengths)
    fn = jax.jit(lambda q, kp, vp, t, n: xj.paged_attention(q, kp, vp, t, n, num_splits=num_splits))
    args = [jnp.asarray(x, jnp.float16) for x in (q, k_pages, v_pages)]
    out = np.asarray(fn(*args, table, n), np.float64)
    want = _reference(*(np.asarray(a, np.float32) for a in args), table, n)  # the same fp16-rounded inputs
    assert out.shape == (len(lengths), hq, d)
    assert np.abs(out - want).max() < 0.03 * max(1.0, np.abs(want).max())
    assert any(c.endswith(":paged") for c in launcher_calls)
    again = np.asarray(fn(*args, table, np.maximum(n - 1, 0)), np.float64)  # new traced lengths, same program
    assert np.abs(again - _reference(*(np.asarray(a, np.float32) for a in args), table, np.maximum(n - 1, 0))).max() \
        < 0.03 * max(1.0, np.abs(want).max())


def test_against_the_pallas_peer_and_its_arguments(launcher_calls):
    """Pallas' own paged_attention (interpret mode) on the same call, where it runs here; its tiling arguments
    are accepted; what xattn lacks raises."""
    pallas = pytest.importorskip("jax.experimental.pallas.ops.gpu.paged_attention")
    q, k_pages, v_pages, table, n = _case(7, 2, 8, 2, 64, 16, 8, [100, 37], spare=0)
    args = [jnp.asarray(x, jnp.float16) for x in (q, k_pages, v_pages)]
    ours = xj.paged_attention(*args, table, n, block_h=16, k_splits=4)
    want = _reference(*(np.asarray(a, np.float32) for a in args), table, n)
    assert np.abs(np.asarray(ours, np.float64) - want).max() < 2e-2
    with pytest.raises(NotImplementedError, match="soft_cap"):
        xj.paged_attention(*args, table, n, attn_logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="multiple of 64"):
        q5, kp5, vp5, t5, n5 = _case(8, 1, 4, 1, 512, 16, 4, [20])
        xj.paged_attention(jnp.asarray(q5, jnp.float16), jnp.asarray(kp5, jnp.float16),
                           jnp.asarray(vp5, jnp.float16), t5, n5)
    try:
        peer = pallas.paged_attention(*args, jnp.asarray(table), jnp.asarray(n), block_h=16, pages_per_compute_block=2,
                                      k_splits=4, interpret=True)
    except Exception as exc:  # the Triton lowering may not interpret on this jax: the fp64 check above still holds
        pytest.skip(f"Pallas' paged_attention does not run here: {type(exc).__name__}: {str(exc)[:120]}")
    assert np.abs(np.asarray(ours, np.float64) - np.asarray(peer, np.float64)).max() < 2e-2


def test_checked_mode_names_a_bad_table_eagerly_and_under_checkify(launcher_calls):
    """check_inputs: a used page past the pool, a negative one, a length past the table raise PageTableError naming
    block_tables[b, j] / lengths[b] eagerly; under jit the same rules are checkify user checks (err.get() names the
    entry; the launch then reads an empty table); columns past a sequence's last page may hold anything (-1)."""
    from jax.experimental import checkify

    from xattn.core.paged import PageTableError

    q, k_pages, v_pages, table, n = _case(7, 2, 4, 2, 128, 16, 4, [20, 33])
    num_pages = k_pages.shape[1]
    args = [jnp.asarray(x, jnp.float16) for x in (q, k_pages, v_pages)]
    padded = table.copy()
    padded[0, 2:] = -1  # sequence 0 uses columns 0-1 only
    xj.paged_attention(*args, padded, n, check_inputs=True)  # fine
    cases = [(lambda t: t.__setitem__((1, 2), num_pages), n, f"block_tables[1, 2] = {num_pages}"),
             (lambda t: t.__setitem__((0, 1), -3), n, "block_tables[0, 1] = -3"),
             (lambda t: None, np.asarray([20, 65], np.int32), "lengths[1] = 65")]
    for edit, lengths, words in cases:
        bad = table.copy()
        edit(bad)
        with pytest.raises(PageTableError, match=words.replace("[", r"\[").replace("]", r"\]")):
            xj.paged_attention(*args, bad, lengths, check_inputs=True)
        checked = checkify.checkify(jax.jit(lambda q, kp, vp, t, n: xj.paged_attention(q, kp, vp, t, n,
                                                                                      check_inputs=True)),
                                    errors=checkify.user_checks)
        err, out = checked(*args, bad, lengths)
        assert words in (err.get() or ""), (words, err.get())
        assert np.isfinite(np.asarray(out, np.float32)).all()
    xj.paged_attention(*args, padded, n, check_inputs=False)  # unchecked: trusted, nothing read on the host
    for bad_splits in (-1, 128, 2.0, True):
        with pytest.raises(ValueError, match="num_splits"):
            xj.paged_attention(*args, table, n, num_splits=bad_splits)


def test_the_jax_paged_benchmark_runs_on_the_stand_ins(launcher_calls):
    """benchmarks/paged_jax.py end to end on the NumPy stand-ins: xattn's row is timed, and a call that cannot run
    (Pallas' GPU kernel on a CPU) becomes an error row, not a crash."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "paged_jax.py"
    spec = importlib.util.spec_from_file_location("paged_jax", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    row = bench.measure("xattn", "fa4", 128, 8, 2, 2, 512, 64, dtype="float16")  # (the stand-in has no bf16)
    assert row["status"] == "ok" and row["ms"] > 0 and row["hbm_fraction"] > 0, row
    assert any(c.endswith(":paged") for c in launcher_calls)
    if jax.default_backend() == "cpu":
        assert bench.measure("pallas", "fa4", 128, 8, 2, 1, 256, 64, dtype="float16")["status"].startswith("error")


def test_pallas_tiling_keeps_the_defaults_where_they_run_and_fits_otherwise():
    """The peer's tiling rule (benchmarks/paged_jax.py): Pallas' defaults where they run, else a k_splits that
    divides the table and a block that fits shared memory, None where nothing fits (d512 pages of 256)."""
    from benchmarks.paged_jax import PALLAS_SMEM_BYTES, pallas_tiling

    assert pallas_tiling(64, 16, 128) == dict(pages_per_compute_block=8, k_splits=16)  # the defaults fit
    assert pallas_tiling(512, 256, 128) is None
    for d, ps, width in [(512, 64, 150), (128, 16, 700), (128, 64, 128), (96, 16, 40), (256, 128, 33)]:
        t = pallas_tiling(d, ps, width)
        per_split = width // t["k_splits"]
        assert width % t["k_splits"] == 0 and per_split % t["pages_per_compute_block"] == 0, (d, ps, width, t)
        assert 4 * t["pages_per_compute_block"] * ps * d <= PALLAS_SMEM_BYTES, (d, ps, width, t)


@pytest.mark.parametrize("ps, tiled", [(64, True), (128, False), (16, False)])
def test_fa4_d128_pages_of_64_run_the_decode_tile(launcher_calls, monkeypatch, ps, tiled):
    """FA4 d128 over pages of exactly the decode tile's 64 keys launches on that tile (split_kv.SPLIT_TILES: TMA per
    page on the GPU); other page sizes keep FlashAttention's tile; the results are fp64's either way."""
    from xattn.core.split_kv import SplitFwdSpec
    from xattn.jax import _ffi

    specs, call = [], _ffi.call
    monkeypatch.setattr(_ffi, "call", lambda spec, *a, **kw: (specs.append(spec), call(spec, *a, **kw))[1])
    q, k_pages, v_pages, table, n = _case(ps, 2, 8, 2, 128, ps, -(-700 // ps), [700, 65])
    args = [jnp.asarray(x, jnp.float16) for x in (q, k_pages, v_pages)]
    out = np.asarray(jax.jit(lambda q, kp, vp, t, n: xj.paged_attention(q, kp, vp, t, n, num_splits=3))(
        *args, table, n), np.float64)
    want = _reference(*(np.asarray(a, np.float32) for a in args), table, n)
    assert np.abs(out - want).max() < 0.03 * max(1.0, np.abs(want).max())
    assert [isinstance(s, SplitFwdSpec) for s in specs] == [tiled], specs
    assert not tiled or (specs[0].tile_n, specs[0].page_size) == (64, 64)
