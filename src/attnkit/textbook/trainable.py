"""Section 3.4: self-attention with trainable weights (scaled dot-product).

Three trainable matrices project each token into a query, a key and a value;
scores are query-key dot products scaled by sqrt(d_out), weights are their
softmax, and context vectors are the weighted sums of the values.

Both classes take one sequence (T, d_in) as in the book, or a batch
(B, T, d_in); the notebooks' ``queries @ keys.T`` worked only unbatched.

Legend: B batch, T tokens, d_in input size, d_out projection size.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import check_input, check_positive_int


def _scaled_attention(queries: Tensor, keys: Tensor, values: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(d_out)) v for (B, T, d_out) inputs."""
    attn_scores = queries @ keys.transpose(-2, -1)  # (B, T, d_out) @ (B, d_out, T) -> (B, T, T)
    attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
    return attn_weights @ values  # (B, T, T) @ (B, T, d_out) -> (B, T, d_out)


class SelfAttention_v1(nn.Module):
    """Self-attention with weight matrices stored as ``nn.Parameter`` (d_in, d_out).

    Parameters are created in the book's order, W_query, W_key, W_value, each
    from ``torch.randn``, so ``torch.manual_seed(123)`` reproduces the notebooks.
    Projections are ``x @ W``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.W_query = nn.Parameter(torch.randn(d_in, d_out))
        self.W_key = nn.Parameter(torch.randn(d_in, d_out))
        self.W_value = nn.Parameter(torch.randn(d_in, d_out))

    def forward(self, x: Tensor) -> Tensor:
        """x (T, d_in) or (B, T, d_in) -> context vectors of the same rank, last dim d_out."""
        batch = check_input(x, self.d_in, like=self.W_query)  # (B, T, d_in)
        keys = batch @ self.W_key  # (B, T, d_in) @ (d_in, d_out) -> (B, T, d_out)
        queries = batch @ self.W_query
        values = batch @ self.W_value
        context_vec = _scaled_attention(queries, keys, values)  # (B, T, d_out)
        return context_vec if x.dim() == 3 else context_vec.squeeze(0)  # (B, T, d_out) -> (T, d_out)


class SelfAttention_v2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (better initialisation, optional bias).

    ``nn.Linear`` stores its weight as (d_out, d_in) and computes ``x @ weight.T``.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, d_in) or (B, T, d_in) -> context vectors of the same rank, last dim d_out."""
        batch = check_input(x, self.d_in, like=self.W_query.weight)  # (B, T, d_in)
        keys = self.W_key(batch)  # (B, T, d_in) -> (B, T, d_out)
        queries = self.W_query(batch)
        values = self.W_value(batch)
        context_vec = _scaled_attention(queries, keys, values)  # (B, T, d_out)
        return context_vec if x.dim() == 3 else context_vec.squeeze(0)  # (B, T, d_out) -> (T, d_out)


def transfer_v2_to_v1(sa_v2: SelfAttention_v2, sa_v1: SelfAttention_v1) -> SelfAttention_v1:
    """Copy a v2's Linear weights into a v1 (the book's exercise 3.1); returns ``sa_v1``.

    ``nn.Linear`` keeps (d_out, d_in) and v1 keeps (d_in, d_out), so each weight
    is transposed. Afterwards both modules compute the same function.
    """
    if (sa_v2.d_in, sa_v2.d_out) != (sa_v1.d_in, sa_v1.d_out):
        raise ValueError(
            f"shapes differ: SelfAttention_v2(d_in={sa_v2.d_in}, d_out={sa_v2.d_out}) vs "
            f"SelfAttention_v1(d_in={sa_v1.d_in}, d_out={sa_v1.d_out})"
        )
    if sa_v2.W_query.bias is not None:
        raise ValueError("SelfAttention_v2 has qkv_bias=True, but SelfAttention_v1 has no bias to hold it")
    with torch.no_grad():
        sa_v1.W_query.copy_(sa_v2.W_query.weight.T)  # (d_out, d_in) -> (d_in, d_out)
        sa_v1.W_key.copy_(sa_v2.W_key.weight.T)
        sa_v1.W_value.copy_(sa_v2.W_value.weight.T)
    return sa_v1
