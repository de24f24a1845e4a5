"""Section 3.3: self-attention without trainable weights.

Every token is its own query, key and value: scores are dot products of the
raw embeddings, weights are their softmax, and each context vector is the
weighted sum of all embeddings. Functions accept one sequence (T, d) or a
batch (B, T, d), the loops included (they loop over the batch too); the
notebooks' ``inputs @ inputs.T`` only worked unbatched.

Legend: B batch, T tokens, d embedding size.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _batched(name: str, inputs: Tensor) -> bool:
    """Whether ``inputs`` is a batch (B, T, d) rather than one sequence (T, d); other ranks are refused."""
    if not isinstance(inputs, Tensor) or inputs.dim() not in (2, 3):
        shape = tuple(inputs.shape) if isinstance(inputs, Tensor) else type(inputs).__name__
        raise ValueError(f"{name}: inputs must be (T, d) or (B, T, d), got {shape}")
    return inputs.dim() == 3


def attn_scores_for_query_loop(inputs: Tensor, query: Tensor) -> Tensor:
    """Scores of one query against every input, one ``torch.dot`` at a time.

    The notebooks' ``attn_scores_2`` loop. inputs (T, d), query (d,) -> (T,);
    batched: inputs (B, T, d), query (B, d) -> (B, T).
    """
    if _batched("attn_scores_for_query_loop", inputs):
        return torch.stack([attn_scores_for_query_loop(x, q) for x, q in zip(inputs, query, strict=True)])
    attn_scores = torch.empty(inputs.shape[0], dtype=inputs.dtype, device=inputs.device)
    for i, x_i in enumerate(inputs):
        attn_scores[i] = torch.dot(x_i, query)
    return attn_scores


def attn_scores_for_query(inputs: Tensor, query: Tensor) -> Tensor:
    """The same scores as one matrix-vector product: (T, d) @ (d,) -> (T,)."""
    return inputs @ query


def attn_scores_loop(inputs: Tensor) -> Tensor:
    """All pairwise scores with two loops: (T, d) -> (T, T), or (B, T, d) -> (B, T, T)."""
    if _batched("attn_scores_loop", inputs):
        return torch.stack([attn_scores_loop(x) for x in inputs])  # B x (T, T) -> (B, T, T)
    num_tokens = inputs.shape[0]
    attn_scores = torch.empty(num_tokens, num_tokens, dtype=inputs.dtype, device=inputs.device)
    for i, x_i in enumerate(inputs):
        for j, x_j in enumerate(inputs):
            attn_scores[i, j] = torch.dot(x_i, x_j)
    return attn_scores


def attn_scores_matrix(inputs: Tensor) -> Tensor:
    """All pairwise scores as one product: (..., T, d) -> (..., T, T)."""
    return inputs @ inputs.transpose(-2, -1)  # (..., T, d) @ (..., d, T) -> (..., T, T)


def normalize_by_sum(attn_scores: Tensor) -> Tensor:
    """Divide each row by its sum (the notebooks' first, fragile normalisation).

    Rows sum to one, but negative scores give negative "weights" and a row
    summing to zero divides by zero: the reason softmax is used instead.
    """
    return attn_scores / attn_scores.sum(dim=-1, keepdim=True)


def softmax_naive(x: Tensor, dim: int = -1) -> Tensor:
    """``exp(x) / sum(exp(x))``, as in the notebooks.

    It overflows: exp(89.0) is already inf in float32, and inf / inf is NaN.
    Kept to show the failure; use :func:`softmax_stable`.
    """
    return torch.exp(x) / torch.exp(x).sum(dim=dim, keepdim=True)


def softmax_stable(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that subtracts the row maximum first, so exp never exceeds 1.

    Equal to :func:`softmax_naive` wherever that one is finite, and to
    ``torch.softmax`` wherever a row has a finite entry. A row that is all
    -inf (every key masked, as for a padding token) gives zeros rather than
    the NaN of ``torch.softmax``, with finite gradients. An empty tensor
    gives an empty result; an integer tensor is refused (weights are fractions).
    """
    if not isinstance(x, Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"softmax_stable needs a floating-point tensor, got {what} (convert it with x.float())")
    if x.numel() == 0:
        return torch.empty_like(x)
    row_max = x.amax(dim=dim, keepdim=True)
    row_max = row_max.masked_fill(row_max == -torch.inf, 0.0)  # all -inf: exp below is all 0
    exp = torch.exp(x - row_max)
    return exp / exp.sum(dim=dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


def context_vec_loop(inputs: Tensor, attn_weights: Tensor) -> Tensor:
    """One context vector as a weighted sum in a loop: (T, d), (T,) -> (d,); batched (B, T, d), (B, T) -> (B, d)."""
    if _batched("context_vec_loop", inputs):
        return torch.stack([context_vec_loop(x, w) for x, w in zip(inputs, attn_weights, strict=True)])
    context_vec = torch.zeros(inputs.shape[1], dtype=inputs.dtype, device=inputs.device)
    for i, x_i in enumerate(inputs):
        context_vec += attn_weights[i] * x_i
    return context_vec


def context_vecs_matrix(attn_weights: Tensor, inputs: Tensor) -> Tensor:
    """All context vectors at once: (..., T, T) @ (..., T, d) -> (..., T, d)."""
    return attn_weights @ inputs


def simple_self_attention(inputs: Tensor) -> Tensor:
    """Scores, softmax and context vectors in one call: (..., T, d) -> (..., T, d)."""
    attn_weights = torch.softmax(attn_scores_matrix(inputs), dim=-1)
    return context_vecs_matrix(attn_weights, inputs)
