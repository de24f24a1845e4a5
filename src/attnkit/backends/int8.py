"""Attention over int8 keys and values with PyTorch's int8 weight kernel (``torch._weight_int8pack_mm``).

The storage is :class:`attnkit.modules.int8_storage.Int8Storage`'s: keys as int8
codes (B, G, S, D) with one bfloat16 scale per (row, head, position); values
transposed, (B, G, Dv, C) codes over the whole allocation of C >= S positions,
with one float32 scale per position that multiplies the probabilities first:
``out = (p * scale) @ codes^T``. The kernel takes one (row, key/value head) at
a time, contiguous weights whose inner size is a multiple of 16, queries and
probabilities in bfloat16; everything between its two calls runs on every
(row, head) at once.

Legend: B batch, G key/value heads, R query heads per key/value head, H = G * R,
T queries, S positions held, C positions allocated (>= S), D head dim, Dv value
head dim, N = R * T query rows per key/value head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .math import softmax_rows


def int8_attention(q: Tensor, k_codes: Tensor, k_scale: Tensor, v_codes_t: Tensor, v_scale: Tensor, scale: float,
                   visible: Tensor | None) -> Tensor:
    """softmax(q k^T * scale) v over int8 keys and values: q (B, H, T, D) -> (B, H, T, Dv) in q's dtype.

    ``k_codes`` (B, G, S, D) int8, ``k_scale`` (B, G, S) bfloat16, ``v_codes_t`` (B, G, Dv, C) int8,
    ``v_scale`` (B, G, S) float32; ``visible`` bool (B, 1, T, S), True = may attend, or None (every key).
    A query that sees no key gets 0.
    """
    b, h, t, d = q.shape
    if q.device.type != "cpu" or d % 16:
        raise ValueError(f"the int8 kernel reads CPU tensors with a head dim that is a multiple of 16, got head "
                         f"dim {d} on {q.device} (dequantise the keys instead)")
    g, s, dv, c = k_codes.shape[1], k_codes.shape[2], v_codes_t.shape[2], v_codes_t.shape[3]
    pairs = [(i, j) for i in range(b) for j in range(g)]
    rows = (q * scale).reshape(b, g, h // g * t, d).to(torch.bfloat16)  # (B, H, T, D) -> (B, G, N, D)
    scores = torch.stack([torch._weight_int8pack_mm(rows[i, j], k_codes[i, j], k_scale[i, j])
                          for i, j in pairs]).float().view(b, g, -1, s)  # B * G of (N, S) -> (B, G, N, S)
    if visible is None:
        p = torch.softmax(scores, dim=-1)  # (B, G, N, S)
    else:
        hidden = ~visible[:, :, None]  # (B, 1, T, S) -> (B, 1, 1, T, S)
        scores = scores.view(b, g, -1, t, s).masked_fill(hidden, -torch.inf).view(b, g, -1, s)  # (B, G, N, S)
        p = softmax_rows(scores)  # (B, G, N, S), 0 for a query that sees no key
    p = F.pad((p * v_scale[:, :, None]).to(torch.bfloat16), (0, c - s))  # (B, G, N, S) -> (B, G, N, C)
    ones = torch.ones(dv, dtype=torch.bfloat16, device=q.device)  # per-output scale: values are scaled per key
    out = torch.stack([torch._weight_int8pack_mm(p[i, j], v_codes_t[i, j], ones)
                       for i, j in pairs])  # B * G of (N, C) @ (Dv, C)^T -> (B * G, N, Dv)
    return out.view(b, g, h // g, t, dv).reshape(b, h, t, dv).to(q.dtype)  # (B * G, N, Dv) -> (B, H, T, Dv)
