"""Stateless pieces of attention: masks, rotary embedding, grouped-query heads."""

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
from .rope import RotaryEmbedding, rotate_half

__all__ = [
    "RotaryEmbedding",
    "Visibility",
    "block_has_empty_rows",
    "block_visibility",
    "combine_masks",
    "expand_kv",
    "key_padding_to_mask",
    "position_mask",
    "rotate_half",
    "visible_band",
]
