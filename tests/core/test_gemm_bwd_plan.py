"""The chunked-GEMM backward's framework-neutral plans: blocks, groups, segments, memory bound
(the route choice: test_routes.py)."""

import pytest

from xattn.core import gemm_bwd_plan as gb
from xattn.core.workspace import round_up


@pytest.mark.parametrize("raw", ["0", "-3", "lots"])
def test_bad_budget_is_named(monkeypatch, raw):
    monkeypatch.setenv("XATTN_GEMM_BWD_BUDGET_MIB", raw)
    with pytest.raises(ValueError, match="XATTN_GEMM_BWD_BUDGET_MIB"):
        gb.plan(1, 4096, 4096, 8, True)


@pytest.mark.parametrize("nq, nk, causal", [(1000, 1000, True), (700, 1000, True), (1000, 300, True),
                                            (999, 1001, False)])
def test_blocks_cover_every_row_and_stop_at_the_causal_limit(nq, nk, causal):
    p = gb.plan(1, nq, nk, 4, causal, rows=128)
    assert p.num_blocks * p.rows == p.padded_q >= nq > p.padded_q - p.rows
    assert p.keys_stride % gb.ROW_ALIGN == 0 and p.keys_stride >= nk
    for c, (start, kend) in enumerate(p.blocks):
        assert start == c * p.rows
        last_row = min(start + p.rows, nq) - 1
        want = min(nk, max(0, start + p.rows + nk - nq)) if causal else nk
        assert kend == want
        if causal and kend:  # every key the block's last real row may see is inside [0, kend)
            assert last_row + nk - nq < kend or kend == nk


def test_rows_follow_the_budget():
    mib = 1 << 20
    assert gb.plan(1, 8192, 8192, 32, True, budget=2048 * mib).rows == 1024
    assert gb.plan(1, 8192, 8192, 32, True, budget=256 * mib).rows == 128
    assert gb.plan(1, 8192, 8192, 32, True, budget=1).rows == gb.MIN_BLOCK_ROWS
    assert gb.plan(1, 100, 8192, 32, True, budget=2048 * mib).rows == 128  # never past the query length


def test_causal_blocks_stay_short_noncausal_follow_the_budget():
    """The diagonal square of a causal block is computed whole: blocks stop at CAUSAL_MAX_ROWS."""
    mib = 1 << 20
    assert gb.plan(1, 8192, 8192, 16, True, budget=2048 * mib).rows == gb.CAUSAL_MAX_ROWS == 1024
    assert gb.plan(1, 8192, 8192, 16, False, budget=2048 * mib).rows == 2048
    assert gb.plan(1, 8192, 8192, 4, True, budget=2048 * mib).rows == 1024
    assert gb.plan(1, 8192, 8192, 4, False, budget=2048 * mib).rows == 8192


@pytest.mark.parametrize("nq,hq,causal", [(8192, 32, False), (8192, 16, False), (16384, 16, False),
                                          (16384, 32, True), (5000, 32, False), (3000, 8, True), (100, 4, False)])
