"""Decoding: the latency of one new token at a given context length.

- ``decode-attnkit-cache``: attnkit layer with a :class:`~attnkit.KVCache`
  holding the context; one step attends one new token to it;
- ``decode-attnkit-cache-keymask``: the same with a key mask (one padding
  position, as a left-padded batch has) on every step;
- ``decode-attnkit-recompute``: no cache, the whole prefix recomputed for the
  new token (one forward of context + 1 tokens);
- ``decode-hf-gpt2-{eager,sdpa}-cache``: transformers' GPT2Attention with
  its own DynamicCache and the same weights.

Each timed call runs :data:`STEPS` tokens (one for recompute) and rewinds the
cache afterwards, so every call sees the same context; the result is per token.
The builders here are registered as ``kind="decode"`` contenders in
:mod:`.contenders`: ``build(reference, context, x) -> step``.

Legend: B batch, S context length, C model width.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attnkit.modules import KVCache, MultiHeadAttention

from .hf import gpt2_attention

STEPS = 16


def attnkit_cache(reference: MultiHeadAttention, context: int, x: torch.Tensor) -> Callable[[], None]:
    """attnkit's layer with a KVCache holding ``context`` positions of x (B, S + 1, C); steps one token."""
    cache = KVCache()
    reference(x[:, :context], kv_cache=cache)
    token = x[:, context : context + 1]

    def step() -> None:
        for _ in range(STEPS):
            reference(token, kv_cache=cache)
        cache.crop(context)

    return step


def attnkit_cache_keymask(reference: MultiHeadAttention, context: int, x: torch.Tensor) -> Callable[[], None]:
    """:func:`attnkit_cache` with a (B, S) key mask on every step; position 0 is padding."""
    cache = KVCache()
    keys = torch.ones(x.shape[0], context + STEPS, dtype=torch.bool, device=x.device)  # (B, S + STEPS)
    keys[:, 0] = False
    reference(x[:, :context], kv_cache=cache, key_mask=keys[:, :context])
    token = x[:, context : context + 1]

    def step() -> None:
        for i in range(STEPS):
            reference(token, kv_cache=cache, key_mask=keys[:, : context + i + 1])
        cache.crop(context)

    return step


def recompute(reference: MultiHeadAttention, context: int, x: torch.Tensor) -> Callable[[], None]:
    """No cache: one forward of the whole prefix, context + 1 tokens of x (B, S + 1, C)."""
    prefix = x[:, : context + 1]
    return lambda: reference(prefix)


def hf_cache(implementation: str) -> Callable[[MultiHeadAttention, int, torch.Tensor], Callable[[], None]]:
    """transformers' GPT2Attention with a DynamicCache, its timed steps run by ``implementation``."""

    def build(reference: MultiHeadAttention, context: int, x: torch.Tensor) -> Callable[[], None]:
        from transformers.cache_utils import DynamicCache

        attn: Any = gpt2_attention(reference, "sdpa")  # prefill: the cache's keys and values are the same
        cache = DynamicCache()  # whichever kernel computes them, and eager would hold (T, T) scores
        attn(x[:, :context], past_key_values=cache, cache_position=torch.arange(context))
        attn.config._attn_implementation = implementation  # the timed steps use the one named
        token = x[:, context : context + 1]

        def step() -> None:
            for i in range(STEPS):
                attn(token, past_key_values=cache, cache_position=torch.tensor([context + i]))
            cache.crop(-STEPS)

        return step

    return build

