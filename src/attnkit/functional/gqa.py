"""Grouped-query attention: H query heads share G key/value heads.

Query head h reads key/value head h // (H // G), as in Llama and
``scaled_dot_product_attention(enable_gqa=True)``: consecutive query heads
form a group. G = H is multi-head attention, G = 1 multi-query attention.

Legend: B batch, H query heads, G key/value heads, S keys, D head dim.
"""

from __future__ import annotations

from torch import Tensor


def expand_kv(x: Tensor, num_heads: int) -> Tensor:
    """(B, G, S, D) -> (B, H, S, D): each key/value head repeated for its H // G query heads."""
    groups = x.shape[1]
    if groups == num_heads:
        return x
    return x.repeat_interleave(num_heads // groups, dim=1)  # (B, G, S, D) -> (B, H, S, D)
