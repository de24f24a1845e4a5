"""The task: random tokens in which a segment of random length reappears later, at a random offset.

The offset must vary: with a fixed one ("the second half repeats the first") a model solves the task from
positions alone, and neither a previous-token head nor an induction head forms.

Legend: B batch, T positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

MIN_SEGMENT = 2  # a repeated segment has at least two tokens: one to match, one to predict




@dataclass(frozen=True)
class Batch:
    """Sequences with one repeated segment each.

    ``tokens[b, second[b] + i] == tokens[b, first[b] + i]`` for ``0 <= i < length[b]``,
    and ``second >= first + length`` (the copies do not overlap).
    """

    tokens: Tensor  # (B, T) int64
    first: Tensor  # (B,) start of the first copy
    second: Tensor  # (B,) start of the repeat
    length: Tensor  # (B,) segment length

    def repeat_positions(self) -> Tensor:
        """(B, T) bool: True at the positions of the repeat (the second copy)."""
        pos = torch.arange(self.tokens.shape[1], device=self.tokens.device)  # (T,)
        return (pos >= self.second[:, None]) & (pos < (self.second + self.length)[:, None])  # (B, T)

    def predictable_targets(self) -> Tensor:
        """(B, T - 1) bool: True where the next token (target of position t) is predictable in context.

        The target of position t is token t + 1; it is predictable when t + 1 lies in the repeat after
        its first token (the first token of the repeat is random: nothing announces the repeat).
        """
        pos = torch.arange(1, self.tokens.shape[1], device=self.tokens.device)  # (T - 1,) target positions
        return (pos > self.second[:, None]) & (pos < (self.second + self.length)[:, None])  # (B, T - 1)


def make_batch(batch_size: int, seq_len: int, vocab_size: int, *, generator: torch.Generator,
               device: str | torch.device = "cpu") -> Batch:
    """Random tokens with a segment of random length (2 .. T // 2) repeated at a random later offset.

    Drawn on the CPU from ``generator`` (so a seed gives the same data on every device), then moved.
    """
    b, t = batch_size, seq_len
    length = torch.randint(MIN_SEGMENT, t // 2 + 1, (b,), generator=generator)  # (B,)
    first = (torch.rand(b, generator=generator) * (t - 2 * length + 1)).long()  # (B,) in [0, T - 2L]
    room = t - length - (first + length) + 1  # choices for the repeat's start: [first + L, T - L]
    second = first + length + (torch.rand(b, generator=generator) * room).long()  # (B,)
    tokens = torch.randint(0, vocab_size, (b, t), generator=generator)  # (B, T)
    pos = torch.arange(t)  # (T,)
    in_repeat = (pos >= second[:, None]) & (pos < (second + length)[:, None])  # (B, T)
    source = (pos - (second - first)[:, None]).clamp(min=0)  # (B, T): where each repeat token comes from
    tokens = torch.where(in_repeat, tokens.gather(1, source), tokens)  # (B, T)
    return Batch(*(x.to(device) for x in (tokens, first, second, length)))
