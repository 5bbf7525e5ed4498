"""Ring attention's logic on the CPU: P gloo processes run xattn.torch.ring_attention with the fp64
stand-in kernels (tests/torch/stubs.py) and compare out and dq/dk/dv with unsharded fp64 attention
of the same global sequence: causal and not, GQA, sliding windows narrower and wider than a chunk,
two-sided windows, P = 2, 3 and 4."""

import json
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.reference import attention as ref_attention
from xattn.torch import ring

# (Hq, Hkv, D, Dv, causal, window); chunk L = 5 per rank and slot, so N_local = 10
CASES = [
    (4, 2, 16, 16, True, (None, None)),
    (4, 4, 16, 16, False, (None, None)),
    (6, 6, 16, 8, True, (None, None)),  # Dv != D: FA4 192/128, whose sm90 backward has no GQA
    (4, 2, 16, 16, True, (3, None)),  # causal + left window: the halo, narrower than a chunk
    (4, 2, 16, 16, False, (7, 0)),    # wider than a chunk: the halo spans two chunks
    (2, 1, 16, 16, False, (2, 3)),    # both sides
    (2, 2, 16, 16, False, (12, 6)),
    (2, 2, 16, 16, False, (0, 0)),
]
CHUNK = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _install_stubs():
    from tests.torch import stubs
    stubs.install_for_process()


def _case(rank, world, case, seed):
    hq, hkv, d, dv, causal, window = case
    n = 2 * world * CHUNK
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, n, h, d, generator=g, dtype=torch.float64) for h in (hq, hkv))
    v = torch.randn(2, n, hkv, dv, generator=g, dtype=torch.float64)
    dout = torch.randn(2, n, hq, dv, generator=g, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_window = (window[0], 0 if causal and window[0] is not None else window[1])
    ref_out, _ = ref_attention(*full, scale=0.3, causal=causal and window[0] is None, window=ref_window)
    ref_out.backward(dout)
    local = [ring.shard_sequence(t, rank=rank, world_size=world).requires_grad_() for t in (q, k, v)]
    out = ring.ring_attention(*local, causal=causal, softmax_scale=0.3, window_size=window)
    out.backward(ring.shard_sequence(dout, rank=rank, world_size=world))
    errs = {"out": (out - ring.shard_sequence(ref_out, rank=rank, world_size=world)).abs().max().item()}
    for name, t, f in zip(("dq", "dk", "dv"), local, full):
        errs[name] = (t.grad - ring.shard_sequence(f.grad, rank=rank, world_size=world)).abs().max().item()
    errs["finite"] = bool(torch.isfinite(out).all())
    gathered = ring.unshard_sequence(out.detach())
    errs["unshard"] = (gathered - ref_out.detach()).abs().max().item()
    x = local[0].detach().clone().requires_grad_()  # replicated loss on the gathered tensor: grad = P x weight
    ring.unshard_sequence(x).mul(q).sum().backward()
    errs["unshard_grad"] = (x.grad - world * ring.shard_sequence(q, rank=rank, world_size=world)).abs().max().item()
    return errs


def _worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _install_stubs()
    results = [_case(rank, world, case, seed=100 + i) for i, case in enumerate(CASES)]
    positions = ring.sequence_positions(4 * world, rank=rank, world_size=world).tolist()
    dist.destroy_process_group()
    with open(f"{path}.{rank}", "w") as f:
        json.dump({"cases": results, "positions": positions}, f)


@pytest.mark.slow  # spawns a process per rank (gloo): CI's second step
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_unsharded_fp64(world, tmp_path):
    path = str(tmp_path / "res")
    mp.start_processes(_worker, args=(world, _free_port(), path), nprocs=world, start_method="spawn")
    for rank in range(world):
        res = json.load(open(f"{path}.{rank}"))
        for case, errs in zip(CASES, res["cases"]):
            assert errs.pop("finite"), (rank, case)
            assert max(errs.values()) < 2e-5, (world, rank, case, errs)  # fp32 merge and accumulators
        a, b = rank, 2 * world - 1 - rank
        assert res["positions"] == [2 * a, 2 * a + 1, 2 * b, 2 * b + 1]


def test_shard_sequence_layout_and_errors():
    x = torch.arange(12).view(1, 12)
    assert ring.shard_sequence(x, rank=0, world_size=3).tolist() == [[0, 1, 10, 11]]
    assert ring.shard_sequence(x, rank=2, world_size=3).tolist() == [[4, 5, 6, 7]]
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size"):
        ring.shard_sequence(torch.zeros(1, 10), rank=0, world_size=3)


def test_ring_attention_bad_inputs():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="even"):
        ring.ring_attention(q[:, :3], q[:, :3], q[:, :3])
    with pytest.raises(ValueError, match="share B and N_local"):
        ring.ring_attention(q, q[:, :2], q[:, :2])
    with pytest.raises(NotImplementedError, match="one unbounded side"):
        ring.ring_attention(q, q, q, causal=False, window_size=(3, None))
    with pytest.raises(RuntimeError, match="not initialised"):
        ring.ring_attention(q, q, q)


