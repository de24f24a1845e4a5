"""Layouts and the ring's schedule, without processes: which positions a rank holds, which blocks it computes."""

from __future__ import annotations

import pytest
import torch

from attnkit.distributed.layout import check_length, chunk_positions
from attnkit.distributed.ring import RingSpec, blocks, hop_tick, phase


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
    with pytest.raises(ValueError, match=r"length -8 .* a positive multiple of 4"):
        check_length(-8, 2, "zigzag")
    with pytest.raises(ValueError, match=r"multiple of 3 \(P\)"):
        check_length(10, 3, "contiguous")


def _work(world: int, layout: str, rank: int, tick: int | None = None) -> float:
    """Chunk pairs rank ``rank`` computes over the ring under causal attention (diagonal pairs count 1/2),
    in one tick of the forward schedule or over all of them."""
    spec = RingSpec(True, 1.0, layout, rank, world, None, 2 * 1024 * world)
    pieces = spec.pieces()
    phases = [phase(t, world, len(pieces), 1) for t in (range(len(pieces) * world) if tick is None else [tick])]
    share = 1 / len(pieces)  # of a chunk, per piece
    q = torch.empty(1, 1, spec.length // world, 1)  # (B, H, n, D): only its shape plans the blocks
    return sum(share * (1 if plan.causal is False else 0.5) for index, hops in phases
               for _, _, plan in blocks(spec, q, (rank - hops) % world, pieces[index]))


@pytest.mark.parametrize("world", [2, 4])
def test_causal_ring_skips_hidden_blocks_and_zigzag_balances_them(world):
    """Contiguous: rank r computes r + 1/2 chunk pairs (later ranks more); zigzag: every rank the same,
    in every tick of the schedule and not only in total."""
    contiguous = [_work(world, "contiguous", r) for r in range(world)]
    torch.testing.assert_close(contiguous, [r + 0.5 for r in range(world)])  # hidden key chunks are skipped
    zigzag = [_work(world, "zigzag", r) for r in range(world)]
    torch.testing.assert_close(zigzag, [2.0 * world] * world)  # (2P)^2 / 2 pairs in all, the same share each
    pieces = len(RingSpec(True, 1.0, "zigzag", 0, world, None, 2 * 1024 * world).pieces())
    for tick in range(pieces * world):
        per_rank = [_work(world, "zigzag", r, tick) for r in range(world)]
        assert max(per_rank) - min(per_rank) < 0.5 / pieces, (tick, per_rank)  # at most a diagonal's rounding


def test_non_causal_ring_computes_every_pair():
    spec = RingSpec(False, 1.0, "zigzag", 0, 2, None, 16)
    q = torch.empty(1, 1, 8, 1)  # (B, H, n, D)
    assert all(len(blocks(spec, q, src, keys)) == 4 for src in range(2) for keys in spec.pieces())


@pytest.mark.parametrize(("layout", "world", "length", "rows"), [
    ("contiguous", 1, 1024, 128), ("contiguous", 2, 4096, 256), ("contiguous", 4, 2048, 128),  # 64 -> at least 128
    ("zigzag", 2, 4096, 128), ("zigzag", 4, 65536, 1024), ("zigzag", 4, 8 * 1025, 129),  # ceil(1025 / 8)
    ("zigzag", 3, 600, 100),  # at most the chunk
])
def test_a_piece_is_an_eighth_of_each_chunk_at_least_128_positions(layout, world, length, rows):
    spec = RingSpec(True, 1.0, layout, 0, world, None, length)
    size = len(spec.chunks(0)[0])
    pieces = spec.pieces()
    assert [p for r in pieces for p in r] == list(range(size))  # in order, each position of a chunk once
    assert len(pieces[0]) == rows


@pytest.mark.parametrize("hop_ticks", [1, 2])
@pytest.mark.parametrize(("world", "num_pieces"), [(1, 3), (2, 1), (2, 5), (4, 3), (4, 8)])
def test_schedule_every_rank_meets_every_piece_once_after_the_rank_before_it(world, num_pieces, hop_ticks):
    """At each tick all ranks compute the same (piece j, hops h), one piece a tick; piece j of rank s is at
    rank s + h at tick hop_tick(j, h), hop_ticks after it was at rank s + h - 1."""
    ticks = hop_tick(num_pieces - 1, world - 1, world, hop_ticks) + 1
    seen = {}
    for tick in range(-2, ticks + 2 * world):
        now = phase(tick, world, num_pieces, hop_ticks)
        if now is not None:
            assert 0 <= tick < ticks and now not in seen
            seen[now] = tick
    assert sorted(seen) == [(j, h) for j in range(num_pieces) for h in range(world)]  # all, each once
    for (index, hops), tick in seen.items():
        assert tick == hop_tick(index, hops, world, hop_ticks)
        if hops:
            assert seen[(index, hops - 1)] == tick - hop_ticks
    idle = ticks - len(seen)
    assert idle == (world - 1 if hop_ticks == 2 and num_pieces % 2 else 0)  # an odd last piece has no partner
