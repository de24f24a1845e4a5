"""Section 3.6: from one head to many.

Three forms of the same function:

- :class:`MultiHeadAttentionWrapper` runs ``num_heads`` independent
  :class:`CausalAttention` heads and concatenates their outputs;
- :class:`PerHeadAttention` (notebook 001) writes each head out with its own
  raw projection matrices, concatenates, and projects the result;
- :class:`MultiHeadAttention` projects once with d_out-wide matrices and
  *splits* the result into heads by reshaping (the weight-split form).

:func:`wrapper_to_multihead` loads a wrapper's per-head weights into a
weight-split MultiHeadAttention with an identity ``out_proj``, showing the
two are one function.

Legend: B batch, T tokens, H heads, hd head dim, d_out = H * hd.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._checks import check_divisible, check_dropout, check_input, check_positive_int
from .causal import CausalAttention


class MultiHeadAttentionWrapper(nn.Module):
    """``num_heads`` CausalAttention heads side by side; outputs concatenated.

    Each head has its own d_out, so the output has num_heads * d_out features.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        check_positive_int("num_heads", num_heads)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x: Tensor) -> Tensor:
        """x (T, d_in) or (B, T, d_in) -> (..., T, num_heads * d_out)."""
        return torch.cat([head(x) for head in self.heads], dim=-1)  # H x (B, T, d_out) -> (B, T, H*d_out)


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention with weight splits and an output projection.

    Args:
        d_in: size of each input token.
        d_out: total size of queries, keys, values and output; each of the
            ``num_heads`` heads gets ``head_dim = d_out // num_heads``.
        context_length: the longest input accepted (size of the mask buffer).
        dropout: probability in [0, 1) of zeroing an attention weight, in
            training mode only.
        num_heads: number of heads; must divide d_out.
        qkv_bias: whether W_query, W_key, W_value have a bias.

    Scores are divided by sqrt(head_dim) once (notebook 004 divided twice).
    """

    mask: Tensor

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float,
        num_heads: int,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.d_out = check_positive_int("d_out", d_out)
        self.context_length = check_positive_int("context_length", context_length)
        p = check_dropout(dropout)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.head_dim = check_divisible(d_out, num_heads)

        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)  # combines the heads' outputs
        self.dropout = nn.Dropout(p)
        # The book's buffer: 1 above the diagonal marks a future (blocked) token.
        self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def split_heads(self, t: Tensor) -> Tensor:
        """(B, T, d_out) -> (B, H, T, hd): view the last dim as heads, then bring heads forward."""
        b, num_tokens, _ = t.shape
        return t.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)  # -> (B, H, T, hd)

    def merge_heads(self, t: Tensor) -> Tensor:
        """(B, H, T, hd) -> (B, T, d_out): bring tokens forward again, then join the heads.

        The transpose matters: viewing (B, H, T, hd) directly as (B, T, d_out),
        as notebook 003's step-by-step cell did, mixes tokens and heads.
        """
        b, _, num_tokens, _ = t.shape
        t = t.transpose(1, 2)  # (B, H, T, hd) -> (B, T, H, hd)
        return t.reshape(b, num_tokens, self.d_out)  # (B, T, H, hd) -> (B, T, d_out)

    def forward(self, x: Tensor) -> Tensor:
        """x (T, d_in) or (B, T, d_in) -> (..., T, d_out)."""
        batch = check_input(x, self.d_in, self.context_length, like=self.W_query.weight)  # (B, T, d_in)
        num_tokens = batch.shape[1]
        keys = self.split_heads(self.W_key(batch))  # (B, T, d_in) -> (B, H, T, hd)
        queries = self.split_heads(self.W_query(batch))
        values = self.split_heads(self.W_value(batch))

        attn_scores = queries @ keys.transpose(2, 3)  # (B, H, T, hd) @ (B, H, hd, T) -> (B, H, T, T)
        mask_bool = self.mask.bool()[:num_tokens, :num_tokens]
        attn_scores = attn_scores.masked_fill(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / self.head_dim**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)

        context_vec = attn_weights @ values  # (B, H, T, T) @ (B, H, T, hd) -> (B, H, T, hd)
        out = self.out_proj(self.merge_heads(context_vec))  # (B, H, T, hd) -> (B, T, d_out)
        return out if x.dim() == 3 else out.squeeze(0)  # (B, T, d_out) -> (T, d_out)


def causal_head(x: Tensor, q_proj: Tensor, k_proj: Tensor, v_proj: Tensor) -> tuple[Tensor, Tensor]:
    """One causal head from raw projection matrices, as in notebook 001.

    x (B, T, C); each projection (hs, C), applied as ``x @ proj.T``.
    Returns (out (B, T, hs), attn (B, T, T)). The mask is applied to *this*
    head's own scores: notebook 001 masked the previous cell's ``attn``.
    """
    k = x @ k_proj.T  # (B, T, C) @ (C, hs) -> (B, T, hs)
    q = x @ q_proj.T
    v = x @ v_proj.T
    attn = q @ k.transpose(-2, -1) / k_proj.shape[0] ** 0.5  # (B, T, hs) @ (B, hs, T) -> (B, T, T)
    num_tokens = x.shape[-2]
    tril = torch.tril(torch.ones(num_tokens, num_tokens, device=x.device))  # 1 = may attend
    attn = attn.masked_fill(tril == 0, -torch.inf)
    attn = torch.softmax(attn, dim=-1)
    return attn @ v, attn  # (B, T, T) @ (B, T, hs) -> (B, T, hs)


class PerHeadAttention(nn.Module):
    """Notebook 001's multi-head attention: every head written out separately.

    Each head has its own raw (head_size, d_in) matrices ``k_proj``, ``q_proj``,
    ``v_proj`` (created in that order, from ``torch.rand`` as in the notebook);
    head outputs are concatenated and multiplied by ``multi_head_proj.T``
    of shape (d_out, num_heads * head_size). d_out defaults to head_size, as in
    the notebook. No bias anywhere; no length limit.
    """

    def __init__(self, d_in: int, head_size: int, num_heads: int, d_out: int | None = None) -> None:
        super().__init__()
        self.d_in = check_positive_int("d_in", d_in)
        self.head_size = check_positive_int("head_size", head_size)
        self.num_heads = check_positive_int("num_heads", num_heads)
        self.d_out = head_size if d_out is None else check_positive_int("d_out", d_out)
        self.k_proj, self.q_proj, self.v_proj = nn.ParameterList(), nn.ParameterList(), nn.ParameterList()
        for _ in range(num_heads):
            self.k_proj.append(nn.Parameter(torch.rand(head_size, d_in)))
            self.q_proj.append(nn.Parameter(torch.rand(head_size, d_in)))
            self.v_proj.append(nn.Parameter(torch.rand(head_size, d_in)))
        self.multi_head_proj = nn.Parameter(torch.rand(self.d_out, head_size * num_heads))

    def forward(self, x: Tensor) -> Tensor:
        """x (T, d_in) or (B, T, d_in) -> (..., T, d_out)."""
        batch = check_input(x, self.d_in, like=self.multi_head_proj)  # (B, T, d_in)
        heads = zip(self.q_proj, self.k_proj, self.v_proj, strict=True)
        outs = [causal_head(batch, q, k, v)[0] for q, k, v in heads]  # H x (B, T, hs)
        concat_attention_output = torch.cat(outs, dim=-1)  # H x (B, T, hs) -> (B, T, H*hs)
        out = concat_attention_output @ self.multi_head_proj.T  # (B, T, H*hs) -> (B, T, d_out)
        return out if x.dim() == 3 else out.squeeze(0)  # (B, T, d_out) -> (T, d_out)


def wrapper_to_multihead(wrapper: MultiHeadAttentionWrapper) -> MultiHeadAttention:
    """A weight-split MultiHeadAttention computing the same function as ``wrapper``.

    Head h's W_query / W_key / W_value become rows h*d_out .. (h+1)*d_out - 1
    of the stacked projections, and ``out_proj`` is the identity (weight I,
    bias 0). The result has d_out = num_heads * (the wrapper's per-head d_out).
    """
    heads = list(wrapper.heads)
    first = heads[0]
    if not isinstance(first, CausalAttention):
        raise TypeError(f"wrapper.heads must hold CausalAttention, got {type(first).__name__}")
    d_out = first.d_out * len(heads)
    mha = MultiHeadAttention(
        first.d_in,
        d_out,
        first.context_length,
        first.dropout.p,
        num_heads=len(heads),
        qkv_bias=first.W_query.bias is not None,
    ).to(device=first.W_query.weight.device, dtype=first.W_query.weight.dtype)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            target: nn.Linear = getattr(mha, name)
            target.weight.copy_(torch.cat([getattr(h, name).weight for h in heads]))  # H x (d, d_in)
            if target.bias is not None:
                target.bias.copy_(torch.cat([getattr(h, name).bias for h in heads]))
        mha.out_proj.weight.copy_(torch.eye(d_out))
        mha.out_proj.bias.zero_()
    return mha
