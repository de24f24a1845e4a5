"""Layouts and the ring's schedule, without processes: which positions a rank holds, which blocks it computes."""

from __future__ import annotations

import pytest

from attnkit.distributed.layout import check_length, chunk_positions
from attnkit.distributed.ring import _pairs, _Spec


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_position_is_held_by_exactly_one_rank(layout, world):
    t = 4 * world
    held = [p for r in range(world) for chunk in chunk_positions(r, world, layout, t) for p in chunk]
    assert sorted(held) == list(range(t))


def test_zigzag_rank_holds_chunk_r_and_its_mirror():
    assert chunk_positions(0, 2, "zigzag", 8) == [range(0, 2), range(6, 8)]
    assert chunk_positions(1, 2, "zigzag", 8) == [range(2, 4), range(4, 6)]
    assert chunk_positions(1, 2, "contiguous", 8) == [range(4, 8)]


def test_a_length_the_layout_cannot_split_names_the_multiple():
    with pytest.raises(ValueError, match=r"length 10 .* over P=4 ranks: it must be a positive multiple of 8 \(2P\)"):
        check_length(10, 4, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of 3 \(P\)"):
        check_length(10, 3, "contiguous")


def _work(world: int, layout: str, rank: int) -> int:
    """Chunk pairs rank ``rank`` computes over the whole ring under causal attention (diagonal pairs count 1/2)."""
    spec = _Spec(True, 1.0, layout, rank, world, None, 8 * world)
    return sum(1 if causal is False else 0.5 for src in range(world)
               for _, _, causal, _ in _pairs(spec, src))  # type: ignore[misc]


@pytest.mark.parametrize("world", [2, 4])
def test_causal_ring_skips_hidden_blocks_and_zigzag_balances_them(world):
    """Contiguous: rank r computes r + 1/2 chunk pairs (later ranks more); zigzag: every rank the same."""
    contiguous = [_work(world, "contiguous", r) for r in range(world)]
    assert contiguous == [r + 0.5 for r in range(world)]  # key chunks after a rank's queries are skipped
    zigzag = [_work(world, "zigzag", r) for r in range(world)]
    assert zigzag == [2 * world] * world  # (2P)^2 / 2 pairs of chunks in all, the same share on each rank


def test_non_causal_ring_computes_every_pair():
    spec = _Spec(False, 1.0, "zigzag", 0, 2, None, 16)
    assert all(len(_pairs(spec, src)) == 4 for src in range(2))
