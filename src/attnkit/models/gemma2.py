"""Gemma 2 on attnkit: Gemma 3's sandwich blocks without q/k norms, with soft-capped scores and logits.

    model = attnkit.models.load_gguf("gemma-2-2b-it-Q4_K_M.gguf")

Gemma 2 is Gemma 3's layout (:mod:`attnkit.models.gemma3`: sandwich norms,
GeGLU with tanh GELU, token vectors times sqrt(width), heads of their own
size, local layers with a window and global ones, a tied head), and here is
what differs, each in its own place:

- every other layer is global, from layer 1 (layer 0 local, as transformers
  and llama.cpp alternate them): ``global_every=2``, window
  ``gemma2.attention.sliding_window`` (4096 when the file gives none);
- one rotary base for both kinds, ``gemma2.rope.freq_base`` (10000 when the
  file gives none, as llama.cpp's converter writes none);
- no RMSNorm of the query and key heads; instead each score is soft-capped
  before the softmax, ``cap * tanh(score / cap)`` with the cap
  ``gemma2.attn_logit_softcapping`` (50; attnkit's ``softcap`` score modifier);
- the logits are soft-capped too, with ``gemma2.final_logit_softcapping`` (30);
- the query scale: the file does not hold Gemma's ``query_pre_attn_scalar``,
  so llama.cpp's rule is followed: 1/sqrt(head size), except the 27B (46
  blocks): 1/sqrt(width / heads), which is its scalar of 144.

The weight forms are not measured on Gemma 2: ``weights="auto"`` keeps float32.

Legend: B batch, T tokens, C model width, V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.functional import RotaryEmbedding
from attnkit.functional.modifiers import softcap
from attnkit.modules import MultiHeadAttention
from attnkit.modules.cache_protocol import Cache
from attnkit.modules.heads import Heads

from .gemma3 import Gemma3Config, GemmaDecoder, SandwichBlock, gemma3_block
from .gguf import metadata_float, metadata_int
from .registry import Architecture, BlockTensors, register

_CAPS = (("attn_softcap", "gemma2.attn_logit_softcapping"), ("final_softcap", "gemma2.final_logit_softcapping"))


@dataclass(frozen=True)
class Gemma2Config(Gemma3Config):
    """Gemma 3's sizes and layer layout with Gemma 2's soft-caps (read from a GGUF file's ``gemma2.*``
    metadata); defaults: Gemma 2 2B."""

    vocab_size: int = 256000
    d_model: int = 2304
    num_layers: int = 26
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 256
    ffn_size: int = 9216
    context_length: int = 8192
    window: int = 4096
    global_every: int = 2  # layer i is global when i % 2 == 1
    rope_base: float = 1e4
    rope_local_base: float = 1e4
    attn_softcap: float = 50.0  # scores: cap * tanh(score / cap)
    final_softcap: float = 30.0  # logits: cap * tanh(logit / cap)

    def __post_init__(self) -> None:
        """Sizes (as Gemma 3's) and caps that cannot describe a model are refused by field name."""
        super().__post_init__()
        for name, _ in _CAPS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value) and value > 0):
                raise ValueError(f"Gemma2Config {name}={value!r} cannot cap: expected a finite number > 0")


class Gemma2Block(SandwichBlock):
    """Gemma 2's sandwich block: heads of their own size and scale, scores soft-capped, no q/k norms."""

    def __init__(self, config: Gemma2Config, rope: RotaryEmbedding, window: int | None) -> None:
        c, d = config.d_model, config.head_dim
        heads = Heads(config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=d, scale=config.query_scale)
        attention = MultiHeadAttention(c, c, heads, rope=rope, window=window, out_bias=False,
                                       score_mod=softcap(config.attn_softcap))
        super().__init__(c, config.ffn_size, config.norm_eps, attention)


class Gemma2Model(GemmaDecoder):
    """A Gemma 2 decoder: token ids in, soft-capped logits out; with a tokenizer, text in and out.

    ``forward(input_ids, attention_mask=None, kv_caches=None, positions=None)``
    returns logits (B, T, V) (:class:`~attnkit.models.decoder.DecoderModel`),
    each ``cap * tanh(logit / cap)``. Attention layers are
    ``layers.<i>.attention``; the odd ones are global (``config.is_global(i)``).
    """

    config: Gemma2Config
    accurate_forms = ("float32",)  # no weight form measured on Gemma 2: weights="auto" keeps float32

    @classmethod
    def make_block(cls, config: Gemma3Config, rope: RotaryEmbedding, window: int | None) -> nn.Module:
        assert isinstance(config, Gemma2Config), f"a Gemma 2 block needs a Gemma2Config, got {type(config).__name__}"
        return Gemma2Block(config, rope, window)

    def cap_logits(self, logits: Tensor) -> Tensor:
        """``final_softcap * tanh(logits / final_softcap)``: logits (..., V) squashed into (-cap, cap)."""
        cap = self.config.final_softcap
        return torch.tanh(logits / cap) * cap

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                kv_caches: Sequence[Cache] | None = None, positions: Tensor | None = None) -> Tensor:
        """Soft-capped logits (B, T, V) for input_ids (B, T); the arguments are
        :meth:`~attnkit.models.decoder.DecoderModel.forward`'s."""
        return self.cap_logits(super().forward(input_ids, attention_mask, kv_caches, positions))

    def step(self, input_ids: Tensor, positions: Tensor | None, kv_caches: Sequence[Cache]) -> Tensor:
        """Soft-capped logits (B, V) of the last position only (the generation loop's call)."""
        return self.cap_logits(super().step(input_ids, positions, kv_caches))


