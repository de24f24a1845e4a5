"""ContextParallel: the kernel component that runs an attention layer on one shard of the sequence.

Legend: B batch, T positions of the whole sequence, n = T / P positions per
rank, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.backends.kernel import KernelRequest
from attnkit.functional.modifiers import MaskMod, ScoreMod

from .group import check_agreement, rank_and_world
from .layout import check_layout, num_chunks, shard, shard_positions, unshard
from .ring import ring_attention


class ContextParallel:
    """Context parallelism for :class:`attnkit.MultiHeadAttention`: a kernel component, passed as ``backend``.

    A layer keeps its parameters (replicated on every rank) and its one code
    path (projection, rotary embedding, head merge); this component replaces
    the attention in the middle by :func:`ring_attention`. Each rank calls the
    layer on its shard of the sequence::

        parallel = ContextParallel(group, layout="zigzag")
        layer = MultiHeadAttention(512, 512, 8, rope=True, backend=parallel)
        x_local = parallel.shard(x, dim=1)              # (B, T, C) -> (B, n, C)
        y_local = layer(x_local, key_mask=parallel.shard(key_mask, dim=1))

    (``layer.backend = parallel`` switches an existing layer.) It implements
    the kernel protocol of :mod:`attnkit.backends.kernel`:

    - ``prepare(request)``: every rank describes what is wrong with its own
      call (a KV cache, an attention mask, weights, explicit positions, a
      window or dropout in training, a shard length the layout cannot split)
      and every rank raises the same ValueError if any rank's call is wrong,
      before any rank starts the ring; it returns the global positions
      (B, n) of this rank's tokens, at which the layer rotates q and k;
    - ``attention(q, k, v, *, causal, key_mask, scale, score_mod=None,
      mask_mod=None, sinks=None)`` -> (B, H, n, Dv): :func:`ring_attention`
      over q (B, H, n, D), k, v (B, G, n, D) (grouped-query heads
      unexpanded) and key_mask bool (B, n), True = real token, or None. The
      layer's score / mask modifiers see the tokens' global positions in the
      whole sequence (a document mask labels all T positions), and its
      learned sinks join every row's softmax.

    The output is this rank's rows of the single-process layer's output; the
    gradients of the (replicated) parameters summed over ranks (an
    all-reduce, as data parallelism does) are the single-process gradients,
    learned sinks and a modifier's learned tensors (ALiBi slopes, a cap)
    included.

    Args:
        group: the process group to split across (default: the world).
        layout: "zigzag" (balanced causal work; the default) or "contiguous".
    """

    def __init__(self, group: dist.ProcessGroup | None = None, *, layout: str = "zigzag") -> None:
        self.group, self.layout = group, check_layout(layout)
        self.rank, self.world = rank_and_world(group)

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, world={self.world}, layout={self.layout!r})"

    def prepare(self, request: KernelRequest) -> Tensor:
        """Check the layer's call on every rank (one small all-gather); this rank's global positions (B, n)."""
        self.check(request.problem or _unsupported(request), request.length)
        return self.positions(request.length, request.device).expand(request.batch, -1)  # (n,) -> (B, n)

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

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None = None,
                  scale: float | None = None, score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None,
                  sinks: Tensor | None = None) -> Tensor:
        """Exact attention of this rank's queries over every rank's keys, modifiers at global positions:
        (B, H, n, Dv)."""
        return ring_attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale, layout=self.layout,
                              group=self.group, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's part of a whole-sequence tensor, e.g. (B, T, C) -> (B, n, C)."""
        return shard(x, dim, layout=self.layout, group=self.group)

    def unshard(self, x_local: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence from every rank's part (an all-gather), e.g. (B, n, C) -> (B, T, C)."""
        return unshard(x_local, dim, layout=self.layout, group=self.group)


def _unsupported(request: KernelRequest) -> str | None:
    """What this rank's layer call sets that the ring cannot compute, or None."""
    given = [*request.given, *([f"window={request.window} (pass mask_mod=sliding_window({request.window}) "
                                f"instead)"] if request.window is not None else [])]
    if given:
        return ("a context-parallel call takes no positions, kv_cache, attn_mask, need_weights or window "
                "(the layout places the tokens); got " + ", ".join(given))
    if request.dropout_p:
        return f"context-parallel attention has no dropout; got dropout={request.dropout_p} in training"
    return None
