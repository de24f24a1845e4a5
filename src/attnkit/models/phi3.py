"""Phi-3 (mini, medium) and Phi-4 files: Llama blocks read from fused tensors, registered for their GGUF files.

    model = attnkit.models.load_gguf("Phi-3-mini-4k-instruct-q4.gguf")

Phi-3's block is Llama's (:mod:`attnkit.models.llama`): RMSNorm, attention
with grouped-query heads and a half-split rotary embedding, RMSNorm, SwiGLU;
an output head of its own. What differs is the file (``general.architecture
= "phi3"``):

- the query, key and value projections are one tensor, ``attn_qkv`` (rows:
  queries, keys, values), which is attnkit's ``qkv_proj`` as it is; the Q/K
  rows are half-split as stored (llama.cpp keeps Phi-3's, no permutation);
- the feed-forward's gate and up projections are one tensor, ``ffn_up``
  (rows: gate, then up), attnkit's ``gate_up_proj`` as it is;
- ``phi3.attention.sliding_window`` (Phi-3 mini: 2047; 0 for Phi-4) is a
  window on every layer, as transformers' ``Phi3ForCausalLM`` applies its
  ``sliding_window`` (llama.cpp ignores it and attends to the whole past,
  which differs only beyond the window).

What attnkit cannot honour is refused by key before any weight is read: a
partial rotary embedding (``phi3.rope.dimension_count`` below the head size:
Phi-4-mini), LongRoPE / "su" scaling (Phi-3 128k, Phi-3.5: a
``phi3.context_length`` beyond ``phi3.rope.scaling.original_context_length``,
or a ``phi3.rope.scaling.attn_factor``; the ``rope_factors_long`` /
``rope_factors_short`` tensors are refused by name by the registry too), any
``phi3.rope.scaling.type`` but linear. The weight forms are not measured on
Phi-3: ``weights="auto"`` keeps float32.

Legend: C model width, I feed-forward width, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .gguf import metadata_int
from .llama import LlamaConfig, LlamaModel, llama_family_config
from .registry import Architecture, BlockTensors, Part, register


class Phi3Model(LlamaModel):
    """A Phi-3 decoder: Llama's blocks (fused Q/K/V and gate/up, as Phi-3's own layers are)."""

    accurate_forms = ("float32",)  # no weight form measured on Phi-3: weights="auto" keeps float32


def _refuse_longrope(metadata: Mapping[str, Any]) -> None:
    """LongRoPE ("su") or YaRN scaling, which llama.cpp's converter writes as an attention factor, factor
    tensors and a context beyond the original one: refused by key (attnkit's rotary embedding has neither)."""
    context = metadata_int(metadata, "phi3.context_length", 2048)
    key = "phi3.rope.scaling.original_context_length"
    original = metadata_int(metadata, key, context)
    if context > original:
        raise ValueError(f"phi3.context_length = {context} extends {key} = {original} by LongRoPE scaling (the "
                         "tensors rope_factors_long / rope_factors_short), which is not supported")
    attn_factor = metadata.get("phi3.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1:
        raise ValueError(f"phi3.rope.scaling.attn_factor = {attn_factor!r} (LongRoPE or YaRN scaling) is not "
                         "supported (only 1)")


def phi3_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
    """The config of a ``general.architecture = "phi3"`` file, every ``phi3.*`` value checked (as Llama's are,
    :func:`~attnkit.models.llama.llama_family_config`, and LongRoPE refused)."""
    config = llama_family_config(metadata, "phi3", tie_embeddings=tie_embeddings)
    _refuse_longrope(metadata)
    return config


def phi3_block(config: LlamaConfig, layer: int) -> BlockTensors:
    """Where block ``layer``'s parameters lie in a Phi-3 file: the fused ``attn_qkv`` and ``ffn_up`` as stored."""
    c, i, d, h, g = config.d_model, config.ffn_size, config.head_dim, config.num_heads, config.num_kv_heads
    n = f"blk.{layer}."
    return {"attention.qkv_proj.weight": [Part(n + "attn_qkv.weight", ((h + 2 * g) * d, c))],  # rows: Q, K, V
            "attention.out_proj.weight": [Part(n + "attn_output.weight", (c, h * d))],
            "attention_norm.weight": [Part(n + "attn_norm.weight", (c,))],
            "mlp_norm.weight": [Part(n + "ffn_norm.weight", (c,))],
            "mlp.gate_up_proj.weight": [Part(n + "ffn_up.weight", (2 * i, c))],  # rows: gate, then up
            "mlp.down_proj.weight": [Part(n + "ffn_down.weight", (c, i))]}


PHI3 = register(Architecture("phi3", config=phi3_config, block=phi3_block, model=Phi3Model))
