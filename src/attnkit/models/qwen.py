"""Qwen 2 / 2.5 and Qwen 3: Llama blocks with another attention layer, registered for their GGUF files.

    model = attnkit.models.load_gguf("qwen2.5-0.5b-instruct-q8_0.gguf")

What differs from Llama (:mod:`attnkit.models.llama`), each in its own place:

- Qwen 2 (``general.architecture = "qwen2"``): a bias on the query, key and
  value projections (``qkv_bias=True``: one bias of the fused ``qkv_proj``);
- Qwen 3 (``"qwen3"``): no biases, but an RMSNorm of each head's queries
  and keys before the rotary embedding (a ``QKNorm`` component, one weight
  for queries and one for keys, shared by the heads), and heads as wide as
  ``qwen3.attention.key_length`` says, whatever the width (Qwen3-0.6B: 16
  heads of 128 in a 1024-wide model);
- both: llama.cpp keeps the half-split Q/K rows (no permutation to undo),
  and the tokenizer's pre-tokenizer is ``tokenizer.ggml.pre = "qwen2"``
  (:mod:`attnkit.models.tokenizer`).

The config is read from ``<arch>.*`` keys as Llama's is
(:func:`~attnkit.models.llama.llama_family_config`): YaRN or any other RoPE
scaling but linear is refused by name. The weight forms of these models are
not measured, so ``weights="auto"`` keeps float32.

Legend: C model width, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from attnkit.functional import RotaryEmbedding
from attnkit.functional.norm import QKNorm, RMSNorm
from attnkit.modules import MultiHeadAttention
from attnkit.modules.heads import Heads

from .llama import LlamaConfig, LlamaModel, llama_block, llama_family_config
from .registry import Architecture, BlockTensors, Part, register


def _heads(config: LlamaConfig) -> Heads:
    return Heads(config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)


class Qwen2Model(LlamaModel):
    """A Qwen 2 / 2.5 decoder: Llama's, with a bias on the fused query/key/value projection."""

    accurate_forms = ("float32",)  # no weight form measured on Qwen 2: weights="auto" keeps float32

    @classmethod
    def make_attention(cls, config: LlamaConfig, rope: RotaryEmbedding) -> MultiHeadAttention:
        return MultiHeadAttention(config.d_model, config.d_model, _heads(config), rope=rope, window=config.window,
                                  qkv_bias=True, out_bias=False)


class Qwen3Model(LlamaModel):
    """A Qwen 3 decoder: Llama's, with an RMSNorm of each query and key head and heads of their own size."""

    accurate_forms = ("float32",)  # no weight form measured on Qwen 3: weights="auto" keeps float32

    @classmethod
    def make_attention(cls, config: LlamaConfig, rope: RotaryEmbedding) -> MultiHeadAttention:
        d, eps = config.head_dim, config.norm_eps
        return MultiHeadAttention(config.d_model, config.d_model, _heads(config), rope=rope, window=config.window,
                                  out_bias=False, qk_norm=QKNorm(RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)))


def qwen2_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
    """The config of a ``general.architecture = "qwen2"`` file, every ``qwen2.*`` value checked."""
    return llama_family_config(metadata, "qwen2", tie_embeddings=tie_embeddings)


def qwen3_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
    """The config of a ``general.architecture = "qwen3"`` file; heads ``qwen3.attention.key_length`` wide."""
    return llama_family_config(metadata, "qwen3", tie_embeddings=tie_embeddings, own_head_size=True)


def qwen2_block(config: LlamaConfig, layer: int) -> BlockTensors:
    """Llama's tensors (Q/K rows as stored) and the Q, K and V biases fused as the weights are."""
    h, g, d, n = config.num_heads, config.num_kv_heads, config.head_dim, f"blk.{layer}."
    bias = [Part(n + "attn_q.bias", (h * d,)), Part(n + "attn_k.bias", (g * d,)), Part(n + "attn_v.bias", (g * d,))]
    return llama_block(config, layer, permuted=False) | {"attention.qkv_proj.bias": bias}


def qwen3_block(config: LlamaConfig, layer: int) -> BlockTensors:
    """Llama's tensors (Q/K rows as stored) and the query and key norms."""
    d, n = config.head_dim, f"blk.{layer}."
    return llama_block(config, layer, permuted=False) | {
        "attention.qk_norm.q_norm.weight": [Part(n + "attn_q_norm.weight", (d,))],
        "attention.qk_norm.k_norm.weight": [Part(n + "attn_k_norm.weight", (d,))]}


QWEN2 = register(Architecture("qwen2", config=qwen2_config, block=qwen2_block, model=Qwen2Model))
QWEN3 = register(Architecture("qwen3", config=qwen3_config, block=qwen3_block, model=Qwen3Model))