def _gemma_worker(rank, world, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _install_stubs()
    from tests.torch import gemma_cp
    from xattn.torch import ffpa_attention as fa
    from xattn.torch.hf import support
    support.kernels_available = lambda: None
    support._DTYPES = (torch.bfloat16, torch.float16, torch.float64)  # the stand-ins run fp64: judge the ring alone
    fa.register_ffpa_attention()
    res = {}
    for n, mode in ((24, "context"), (16, "setup")):  # chunk 6 > window 5; chunk 4 < window (a two-chunk halo)
        ids = torch.randint(0, 96, (2, n), generator=torch.Generator().manual_seed(n))
        truth_loss, truth = gemma_cp.step(gemma_cp.build("sdpa", torch.float64, "cpu"), ids, gemma_cp.targets(ids))
        loss, grads = gemma_cp.sharded_step(gemma_cp.build("ffpa", torch.float64, "cpu"), ids, mode=mode)
        res[f"{n}-{mode}"] = dict(loss=abs(loss - truth_loss) / truth_loss, grads=max(
            float((g - truth[k]).norm() / truth[k].norm()) for k, g in grads.items()), n_grads=len(grads),
            n_truth=len(truth))
    dist.destroy_process_group()
    with open(f"{path}.{rank}", "w") as f:
        json.dump(res, f)


@pytest.mark.slow  # spawns a process per rank (gloo): CI's second step
def test_gemma4_context_parallel_step_matches_one_process(tmp_path):
    """HF Gemma 4 (sliding + full layers), sequence sharded over 2 gloo ranks through "ffpa" under
    context_parallel / setup_ffpa_backend(2, False): loss and every parameter gradient equal the
    unsharded fp64 "sdpa" step."""
    path = str(tmp_path / "res")
    mp.start_processes(_gemma_worker, args=(2, _free_port(), path), nprocs=2, start_method="spawn")
    for rank in range(2):
        for key, r in json.load(open(f"{path}.{rank}")).items():
            assert r["n_grads"] == r["n_truth"] > 10, (key, r)
            assert r["loss"] < 1e-6 and r["grads"] < 1e-5, (rank, key, r)


def _layout_worker(rank, world, port, path):
    """Issue #22 case 6: HF layers under context parallelism with position_ids the ring cannot honour."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _install_stubs()
    from tests.torch import gemma_cp
    from xattn.torch import context_parallel
    from xattn.torch import ffpa_attention as fa
    from xattn.torch.hf import support
    support.kernels_available = lambda: None
    support._DTYPES = (torch.bfloat16, torch.float16, torch.float64)
    fa.register_ffpa_attention()
    model = gemma_cp.build("ffpa", torch.float64, "cpu")
    n = 16
    ids = ring.shard_sequence(torch.randint(0, 96, (2, n), generator=torch.Generator().manual_seed(1)), rank=rank,
                              world_size=world)
    local = n // world
    cases = {
        "contiguous": torch.arange(rank * local, (rank + 1) * local)[None].expand(2, -1),
        "arange": None,  # HF's default positions: 0 .. N_local - 1 on every rank
        "packed": torch.cat([torch.arange(local // 2), torch.arange(local - local // 2)])[None].expand(2, -1),
        "one_rank_off": ring.sequence_positions(n, rank=rank, world_size=world)[None].expand(2, -1).clone(),
    }
    if rank == 1:
        cases["one_rank_off"][1, 0] += 1  # rank 0 is right: it must still raise, not hang in a ring step
    res = {}
    for name, pos in cases.items():
        try:
            with context_parallel():
                model(input_ids=ids, position_ids=pos, use_cache=False)
            res[name] = "ran"
        except ValueError as exc:
            res[name] = str(exc)
    with context_parallel():  # the right layout still runs after the refusals
        model(input_ids=ids, position_ids=ring.sequence_positions(n, rank=rank, world_size=world)[None].expand(2, -1),
              use_cache=False)
    res["right"] = "ran"
    dist.destroy_process_group()
    with open(f"{path}.{rank}", "w") as f:
        json.dump(res, f)


@pytest.mark.slow  # spawns a process per rank (gloo): CI's second step
def test_context_parallel_refuses_positions_off_the_ring_layout(tmp_path):
    path = str(tmp_path / "res")
    mp.start_processes(_layout_worker, args=(2, _free_port(), path), nprocs=2, start_method="spawn")
    for rank in range(2):
        res = json.load(open(f"{path}.{rank}"))
        assert res.pop("right") == "ran"
        for name, msg in res.items():
            assert "position_ids do not match the ring's load-balanced layout" in msg, (rank, name, msg)
