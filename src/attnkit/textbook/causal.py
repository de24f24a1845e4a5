"""Section 3.5: hiding future words with causal attention, and dropout.

Two ways to stop token i from seeing tokens after it, shown to agree:

1. softmax first, then zero the weights above the diagonal and renormalise
   each row (:func:`mask_by_renormalizing`);
2. set the scores above the diagonal to -inf before softmax
   (:func:`mask_with_neg_inf`), which gives those keys exactly zero weight.

Masks passed around here follow attnkit's one convention: True (or 1) = may
attend. The one exception is the ``mask`` buffer of :class:`CausalAttention`,
kept as the book registers it (``triu(ones, diagonal=1)``: 1 marks a *future*
position, which is blocked) so that the book's checkpoints load unchanged.

Legend: B batch, T tokens, d_in input size, d_out projection size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import check_dropout, check_input, check_positive_int


def causal_mask_simple(context_length: int, device: torch.device | None = None) -> Tensor:
    """The book's ``mask_simple``: ``tril(ones)``, 1 = may attend. Shape (T, T)."""
    return torch.tril(torch.ones(context_length, context_length, device=device))


def mask_by_renormalizing(attn_weights: Tensor) -> Tensor:
    """Zero the weights of future tokens, then renormalise each row to sum to one.

    attn_weights (..., T, T) are softmax outputs over all tokens.
    """
    mask_simple = causal_mask_simple(attn_weights.shape[-1], attn_weights.device)  # (T, T)
    masked_simple = attn_weights * mask_simple
    row_sums = masked_simple.sum(dim=-1, keepdim=True)  # (..., T, T) -> (..., T, 1)
    return masked_simple / row_sums


def mask_with_neg_inf(attn_scores: Tensor) -> Tensor:
    """Set the scores of future tokens to -inf, so softmax gives them weight 0.

    attn_scores (..., T, T) are raw query-key scores. Returns a new tensor:
    ``masked_fill`` is not in place, and dropping its result (as notebook 004
    did) leaves the scores unmasked.
    """
    may_attend = causal_mask_simple(attn_scores.shape[-1], attn_scores.device).bool()  # (T, T)
    return attn_scores.masked_fill(~may_attend, -torch.inf)


class CausalAttention(nn.Module):
    """Single-head causal self-attention with dropout on the attention weights.

    Args:
        d_in: size of each input token.
        d_out: size of the queries, keys, values and of the output.
        context_length: the longest input this layer accepts; its causal mask
            buffer is (context_length, context_length).
        dropout: probability in [0, 1) of zeroing an attention weight, in
            training mode only (``model.eval()`` turns it off).
        qkv_bias: whether the three projections have a bias.

    Input (T, d_in) or (B, T, d_in) with T <= context_length; output of the
    same rank with last dimension d_out.
    """

    mask: Tensor

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.context_length = check_positive_int("context_length", context_length)
        p = check_dropout(dropout)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(p)
        # The book's buffer: 1 above the diagonal marks a future (blocked) token.
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, x: Tensor) -> Tensor:
        batch = check_input(x, self.d_in, self.context_length, like=self.W_query.weight)  # (B, T, d_in)
        num_tokens = batch.shape[1]
        keys = self.W_key(batch)  # (B, T, d_in) -> (B, T, d_out)
        queries = self.W_query(batch)
        values = self.W_value(batch)

        attn_scores = queries @ keys.transpose(1, 2)  # (B, T, d_out) @ (B, d_out, T) -> (B, T, T)
        future = self.mask.bool()[:num_tokens, :num_tokens]  # sliced to this input's length
        attn_scores = attn_scores.masked_fill(future, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values  # (B, T, T) @ (B, T, d_out) -> (B, T, d_out)
        return context_vec if x.dim() == 3 else context_vec.squeeze(0)  # (B, T, d_out) -> (T, d_out)
