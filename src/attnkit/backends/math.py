"""The explicit reference: scores, mask, softmax, weights @ values, all materialised.

Memory is O(B * H * T * S). Half-precision inputs are computed in float32.
A query with no visible key gets weight 0 on every key and output 0.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.functional import expand_kv

from .call import AttentionCall, compute_dtype
from .registry import Backend, register


def masked_scores(call: AttentionCall) -> Tensor:
    """Scaled scores (B, H, T, S) with -inf where a key is blocked: what softmax receives."""
    compute = compute_dtype(call.q.dtype)
    k = expand_kv(call.k, call.num_heads).to(compute)  # (B, G, S, D) -> (B, H, S, D)
    scores = (call.q.to(compute) @ k.transpose(-2, -1)) * call.scale  # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    mask = call.dense_mask()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        scores = scores + mask.to(compute)
    return scores


def softmax_rows(scores: Tensor) -> Tensor:
    """Softmax over keys; a row with no visible key (all -inf) gets weights 0, not NaN."""
    empty = scores.amax(dim=-1, keepdim=True) == -torch.inf  # (B, H, T, 1)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)  # finite softmax there...
    return weights.masked_fill(empty, 0.0)  # ...then zeroed


@dataclass(frozen=True)
class Intermediates:
    """What the math backend computed for one call, for tracing (see :func:`attnkit.trace`).

    ``scores`` are what softmax received (scaled, -inf where a key was
    blocked) and ``weights`` its result, both in the compute dtype (float32
    for half-precision inputs); ``out`` is (dropped-out) weights @ values in
    q's dtype, before any caller merges the heads.
    """

    scores: Tensor  # (B, H, T, S)
    weights: Tensor  # (B, H, T, S)
    out: Tensor  # (B, H, T, Dv)


def math_intermediates(call: AttentionCall) -> Intermediates:
    """Every step of the reference computation; weights are taken before dropout."""
    scores = masked_scores(call)
    weights = softmax_rows(scores)
    dropped = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    v = expand_kv(call.v, call.num_heads).to(weights.dtype)  # (B, G, S, Dv) -> (B, H, S, Dv)
    out = dropped @ v  # (B, H, T, S) @ (B, H, S, Dv) -> (B, H, T, Dv)
    return Intermediates(scores, weights, out.to(call.q.dtype))


def math_attention(call: AttentionCall) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, Dv), weights (B, H, T, S)); weights are taken before dropout."""
    steps = math_intermediates(call)
    return steps.out, steps.weights.to(call.q.dtype)


register(Backend(
    name="math",
    run=lambda call: math_attention(call)[0],
    run_with_weights=math_attention,
))
