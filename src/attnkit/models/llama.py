"""A Llama decoder rebuilt on attnkit.MultiHeadAttention.

    model = attnkit.models.load_smollm2()            # SmolLM2-135M-Instruct, offline (attnkit.models.loader)
    batch = model.tokenize(["The capital of France is"])
    out = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8)
    print(model.decode(out[0]))

The blocks are Llama's: token embedding; per layer RMSNorm -> attention
(grouped-query heads, rotary embedding, KV cache: attnkit's own layer) ->
residual, RMSNorm -> SwiGLU feed-forward -> residual; final RMSNorm; an output
head tied to the embedding unless the file has its own. Every weight matrix is
an ``nn.Linear`` (a module swap such as ``quantize_dynamic`` reaches them all).
Files are read by :mod:`attnkit.models.loader`, text is the tokenizer's; the
stack, caches and checks are :mod:`attnkit.models.decoder`'s (shared with
Gemma 3) and the generation loop is :mod:`attnkit.models.generation`'s.

Legend: B batch, T tokens, S positions incl. cached ones, C model width,
I feed-forward width, V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.functional import RotaryEmbedding
from attnkit.functional.norm import RMSNorm
from attnkit.modules import MultiHeadAttention
from attnkit.modules.context import StepContext
from attnkit.modules.kv_cache import Cache

from .decoder import DecoderModel, GatedMLP
from .generation import Tokenizer


@dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama decoder (read from a GGUF file's ``llama.*`` metadata)."""

    vocab_size: int = 49152
    d_model: int = 576
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    ffn_size: int = 1536
    context_length: int = 8192
    rope_base: float = 100000.0
    rope_scaling: float = 1.0  # linear: positions divided by this factor
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        """Sizes that cannot describe a model are refused by field name (num_heads=0 divided by zero)."""
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig {name}={value!r} cannot describe a model: expected an integer >= 1")
        if self.d_model % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig needs num_heads to divide d_model and num_kv_heads to divide num_heads, "
                             f"got d_model={self.d_model}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"LlamaConfig head dim d_model / num_heads = {self.d_model // self.num_heads} must be "
                             "even for the rotary embedding")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
        """The config a GGUF file's metadata describes (see :func:`attnkit.models.loader.llama_config`)."""
        from .loader import llama_config

        return llama_config(metadata, tie_embeddings=tie_embeddings)


class SwiGLU(GatedMLP):
    """down(silu(gate(x)) * up(x)); gate and up are one fused ``nn.Linear`` (rows: gate, then up)."""

    def __init__(self, d_model: int, ffn_size: int) -> None:
        super().__init__(d_model, ffn_size, F.silu)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + SwiGLU(norm(x))."""

    def __init__(self, config: LlamaConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        c = config.d_model
        self.attention_norm = RMSNorm(c, eps=config.norm_eps)
        self.attention = MultiHeadAttention(c, c, config.num_heads, num_kv_heads=config.num_kv_heads,
                                            rope=rope, out_bias=False)
        self.mlp_norm = RMSNorm(c, eps=config.norm_eps)
        self.mlp = SwiGLU(c, config.ffn_size)

    def forward(self, x: Tensor, context: StepContext, kv_cache: Cache | None) -> Tensor:
        h = self.attention(self.attention_norm(x), context=context, kv_cache=kv_cache)
        x = x + h  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(DecoderModel):
    """A Llama decoder: token ids in, logits out; with a tokenizer, text in and out (GenerationMixin).

    ``forward(input_ids, attention_mask=None, kv_caches=None, positions=None)``
    returns logits (B, T, V) (:class:`~attnkit.models.decoder.DecoderModel`).
    Attention layers are ``layers.<i>.attention`` (for :func:`attnkit.trace`).
    """

    config: LlamaConfig
    # weight forms (attnkit.modules.quantize) measured to meet the accuracy bar on SmolLM2-135M: >= 97% of
    # float32's greedy choices and perplexity within 3% on 256 teacher-forced positions (float16 100%, int4
    # 98.0% widened for prompts, 98.8% through its kernel; int8 96.1% misses: tests/modules/test_quantize.py)
    accurate_forms = ("float32", "float16", "int4")

    def __init__(self, config: LlamaConfig, tokenizer: Tokenizer | None = None) -> None:
        rope = RotaryEmbedding(config.head_dim, base=config.rope_base, scaling=config.rope_scaling)  # one for all
        super().__init__(config, [LlamaBlock(config, rope) for _ in range(config.num_layers)], tokenizer)
