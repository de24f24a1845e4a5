"""Cross-attention: queries from one sequence, keys and values from another.

Notation (shape comments): B batch, T queries, S context positions, H query
heads, G key/value heads, D head dim, C = H * D (= d_out unless Heads gives D).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .heads import AttentionHeads, Heads, factory_kwargs, positive_int


class CrossAttention(AttentionHeads):
    """Multi-head attention from x (B, T, d_in) to a context (B, S, d_context), as in encoder-decoders.

    Args:
        d_in: size of each query token.
        d_out: size of the output, split into ``num_heads`` heads.
        num_heads: query heads (H), or a :class:`~attnkit.modules.heads.Heads`
            (key/value heads, a head size of its own, the scale of the scores).
        d_context: size of each context token.
        num_kv_heads: key/value heads (G), dividing num_heads; None means num_heads.
        dropout: probability of dropping an attention weight, in training mode only.
        qkv_bias, out_bias: biases of the input and output projections.
        backend: kernel for :func:`attnkit.attention`.
        device, dtype: where and how the parameters are created.

    Parameters: ``q_proj`` (d_in -> C), ``kv_proj`` (d_context -> 2 * G * D;
    rows are keys, then values) and ``out_proj`` (C -> d_out). Not
    causal, no rotary embedding, no KV cache: every query sees the whole
    context, except where ``key_mask`` or ``attn_mask`` hide it.
    """

    def __init__(self, d_in: int, d_out: int, num_heads: int | Heads, *, d_context: int,
                 num_kv_heads: int | None = None,
                 dropout: float = 0.0, qkv_bias: bool = False, out_bias: bool = True, backend: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"CrossAttention's backend must be a backend's name (str), got {type(backend).__name__}; "
                            "kernel components (e.g. ContextParallel) serve MultiHeadAttention")
        factory = factory_kwargs(device, dtype)
        super().__init__(d_in, d_out, num_heads, num_kv_heads=num_kv_heads, causal=False, window=None,
                         dropout=dropout, out_bias=out_bias, backend=backend, factory=factory)
        self.d_context = positive_int("d_context", d_context)
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=qkv_bias, **factory)
        self.kv_proj = nn.Linear(d_context, 2 * self.num_kv_heads * self.head_dim, bias=qkv_bias, **factory)

    def extra_repr(self) -> str:
        return f"{self._heads_repr()}, d_context={self.d_context}, dropout={self.dropout}, backend={self.backend!r}"

    def project(self, x: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, G, S, D)."""
        q = self.q_proj(x)  # (B, T, d_in) -> (B, T, C)
        k, v = self.kv_proj(context).chunk(2, dim=-1)  # (B, S, d_context) -> 2 x (B, S, GD)
        return self.split(q, self.num_heads), self.split(k, self.num_kv_heads), self.split(v, self.num_kv_heads)

    def forward(self, x: Tensor, context: Tensor, *, key_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, T, d_in) to ``context`` (B, S, d_context).

        Args:
            key_mask: bool (B, S), True where a context position is a real
                token (False = padding).
            attn_mask: bool (True = may attend) or float (added to the
                scores), broadcastable to (B, H, T, S).
            need_weights: also return the weights (B, H, T, S).

        Returns: (B, T, d_out), or (output, weights) with ``need_weights``.
        """
        self.check_x(x)
        self.check_x(context, "context", self.d_context)
        if context.shape[0] != x.shape[0]:
            raise ValueError(f"context has batch size {context.shape[0]} but x has {x.shape[0]}")
        q, k, v = self.project(x, context)
        return self.attend(q, k, v, key_mask=key_mask, attn_mask=attn_mask, need_weights=need_weights)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The same layer as a ``torch.nn.MultiheadAttention`` (see :func:`attnkit.modules.convert.to_torch`)."""
        from .convert import to_torch

        self.check_torch_equivalent()
        return to_torch(self, batch_first=batch_first)
