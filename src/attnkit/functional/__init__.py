"""Stateless pieces of attention: masks, score and mask modifiers, rotary embedding, grouped-query heads."""

from .gqa import expand_kv
from .masks import (
    Visibility,
    block_has_empty_rows,
    block_visibility,
    combine_masks,
    key_padding_to_mask,
    position_mask,
    visible_band,
)
from .modifiers import (
    MaskModifier,
    ScoreModifier,
    alibi,
    alibi_slopes,
    and_masks,
    causal,
    document_mask,
    document_positions,
    or_masks,
    prefix_lm,
    sink_window,
    sliding_window,
    softcap,
)
from .norm import QKNorm, RMSNorm
from .rope import RotaryEmbedding, rotate_half

__all__ = [
    "MaskModifier",
    "QKNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "ScoreModifier",
    "Visibility",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "block_has_empty_rows",
    "block_visibility",
    "causal",
    "combine_masks",
    "document_mask",
    "document_positions",
    "expand_kv",
    "key_padding_to_mask",
    "or_masks",
    "position_mask",
    "prefix_lm",
    "rotate_half",
    "sink_window",
    "sliding_window",
    "softcap",
    "visible_band",
]
