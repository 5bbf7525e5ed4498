"""The framework-neutral layout arithmetic of context parallelism (xattn.core.ring_layout), checked
by brute force against the global token positions it stands for."""

import pytest

from xattn.core.ring_layout import causal_ring_source, chunk_length, chunk_owner, chunks_of, halo_plan


def test_every_chunk_has_one_owner_and_slot():
    for world in range(1, 6):
        held = [(r, slot, c) for r in range(world) for slot, c in enumerate(chunks_of(world, r))]
        assert sorted(c for *_, c in held) == list(range(2 * world))
        for r, slot, c in held:
            assert chunk_owner(c, world) == (r, slot)


def _positions(pieces, chunk, world, tail_width=None):
    """Global token positions of (rank, slot, lo, hi) edge slices; tails are a chunk's last ``tail_width`` tokens."""
    out = []
    for r, slot, lo, hi in pieces:
        c = chunks_of(world, r)[slot]
        start = c * chunk + (chunk - tail_width if tail_width is not None else 0)
        out += list(range(start + lo, start + hi))
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("chunk", [1, 5, 8])
@pytest.mark.parametrize("left, right", [(0, 0), (3, 0), (5, 0), (8, 0), (13, 0), (40, 0), (2, 7), (0, 9), (17, 17)])
def test_halo_plan_is_exactly_the_window_keys_outside_the_chunk(world, chunk, left, right):
    n = 2 * world * chunk
    for c in range(2 * world):
        plan = halo_plan(c, world, chunk, left, right)
        before = _positions(plan.before, chunk, world, tail_width=min(left, chunk))
        after = _positions(plan.after, chunk, world)
        assert before == list(range(max(0, c * chunk - left), c * chunk))
        assert after == list(range((c + 1) * chunk, min(n, (c + 1) * chunk + right)))
        assert (plan.left_len, plan.right_len) == (len(before), len(after))
        # query i of the chunk is key left_len + i of [before, chunk, after]; the shifted window keeps its keys
        w_left, w_right = plan.window(left, right)
        q_aligned = plan.left_len + plan.right_len  # bottom-right alignment offset of Nk - Nq
        assert (w_left, w_right) == (left + plan.right_len, right - plan.right_len)
        for i in range(chunk):
            lo, hi = i + q_aligned - w_left, i + q_aligned + w_right
            glob = before + list(range(c * chunk, (c + 1) * chunk)) + after
            seen = [glob[j] for j in range(len(glob)) if lo <= j <= hi]
            g = c * chunk + i
            assert seen == [p for p in range(n) if g - left <= p <= g + right]


def test_chunk_length_and_its_errors():
    assert chunk_length(24, 3) == 4
    with pytest.raises(ValueError, match="multiple of 2 \\* world_size = 6"):
        chunk_length(10, 3, "shard_sequence")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="world_size"):
            chunk_length(8, bad)


def test_causal_ring_source():
    assert [causal_ring_source(2, 4, s) for s in (1, 2, 3)] == [(1, True), (0, True), (3, False)]
