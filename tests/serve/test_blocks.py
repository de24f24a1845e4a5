"""Block bookkeeping: reference counts, prefix hashes, LRU reuse, and the anchors' known bugs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.serve.blocks import Allocation, BlockManager


def written(m: BlockManager, tokens: list[int]) -> Allocation:
    """A new sequence of ``tokens``, allocated and all written (its full blocks cached)."""
    allocation = m.allocate(tokens)
    assert allocation is not None
    m.written(allocation.blocks, len(tokens), tokens)
    return allocation


def test_a_common_prefix_of_full_blocks_is_shared_once_written() -> None:
    m = BlockManager(10, 4)
    a = m.allocate(list(range(10)))  # 2 full blocks + 2 tokens
    assert a is not None and a.cached_tokens == 0 and len(a.blocks) == 3
    m.written(a.blocks, 10, list(range(10)))
    b = m.allocate([*range(8), 99, 98, 97])
    assert b is not None and b.cached_tokens == 8 and b.blocks[:2] == a.blocks[:2] and b.blocks[2] != a.blocks[2]
    assert m.refs[a.blocks[0]] == 2 and m.hit_tokens == 8


def test_two_prompts_with_the_same_new_prefix_in_one_step_do_not_duplicate_blocks() -> None:
    """The second waits until the first has written the shared blocks, then shares them."""
    m = BlockManager(10, 4)
    tokens = list(range(9))
    first = m.allocate(tokens)
    assert first is not None
    assert m.allocate(tokens) is None  # its blocks are registered but not written yet: wait, do not duplicate
    m.written(first.blocks, 9, tokens)
    second = m.allocate(tokens)
    assert second is not None and second.blocks[:2] == first.blocks[:2]


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    """Nothing left to prefill would leave no logits to sample from."""
    m = BlockManager(10, 4)
    tokens = list(range(8))
    first = written(m, tokens)
    again = m.allocate(tokens)
    assert again is not None and again.cached_tokens == 4 and again.blocks[0] == first.blocks[0]
    assert again.blocks[1] != first.blocks[1]


def test_released_blocks_stay_reusable_until_evicted_and_no_stale_hash_survives() -> None:
    m = BlockManager(3, 2)
    a = m.allocate([1, 2, 3, 4])
    assert a is not None
    m.written(a.blocks, 4, [1, 2, 3, 4])
    m.release(a.blocks)
    assert m.free_blocks == 3
    hit = m.allocate([1, 2, 3, 4, 5])  # still cached after release
    assert hit is not None and hit.cached_tokens == 4
    m.release(hit.blocks)
    other = m.allocate([7, 8, 9, 10, 11, 12])  # needs every block: the cached ones are evicted
    assert other is not None and other.cached_tokens == 0
    m.written(other.blocks, 6, [7, 8, 9, 10, 11, 12])
    m.release(other.blocks)
    stale = m.allocate([1, 2, 3, 4])  # its old blocks now hold other tokens: no hit
    assert stale is not None and stale.cached_tokens == 0


def test_a_released_block_that_was_never_written_is_not_a_hit() -> None:
    """A preempted sequence's registered-but-unwritten blocks must not be reused as if they held its tokens."""
    m = BlockManager(6, 2)
    a = m.allocate([1, 2, 3, 4])
    assert a is not None
    m.release(a.blocks)  # preempted before its prefill ran
    b = m.allocate([1, 2, 3, 4])
    assert b is not None and b.cached_tokens == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.booleans()), max_size=12))
def test_every_block_is_either_free_or_referenced(requests: list[tuple[list[int], bool]]) -> None:
    """Reference counts and the free pool stay consistent under any order of allocation and release."""
    m = BlockManager(8, 2)
    held = []
    for tokens, release_one in requests:
        got = m.allocate(tokens, reserve=1)
        if got is not None:
            m.written(got.blocks, len(tokens), tokens)
            held.append(got.blocks)
        if release_one and held:
            m.release(held.pop(0))
    counted = [0] * 8
    for blocks in held:
        for b in blocks:
            counted[b] += 1
    assert counted == m.refs
    assert set(m.pool) == {b for b in range(8) if m.refs[b] == 0}
    for h, b in m.by_hash.items():
        assert m.hashes[b] == h  # no stale entry


def test_a_sequence_about_to_rewrite_its_blocks_copies_the_shared_and_keeps_the_cache() -> None:
    """private(): a shared block is replaced by a copy (the sharer keeps the original), an unshared cached block is
    copied while free blocks remain (the original stays a reusable prefix), else it leaves the cache."""
    m = BlockManager(6, 4)
    tokens = list(range(9))
    a = written(m, tokens)
    b = m.allocate(tokens)
    assert b is not None and b.blocks[:2] == a.blocks[:2]  # 2 shared full blocks; 4 of 6 blocks held
    originals = list(b.blocks)
    copies = m.private(b.blocks)
    assert copies == [(originals[0], b.blocks[0]), (originals[1], b.blocks[1])] and b.blocks[2] == originals[2]
    assert a.blocks[:2] == originals[:2] and m.refs[originals[0]] == 1 and m.free_blocks == 0
    assert m.private(a.blocks) == []  # nothing shared now, and no free block to keep a's cached prefix in
    m.release(b.blocks)
    again = m.allocate(tokens)
    assert again is not None and again.cached_tokens == 0  # a's prefix left the cache; b's copies never joined it


def test_no_blocks_for_the_shared_copies_changes_nothing() -> None:
    m = BlockManager(5, 4)
    tokens = list(range(9))
    written(m, tokens)
    b = m.allocate(tokens, reserve=4)  # 2 shared + 2 new blocks: the pool is full
    assert b is not None and m.free_blocks == 0
    held = list(b.blocks)
    assert m.private(b.blocks) is None and b.blocks == held and m.refs[held[0]] == 2


def test_a_sequence_takes_the_block_after_its_last_when_free_and_keeps_cached_prefixes() -> None:
    """Consecutive blocks are read as one slice of the pool; a free block holding a cached prefix is not taken
    for that (the least recently used one is)."""
    m = BlockManager(12, 4)
    first = written(m, list(range(10)))  # blocks 0, 1 (cached, full) and 2 (partial)
    assert first.blocks == [0, 1, 2]
    m.release(first.blocks)
    turn = [*range(10), 50, 51, 52, 53, 54]  # the next turn of a conversation: its first 8 tokens are found
    second = m.allocate(turn)
    assert second is not None and second.cached_tokens == 8 and second.blocks == [0, 1, 2, 3]
    assert m.grow(second.blocks, 17) and second.blocks == [0, 1, 2, 3, 4]  # one more block, the next one
    other = written(m, [70, 71, 72, 73, 74])  # blocks 5 (cached) and 6
    m.release(other.blocks)
    third = m.allocate([80] * 3)
    assert third is not None and m.grow(third.blocks, 6)  # after block 7 comes 8: free, nothing cached
    assert third.blocks == [7, 8]
    m = BlockManager(4, 2)
    growing = m.allocate([9])  # block 0
    cached = written(m, [1, 2])  # block 1, cached
    m.release(cached.blocks)
    assert growing is not None and m.grow(growing.blocks, 3)
    assert growing.blocks == [0, 2]  # block 1 holds a cached prefix: kept
    found = m.allocate([1, 2, 3])
    assert found is not None and found.cached_tokens == 2
