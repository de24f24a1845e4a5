"""An independent float64 reference for attention, written for clarity, not speed.

It shares no code with attnkit: visibility of each key is spelled out per
query from the definitions in attnkit.attention's docstring.
"""

from __future__ import annotations

import torch
from torch import Tensor


def visible(i: int, j: int, num_queries: int, num_keys: int, causal: bool, window: int | None) -> bool:
    position = i + num_keys - num_queries  # queries are the last T of S positions
    if causal and j > position:
        return False
    return window is None or j > position - window


def reference_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None = None,
                        causal: bool = False, window: int | None = None,
                        scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, Dv), weights (B, H, T, S)) in float64; empty rows give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    b_size, h_size, t_size, d = q.shape
    g_size, s_size = k.shape[1], k.shape[2]
    scale = d**-0.5 if scale is None else scale
    full = None if mask is None else mask.expand(b_size, h_size, t_size, s_size)
    out = torch.zeros(b_size, h_size, t_size, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(b_size, h_size, t_size, s_size, dtype=torch.float64)
    for b in range(b_size):
        for h in range(h_size):
            g = h // (h_size // g_size)  # query head h reads key/value head h // (H // G)
            for i in range(t_size):
                scores = (k[b, g] @ q[b, h, i]) * scale  # (S,)
                keep = torch.tensor([visible(i, j, t_size, s_size, causal, window) for j in range(s_size)])
                if full is not None and full.dtype == torch.bool:
                    keep &= full[b, h, i]
                elif full is not None:
                    scores = scores + full[b, h, i].double()
                keep &= scores > -torch.inf
                if keep.any():
                    w = torch.zeros(s_size, dtype=torch.float64)
                    w[keep] = torch.softmax(scores[keep], dim=0)
                    weights[b, h, i] = w
                    out[b, h, i] = w @ v[b, g]
    return out, weights