def test_blocks_are_even_and_fit_the_budget(nq, hq, causal):
    """The fewest blocks whose P/dS fit the budget, of one length (a 64-row multiple): no short tail
    block, padding under one 64-row step per block."""
    budget = 2048 << 20
    p = gb.plan(1, nq, nq, hq, causal, budget=budget)
    cap = budget // (gb.BYTES_PER_SCORE * hq * p.keys_stride) // 64 * 64
    if causal:
        cap = min(cap, gb.CAUSAL_MAX_ROWS)
    assert p.rows % 64 == 0 and p.rows <= max(cap, 64)
    assert p.num_blocks == -(-nq // max(cap, 64)) or p.rows == 64
    assert p.padded_q - nq < 64 * p.num_blocks


def test_workspace_bound_counts_every_buffer():
    b, nq, nk, hq, hkv, d = 1, 8192, 8192, 32, 4, 512
    p = gb.plan(b, nq, nk, hq, True, budget=2048 << 20)
    got = gb.workspace_bytes(b, nq, nk, hq, hkv, d, True, budget=2048 << 20)
    scores = 6 * b * hq * p.rows * p.keys_stride  # P in q's dtype, P in fp16 (dS reads it), dS
    assert scores <= 2048 << 20
    keys = 2 * 2 * b * hkv * p.keys_stride * d
    assert got >= scores + 8 * b * hkv * nk * d + 3 * 2 * b * hq * p.padded_q * d + keys + gb.DELTA_SLICE_BYTES


def test_varlen_groups_by_length():
    lens = [0, 1, 17, 1000, 8192, 2048, 2000, 60, 900, 880]
    groups = gb.varlen_groups(lens, lens, 32)
    assert [(grp.docs, grp.pad_q) for grp in groups] == [((4,), 8192), ((5, 6), 2048), ((3, 8, 9), 1024),
                                                         ((7, 2, 1), 64)]
    assert [grp.masked_keys for grp in groups] == [False, True, True, True]
    assert all(grp.shift == 0 for grp in groups)
    # a document without keys or rows is in no group; q/k lengths differ: the largest nk - nq
    groups = gb.varlen_groups([10, 0, 30, 9], [40, 9, 0, 37], 4)
    assert [(grp.docs, grp.pad_q, grp.pad_k, grp.shift) for grp in groups] == [((0, 3), 64, 64, 30)]


def test_varlen_groups_pad_little():
    """Every document's padded work (pad_q * pad_k) stays within ~1/(fill^2) of its own, and
    every document is in exactly one group."""
    import random

    rng = random.Random(1)
    lens = [int(2 ** rng.uniform(6, 13)) for _ in range(300)]
    groups = gb.varlen_groups(lens, lens, 32)
    assert sorted(i for grp in groups for i in grp.docs) == list(range(300))
    for grp in groups:
        for i in grp.docs:
            assert lens[i] <= grp.pad_q <= max(round_up(int(lens[i] / gb.GROUP_FILL) + 1, gb.GROUP_ALIGN),
                                               round_up(lens[i], gb.GROUP_ALIGN))
    assert len(groups) < 60


def test_varlen_groups_split_at_the_budget():
    lens = [100] * 50
    one_doc = gb.BYTES_PER_SCORE * 8 * gb.MIN_BLOCK_ROWS * 128
    groups = gb.varlen_groups(lens, lens, 8, budget=10 * one_doc)
    assert [len(grp.docs) for grp in groups] == [10] * 5
    assert sorted(i for grp in groups for i in grp.docs) == list(range(50))
    with pytest.raises(ValueError, match="negative"):
        gb.varlen_groups([3, -1], [3, 1], 8)


def test_keys_per_row():
    assert gb.keys_per_row([2048] * 8, [2048] * 8) == 2048
    assert gb.keys_per_row([100, 900], [100, 900]) == (100 * 100 + 900 * 900) // 1000
    assert gb.keys_per_row([0, 0], [5, 5]) == 0


@pytest.mark.parametrize("nq, nk, rows, pieces", [(8192, 8192, 1024, 4), (1000, 1013, 256, 3), (600, 380, 256, 4),
                                                  (300, 300, 1024, 4), (64, 64, 64, 4)])
def test_diagonal_pieces_cover_each_block_within_its_causal_limit(nq, nk, rows, pieces):
    """Each causal block's pieces tile its real rows (pieces without keys dropped, from the front), their
    key limits grow, sit on the 8-element grid (the last is the block's limit) and cover every row's
    causal limit; non-causal blocks are one piece."""
    p = gb.plan(1, nq, nk, 4, True, rows=rows, pieces=pieces)
    shift = nk - nq
    for (start, kend), cuts in zip(p.blocks, p.pieces):
        real = min(rows, nq - start)
        if not cuts:
            assert kend == 0
            continue
        assert cuts[-1][1] == real and cuts[-1][2] == kend and len(cuts) <= pieces
        assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
        assert not cuts[0][0] or start + cuts[0][0] + shift <= 0  # dropped rows see no key
        for lo, hi, keys in cuts:
            assert lo % 64 == 0 and (keys % 8 == 0 or keys == kend)
            assert min(nk, start + hi + shift) <= keys <= kend  # row hi-1 sees keys < start + hi + shift
        assert [c[2] for c in cuts] == sorted(c[2] for c in cuts)
    flat = gb.plan(1, nq, nk, 4, False, rows=rows, pieces=pieces)
    assert all(len(c) == 1 and c[0][2] == nk for c in flat.pieces)
    with pytest.raises(ValueError, match="pieces"):
        gb.plan(1, nq, nk, 4, True, rows=rows, pieces=0)


@pytest.mark.parametrize("causal", [True, False])
def test_segment_plan_bounds_hold_for_any_mix(causal):
    """segment_plan's static bounds hold for random documents: each block's rows per KV head, the keys a
    piece reads through the overlapping view (spare rows), the accumulator rows; the scratch of one launch
    fits the budget."""
    import random

    from xattn.core.gemm_bwd_plan import BYTES_PER_SCORE, SEGMENT_ACC_ALIGN, segment_plan

    rng = random.Random(0)
    for _ in range(200):
        slots, total = rng.randint(1, 12), rng.randint(1, 5000)
        cuts = sorted(rng.randint(0, total) for _ in range(slots - 1))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        lens[-1] -= rng.randint(0, lens[-1])  # tokens past the last document
        longest, rows = max(lens), rng.choice([None, 8, 64, 256])
        budget = rng.choice([1 << 31, 1 << 22])
        p = segment_plan(total, slots, longest, 8, 2, causal, budget=budget, rows=rows)
        assert len(p.blocks) * p.rows >= longest
        for c, (kend, max_rows) in enumerate(p.blocks):
            assert sum(min(p.rows, max(0, n - c * p.rows)) for n in lens) <= max_rows
            assert kend % 8 == 0 and kend <= p.spare_keys
            if causal:
                assert all(n <= c * p.rows or min(n, (c + 1) * p.rows) <= kend for n in lens)
            else:
                assert kend >= longest
        assert sum(-(-n // SEGMENT_ACC_ALIGN) * SEGMENT_ACC_ALIGN for n in lens) <= p.acc_rows
        per_launch = p.head_groups[0][1]
        assert sum(n for _, n in p.head_groups) == 2 and all(n == per_launch for _, n in p.head_groups)
        if rows is None and p.rows > 64:  # the budget picked rows and heads per launch
            assert max(BYTES_PER_SCORE * 4 * m * k for k, m in p.blocks) * per_launch <= budget


@pytest.mark.parametrize("lens, hq, hkv, causal, budget", [
    ([0, 1, 17, 1000, 8192, 300], 32, 4, True, None),
    ([70, 33, 5000], 8, 1, False, 64 << 20),     # a budget that splits the heads
    ([513], 2, 2, True, None),                   # one row in the last block
])
def test_segment_launches_cover_every_row_once(lens, hq, hkv, causal, budget):
    """Every query row of every head is in exactly one launch's scratch; each launch fits the budget (its
    P, fp16 P and dS) and the memory bound counts at least the scratch, the copies and the accumulators."""
    launches = gb.segment_launches(sum(lens), lens, hq, hkv, causal, budget=budget)
    assert sum(m for _, m in launches) == hq * sum(lens)
    cap = gb.budget_bytes() if budget is None else budget
    assert all(gb.BYTES_PER_SCORE * m * kend <= max(cap, gb.BYTES_PER_SCORE * hq // hkv * 64 * kend)
               for kend, m in launches)
    bound = gb.segment_workspace_bytes(sum(lens), lens, hq, hkv, 512, causal, budget=budget)
    biggest = max(m * kend for kend, m in launches)
    assert bound >= 6 * biggest + 3 * 2 * sum(lens) * hq * 512 + 8 * hkv * sum(lens) * 512
    assert gb.segment_launches(0, [0, 0], hq, hkv, causal) == [] and gb.segment_workspace_bytes(0, [], hq, hkv, 512,
                                                                                               causal) == 0
