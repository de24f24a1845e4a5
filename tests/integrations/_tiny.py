"""Tiny randomly initialised transformers models, one per family, and a padded batch.

Legend: B batch, T tokens, C hidden size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tests._util import need

transformers = need("transformers")

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
               num_attention_heads=HEADS, max_position_embeddings=64)


@dataclass(frozen=True)
class Family:
    """How to build one family's tiny model, and which side it pads."""

    name: str
    build: Callable[[], nn.Module]
    causal: bool = True
    pad_left: bool = True


def _decoder(config_cls: str, model_cls: str, **extra: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        config = getattr(transformers, config_cls)(**_COMMON, **extra)
        return getattr(transformers, model_cls)(config)
    return build


def _bert() -> nn.Module:
    config = transformers.BertConfig(**_COMMON)
    return transformers.BertModel(config, add_pooling_layer=False)


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64)
    return transformers.GPT2LMHeadModel(config)


FAMILIES = [
    # grouped-query attention: 4 query heads share 2 key/value heads
    Family("llama", _decoder("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2)),
    # every layer slides a window of 3 over 8 tokens, so the window matters
    Family("mistral", _decoder("MistralConfig", "MistralForCausalLM", num_key_value_heads=2, sliding_window=3)),
    # one full layer, one sliding layer
    Family("qwen2", _decoder("Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, use_sliding_window=True,
                             sliding_window=3, max_window_layers=1)),
    # multi-query (one key/value head), its own scaling (query_pre_attn_scalar), sliding layers, q/k norms
    Family("gemma3", _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=1, head_dim=8,
                              sliding_window=3, query_pre_attn_scalar=16)),
    Family("bert", _bert, causal=False, pad_left=False),
    Family("gpt2", _gpt2),
]


def build(family: Family, seed: int = 0) -> nn.Module:
    """The family's tiny model in float32, eval mode, weights from ``seed``."""
    torch.manual_seed(seed)
    return family.build().float().eval()


def padded_batch(family: Family, *, length: int = 8, pad: int = 3, seed: int = 1) -> tuple[Tensor, Tensor]:
    """input_ids (2, T) and attention_mask (2, T): sequence 1 has ``pad`` padding tokens on the family's side."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, length), generator=generator)  # (B, T)
    mask = torch.ones(2, length, dtype=torch.long)  # (B, T)
    if family.pad_left:
        mask[1, :pad] = 0
    else:
        mask[1, length - pad:] = 0
    ids[mask == 0] = 0
    return ids, mask
