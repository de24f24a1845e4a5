"""Per-head scores read from attention weights: induction and previous-token.

Legend: B batch, H heads, T queries, S keys (= T).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .data import Batch


def _check_weights(weights: Tensor, batch: Batch | None = None) -> None:
    if not isinstance(weights, Tensor) or weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"weights must be (B, H, T, T) self-attention weights, got {shape}")
    if batch is not None and (weights.shape[0], weights.shape[2]) != tuple(batch.tokens.shape):
        raise ValueError(f"weights {tuple(weights.shape)} do not match the batch's tokens "
                         f"{tuple(batch.tokens.shape)}: expected (B, H, T, T) with (B, T) = tokens' shape")


def induction_scores(weights: Tensor, batch: Batch) -> Tensor:
    """(H,) mean attention from each position of the repeat to the position after its token's first copy.

    For a query at ``second + i`` the induction target is ``first + i + 1``; ``weights`` are (B, H, T, T).
    A perfect induction head scores 1.
    """
    _check_weights(weights, batch)
    b, _, t, _ = weights.shape
    pos = torch.arange(t, device=weights.device)  # (T,)
    target = (pos - (batch.second - batch.first)[:, None] + 1).clamp(0, t - 1)  # (B, T) key index per query
    picked = weights.gather(3, target[:, None, :, None].expand(b, weights.shape[1], t, 1))[..., 0]  # (B, H, T)
    query = batch.repeat_positions().to(weights.dtype)[:, None, :]  # (B, 1, T)
    return (picked * query).sum(dim=(0, 2)) / query.sum()  # (B, H, T) -> (H,)


def previous_token_scores(weights: Tensor) -> Tensor:
    """(H,) mean attention from every position t >= 1 to position t - 1; ``weights`` are (B, H, T, T)."""
    _check_weights(weights)
    if weights.shape[-1] < 2:
        raise ValueError(f"previous-token scores need T >= 2 positions, got weights {tuple(weights.shape)}")
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))  # (B, H, T - 1) -> (H,)