# ---------------------------------------------------------------------------------------------------------------
# From a GGUF file


def _heads(metadata: Mapping[str, Any]) -> tuple[int, int, int]:
    """Query heads H, key/value heads G and the head size D (``key_length``, equal to ``value_length``)."""
    heads = metadata_int(metadata, "gemma2.attention.head_count")
    kv_heads = metadata_int(metadata, "gemma2.attention.head_count_kv", heads)
    key_length = metadata_int(metadata, "gemma2.attention.key_length")
    value_length = metadata_int(metadata, "gemma2.attention.value_length", key_length)
    if heads % kv_heads:
        raise ValueError(f"gemma2.attention.head_count = {heads} is not a multiple of "
                         f"gemma2.attention.head_count_kv = {kv_heads}")
    if key_length != value_length or key_length % 2:
        raise ValueError(f"gemma2.attention.key_length = {key_length} and value_length = {value_length}: one even "
                         "head size is expected (the rotary embedding turns pairs of dimensions)")
    rope_dims = metadata.get("gemma2.rope.dimension_count", key_length)
    if rope_dims != key_length:
        raise ValueError(f"partial rotary embedding (gemma2.rope.dimension_count = {rope_dims!r}, head size "
                         f"{key_length}) is not supported")
    return heads, kv_heads, key_length


def _refuse_rope_scaling(metadata: Mapping[str, Any]) -> None:
    """Gemma 2 files scale no positions; a file asking for any scaling is refused by key."""
    kind = metadata.get("gemma2.rope.scaling.type", "none")
    if kind != "none":
        raise ValueError(f"gemma2.rope.scaling.type = {kind!r} is not supported for Gemma 2 (only 'none')")


def gemma2_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> Gemma2Config:
    """The config of a ``general.architecture = "gemma2"`` file, every value checked and named by its key."""
    arch = metadata.get("general.architecture")
    if arch != "gemma2":
        raise ValueError(f"architecture {arch!r} is not Gemma 2 (general.architecture = 'gemma2')")
    _refuse_rope_scaling(metadata)
    heads, kv_heads, size = _heads(metadata)
    context = metadata_int(metadata, "gemma2.context_length")
    window = metadata_int(metadata, "gemma2.attention.sliding_window", 4096)  # llama.cpp's default
    if window > context:
        raise ValueError(f"gemma2.attention.sliding_window = {window} is larger than gemma2.context_length = "
                         f"{context}")
    d, layers = metadata_int(metadata, "gemma2.embedding_length"), metadata_int(metadata, "gemma2.block_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    base = metadata_float(metadata, "gemma2.rope.freq_base", 1e4, above=1)
    caps = {name: metadata_float(metadata, key, default, above=0)
            for (name, key), default in zip(_CAPS, (50.0, 30.0), strict=True)}  # llama.cpp's defaults
    return Gemma2Config(vocab_size=metadata_int(metadata, "gemma2.vocab_size", len(tokens) if tokens else None),
                        d_model=d, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=size,
                        ffn_size=metadata_int(metadata, "gemma2.feed_forward_length"), context_length=context,
                        window=window, global_every=2, rope_base=base, rope_local_base=base,
                        query_scale=(d / heads) ** -0.5 if layers == 46 else size**-0.5,  # llama.cpp: 27B's rule
                        norm_eps=metadata_float(metadata, "gemma2.attention.layer_norm_rms_epsilon", 1e-6, above=0),
                        tie_embeddings=tie_embeddings, **caps)


def gemma2_block(config: Gemma2Config, layer: int) -> BlockTensors:
    """Gemma 3's tensors (:func:`~attnkit.models.gemma3.gemma3_block`: Q/K/V and gate/up fused by rows, the
    sandwich norms) without the query and key norms, which Gemma 2 does not have."""
    return {name: parts for name, parts in gemma3_block(config, layer).items() if ".qk_norm." not in name}


GEMMA2 = register(Architecture("gemma2", config=gemma2_config, block=gemma2_block, model=Gemma2Model))
