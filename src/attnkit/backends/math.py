"""The explicit reference: scores, mask, softmax, weights @ values, all materialised.

Memory is O(B * H * T * S). Half-precision inputs are computed in float32.
A query with no visible key gets weight 0 on every key and output 0.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.functional import expand_kv

from .call import AttentionCall
from .registry import Backend, register

_UPCAST = (torch.float16, torch.bfloat16)


def math_attention(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, Dv), weights (B, H, T, S)); weights are taken before dropout."""
    compute = torch.float32 if call.q.dtype in _UPCAST else call.q.dtype
    q = call.q.to(compute)
    k = expand_kv(call.k, call.num_heads).to(compute)  # (B, G, S, D) -> (B, H, S, D)
    v = expand_kv(call.v, call.num_heads).to(compute)
    scores = (q @ k.transpose(-2, -1)) * call.scale  # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    mask = call.dense_mask()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        scores = scores + mask.to(compute)
    empty = scores.amax(dim=-1, keepdim=True) == -torch.inf  # (B, H, T, 1): no visible key
    scores = scores.masked_fill(empty, 0.0)  # finite softmax there; zeroed just below
    weights = torch.softmax(scores, dim=-1).masked_fill(empty, 0.0)
    dropped = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    out = dropped @ v  # (B, H, T, S) @ (B, H, S, Dv) -> (B, H, T, Dv)
    return out.to(call.q.dtype), weights.to(call.q.dtype)


MATH = register(Backend(
    name="math",
    run=lambda call: math_attention(call)[0],
    run_with_weights=math_attention,
    description="explicit scores and softmax; the reference; returns weights",
))
