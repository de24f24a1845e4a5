"""The explicit reference: scores, mask, softmax, weights @ values, all materialised.

Memory is O(B * H * T * S). Half-precision inputs are computed in float32.
A query with no visible key gets weight 0 on every key and output 0.

Modifiers are evaluated densely: the score modifier on the whole (B, H, T, S)
scores, then the masks (the call's own, the band and the mask modifier, as
one visibility); learned sinks are one more key per head, with score sinks[h]
and value 0, so a row's weights sum to less than 1.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.functional import combine_masks, expand_kv

from .call import AttentionCall, compute_dtype
from .modifiers import apply_mask_mod, apply_score_mod
from .registry import Backend, register


def masked_scores(call: AttentionCall) -> Tensor:
    """Scaled scores (B, H, T, S) with -inf where a key is blocked: what softmax receives."""
    compute = compute_dtype(call.q.dtype)
    k = expand_kv(call.k, call.num_heads).to(compute)  # (B, G, S, D) -> (B, H, S, D)
    scores = (call.q.to(compute) @ k.transpose(-2, -1)) * call.scale  # (B, H, T, D) @ (B, H, D, S) -> (B, H, T, S)
    if call.modified:
        return _modified_scores(call, scores)
    mask = call.dense_mask()
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, -torch.inf)
    elif mask is not None:
        scores = scores + mask.to(compute)
    return scores


def _modified_scores(call: AttentionCall, scores: Tensor) -> Tensor:
    """score_mod on the scaled scores, then every mask: the call's, the band and mask_mod (-inf where hidden)."""
    idx = call.indices()
    if call.score_mod is not None:
        scores = apply_score_mod(call.score_mod, scores, idx)
    if call.mask is not None and call.mask.dtype != torch.bool:
        scores = scores + call.mask.to(scores.dtype)
    keep = call.mask if call.mask is not None and call.mask.dtype == torch.bool else None
    visibility = call.visibility_mod()
    if visibility is not None:
        keep = combine_masks(keep, apply_mask_mod(visibility, idx))  # broadcasts to (B, H, T, S)
    return scores if keep is None else scores.masked_fill(~keep, -torch.inf)


def softmax_rows(scores: Tensor, sinks: Tensor | None = None) -> Tensor:
    """Softmax over keys; a row with no visible key (all -inf) gets weights 0, not NaN.

    ``sinks`` (H,): one more key per head with that score and no value, whose
    weight is dropped (the row's weights then sum to less than 1).
    """
    if sinks is not None:
        b, h, t, _ = scores.shape
        sink = sinks.to(scores.dtype).view(1, h, 1, 1).expand(b, h, t, 1)  # (H,) -> (B, H, T, 1)
        return softmax_rows(torch.cat([scores, sink], dim=-1))[..., :-1]  # (B, H, T, S + 1) -> (B, H, T, S)
    empty = scores.amax(dim=-1, keepdim=True) == -torch.inf  # (B, H, T, 1)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1)  # finite softmax there...
    return weights.masked_fill(empty, 0.0)  # ...then zeroed


@dataclass(frozen=True)
class Intermediates:
    """What the math backend computed for one call, for tracing (see :func:`attnkit.trace`).

    ``scores`` are what softmax received (scaled, modified by a score
    modifier, -inf where a key was blocked) and ``weights`` its result (with
    learned sinks, rows sum to less than 1), both in the compute dtype (float32
    for half-precision inputs); ``out`` is (dropped-out) weights @ values in
    q's dtype, before any caller merges the heads.
    """

    scores: Tensor  # (B, H, T, S)
    weights: Tensor  # (B, H, T, S)
    out: Tensor  # (B, H, T, Dv)


def math_intermediates(call: AttentionCall) -> Intermediates:
    """Every step of the reference computation; weights are taken before dropout."""
    scores = masked_scores(call)
    weights = softmax_rows(scores, call.sinks)
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
