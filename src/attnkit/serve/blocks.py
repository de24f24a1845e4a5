"""Block bookkeeping for the paged KV cache: reference counts, prefix hashes, least-recently-used reuse.

No tensors here: a block is an index into every layer's storage (see
:mod:`attnkit.serve.paged`). A sequence owns a list of blocks (its block
table); block i holds the keys and values of its positions
i * block_size .. (i + 1) * block_size - 1.

Prefix reuse (vLLM's automatic prefix caching, SGLang's RadixAttention in
spirit): a *full* block is named by a hash chain of its tokens and of every
token before it, so two prompts that start alike share the blocks of their
common full blocks. A block whose last reference goes away is not wiped: it
joins a least-recently-used pool and keeps its hash, so a later prompt can
reuse it until it is evicted to make room.

The traps the anchors fell into, and what happens here instead:

- a fully cached prompt would leave nothing to prefill: its last full block
  is recomputed (into a block of its own), so there are logits to sample;
- two prompts with the same new prefix arriving together: a block is
  *registered* under its hash when allocated but only *ready* once its keys
  are written; a prompt that would reuse a block that is not ready yet waits
  (:meth:`BlockManager.allocate` returns None) instead of duplicating it or
  reading garbage;
- a block taken from the pool for new tokens loses its old hash entry, so no
  stale hash points at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def chain_hash(previous: int | None, tokens: Sequence[int]) -> int:
    """The hash of a full block: its tokens and (through ``previous``) every token before them."""
    return hash((previous, tuple(tokens)))


@dataclass
class Allocation:
    """The blocks of a new sequence and how many of its tokens they already hold."""

    blocks: list[int]
    cached_tokens: int


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` positions, shared by every sequence.

    Args:
        num_blocks: blocks in the pool (per layer, the same indices).
        block_size: positions per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refs = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks  # block -> hash of its tokens (full blocks)
        self.ready = [False] * num_blocks  # a hashed block whose keys and values are written
        self.by_hash: dict[int, int] = {}  # hash -> block
        self.pool: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # free, oldest first
        self.hit_tokens = 0  # prompt tokens served from the prefix cache (for /metrics)

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (some may still hold a reusable prefix)."""
        return len(self.pool)

    def blocks_for(self, tokens: int) -> int:
        """How many blocks ``tokens`` positions need."""
        return -(-tokens // self.block_size)

    def _take(self, after: int | None = None) -> int:
        """A free block for new content, its old hash forgotten: the block after ``after`` when it is free and holds
        no cached prefix (a sequence in consecutive blocks is read as one slice of the pool: :mod:`.paged`), else
        the least recently used."""
        if after is not None and after + 1 in self.pool and self.hashes[after + 1] is None:
            block = after + 1
            del self.pool[block]
        else:
            block, _ = self.pool.popitem(last=False)
        self._forget(block)
        self.refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        """The prefix ``block`` held leaves the cache (its hash, and its entry if it is the hash's block)."""
        old = self.hashes[block]
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.hashes[block], self.ready[block] = None, False

    def _share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.pool[block]
        self.refs[block] += 1

    def _hits(self, tokens: Sequence[int]) -> tuple[list[int], list[int]] | None:
        """Reusable full blocks from the start of ``tokens``, and the hash chain of every full block.

        None when a reusable block is not ready yet (its prompt is still being computed): wait.
        """
        size, h = self.block_size, None
        hits: list[int] = []
        chain: list[int] = []
        full = len(tokens) // size
        for i in range(full):
            h = chain_hash(h, tokens[i * size : (i + 1) * size])
            chain.append(h)
            block = self.by_hash.get(h)
            if block is not None and len(hits) == i:
                if not self.ready[block]:
                    return None
                hits.append(block)
        if hits and len(hits) == full and full * size == len(tokens):
            hits.pop()  # a fully cached prompt: recompute its last block, so that there are logits to sample
        return hits, chain

    def allocate(self, tokens: Sequence[int], reserve: int = 0) -> Allocation | None:
        """Blocks for a new sequence's ``tokens`` (plus room for ``reserve`` more), reusing cached prefixes.

        None if the pool cannot hold it now, or if it would share a block that is still being written.
        """
        found = self._hits(tokens)
        if found is None:
            return None
        hits, chain = found
        needed = self.blocks_for(len(tokens) + reserve) - len(hits)
        reusable_free = sum(1 for b in hits if self.refs[b] == 0)
        if needed > self.free_blocks - reusable_free:
            return None
        for block in hits:
            self._share(block)
        blocks = list(hits)
        for _ in range(needed):
            blocks.append(self._take(blocks[-1] if blocks else None))
        for i in range(len(hits), len(chain)):  # register the new full blocks now, ready once written
            if chain[i] not in self.by_hash:
                self.by_hash[chain[i]] = blocks[i]
                self.hashes[blocks[i]] = chain[i]
        cached = len(hits) * self.block_size
        self.hit_tokens += cached
        return Allocation(blocks, cached)

    def grow(self, blocks: list[int], length: int) -> bool:
        """Make ``blocks`` hold ``length`` positions (one more block when needed); False if the pool is empty."""
        while len(blocks) < self.blocks_for(length):
            if not self.pool:
                return False
            blocks.append(self._take(blocks[-1] if blocks else None))
        return True

    def written(self, blocks: Sequence[int], length: int, tokens: Sequence[int]) -> None:
        """The first ``length`` positions of a sequence now hold keys and values: its full blocks are ready.

        Full blocks that were not registered (filled while decoding) get their hash now, for later reuse.
        """
        size, h = self.block_size, None
        for i in range(length // size):
            h = chain_hash(h, tokens[i * size : (i + 1) * size])
            block = blocks[i]
            if self.hashes[block] is None and h not in self.by_hash:
                self.by_hash[h], self.hashes[block] = block, h
            if self.hashes[block] == h:
                self.ready[block] = True

    def private(self, blocks: list[int]) -> list[tuple[int, int]] | None:
        """Make a sequence's blocks its own before it rewrites them in place (a sink window's eviction): each block
        another sequence shares is replaced in ``blocks`` by a fresh one (the original kept for the others), and so
        is each that holds a cached prefix while free blocks remain (the original stays cached; without room, it
        leaves the cache instead). The (original, copy) pairs whose keys and values the caller must copy; None,
        changing nothing, when the pool has too few free blocks for the shared ones."""
        shared = [i for i, block in enumerate(blocks) if self.refs[block] > 1]
        cached = [i for i, block in enumerate(blocks) if self.refs[block] == 1 and self.ready[block]]
        if len(shared) > len(self.pool):
            return None
        moved = shared + cached[: len(self.pool) - len(shared)]
        copies = [(blocks[i], self._take()) for i in moved]
        for i, (_, copy) in zip(moved, copies, strict=True):
            blocks[i] = copy
        for block in blocks:  # what stays leaves the cache
            self._forget(block)
        self.release([original for original, _ in copies])  # held by the others, or cached and free
        return copies

    def release(self, blocks: Sequence[int]) -> None:
        """Drop a sequence's hold on its blocks; unreferenced ones join the pool (newest last)."""
        for block in reversed(blocks):  # the tail first: a prefix stays cached longer than what follows it
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if not self.ready[block]:  # never written: not reusable
                    self._forget(block)
                self.pool[block] = None
