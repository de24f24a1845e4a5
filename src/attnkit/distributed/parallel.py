"""ContextParallel: the component that runs an attention layer on one shard of the sequence.

Legend: B batch, T positions of the whole sequence, n = T / P positions per
rank, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .checks import check_agreement
from .layout import check_layout, num_chunks, rank_and_world, shard, shard_positions, unshard
from .ring import ring_attention


class ContextParallel:
    """Context parallelism for :class:`attnkit.MultiHeadAttention`, passed in at call time.

    A layer keeps its constructor and its parameters (replicated on every
    rank); each rank calls it on its shard of the sequence with this
    component::

        parallel = ContextParallel(group, layout="zigzag")
        x_local = parallel.shard(x, dim=1)              # (B, T, C) -> (B, n, C)
        y_local = layer(x_local, key_mask=parallel.shard(key_mask, dim=1), parallel=parallel)

    The protocol a layer uses (and all it may assume) is three methods:

    - ``check(problem, n)``: every rank passes what is wrong with its own call
      (or None) and its shard length; every rank raises the same ValueError
      if any rank's call is wrong, before any rank starts the ring;

    - ``positions(n, device)`` -> int64 (n,): the global positions of this
      rank's n tokens; the layer rotates queries and keys at these positions
      (``layer.rope.rotate(x, positions)``) instead of 0 .. n - 1;
    - ``attention(q, k, v, *, causal, key_mask)`` -> (B, H, n, D): in place of
      :func:`attnkit.attention`, with q (B, H, n, D), k, v (B, G, n, D)
      (grouped-query heads unexpanded) and key_mask bool (B, n), True = real
      token, or None. It runs :func:`ring_attention`.

    The output is this rank's rows of the single-process layer's output; the
    gradients of the (replicated) parameters summed over ranks (an
    all-reduce, as data parallelism does) are the single-process gradients.
    Not supported under it: sliding windows, attention masks other than a key
    mask, dropout on the weights, KV caches and returned weights.

    Args:
        group: the process group to split across (default: the world).
        layout: "zigzag" (balanced causal work; the default) or "contiguous".
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, layout: str = "zigzag") -> None:
        self.group, self.layout = group, check_layout(layout)
        self.rank, self.world = rank_and_world(group)

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world={self.world}, layout={self.layout!r})"

    def check(self, problem: str | None, local_len: int) -> None:
        """The same ValueError on every rank when any rank's call is invalid (one small all-gather).

        ``problem``: what is wrong with this rank's call, or None; ``local_len``
        = n, this rank's shard length, which every rank must share and the
        layout must split into its chunks.
        """
        per_rank = num_chunks(self.world, self.layout) // self.world
        if problem is None and local_len % per_rank:
            problem = f"a {self.layout!r} shard holds {per_rank} equal chunks, so its length n={local_len} must be even"
        check_agreement((problem, {"shard length n": local_len}), rank=self.rank, world=self.world, group=self.group,
                        what="context-parallel attention")

    def positions(self, local_len: int, device: torch.device | str | None = None) -> Tensor:
        """Global positions (n,) of this rank's ``local_len`` = n tokens, int64."""
        return shard_positions(local_len * self.world, layout=self.layout, group=self.group, device=device)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None = None) -> Tensor:
        """Exact attention of this rank's queries over every rank's keys: (B, H, n, D)."""
        return ring_attention(q, k, v, causal=causal, key_mask=key_mask, layout=self.layout, group=self.group)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-sequence tensor, e.g. (B, T, C) -> (B, n, C)."""
        return shard(x, dim, layout=self.layout, group=self.group)

    def unshard(self, x_local: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (an all-gather), e.g. (B, n, C) -> (B, T, C)."""
        return unshard(x_local, dim, layout=self.layout, group=self.group)
