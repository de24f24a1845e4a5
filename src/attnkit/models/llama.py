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
Files are read by :mod:`attnkit.models.loader` through this file's
registration of ``general.architecture = "llama"`` (:mod:`attnkit.models.registry`;
Mistral's files are Llama files, their window read when the file gives one),
text is the tokenizer's; the stack, caches and checks are
:mod:`attnkit.models.decoder`'s (shared with Gemma 3) and the generation loop
is :mod:`attnkit.models.generation`'s. Qwen 2 and Qwen 3 are Llama blocks
with another attention layer (:mod:`attnkit.models.qwen`), read by
:func:`llama_family_config` and :func:`llama_block` too.

Legend: B batch, T tokens, S positions incl. cached ones, C model width,
I feed-forward width, V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.functional import RotaryEmbedding
from attnkit.functional.norm import RMSNorm
from attnkit.modules import MultiHeadAttention
from attnkit.modules.cache_protocol import Cache
from attnkit.modules.context import StepContext
from attnkit.modules.heads import Heads

from .decoder import DecoderModel, GatedMLP
from .generation import Tokenizer
from .gguf import metadata_float, metadata_int
from .registry import Architecture, BlockTensors, Part, register


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
    window: int | None = None  # Mistral: each token sees its `window` most recent positions, itself included
    head_size: int | None = None  # heads of their own size (Qwen 3); None: d_model / num_heads

    def __post_init__(self) -> None:
        """Sizes that cannot describe a model are refused by field name (num_heads=0 divided by zero)."""
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "ffn_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig {name}={value!r} cannot describe a model: expected an integer >= 1")
        for name in ("window", "head_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"LlamaConfig {name}={value!r} must be None or an integer >= 1")
        if (self.head_size is None and self.d_model % self.num_heads) or self.num_heads % self.num_kv_heads:
            raise ValueError(f"LlamaConfig needs num_heads to divide d_model and num_kv_heads to divide num_heads, "
                             f"got d_model={self.d_model}, num_heads={self.num_heads}, "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head dim d_model / num_heads = {self.head_dim} must be even for the "
                             "rotary embedding")
        if self.window is not None and self.window > self.context_length:
            raise ValueError(f"LlamaConfig window={self.window} is larger than context_length={self.context_length}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads if self.head_size is None else self.head_size

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
        """The config a GGUF file's metadata describes (see :func:`llama_config`)."""
        return llama_config(metadata, tie_embeddings=tie_embeddings)


class SwiGLU(GatedMLP):
    """down(silu(gate(x)) * up(x)); gate and up are one fused ``nn.Linear`` (rows: gate, then up)."""

    def __init__(self, d_model: int, ffn_size: int) -> None:
        super().__init__(d_model, ffn_size, F.silu)


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + SwiGLU(norm(x)); the attention layer is given."""

    def __init__(self, config: LlamaConfig, attention: MultiHeadAttention) -> None:
        super().__init__()
        c = config.d_model
        self.attention_norm = RMSNorm(c, eps=config.norm_eps)
        self.attention = attention
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
    A subclass with another attention layer (Qwen's) overrides :meth:`make_attention`.
    """

    config: LlamaConfig
    # weight forms (attnkit.modules.quantize) measured to meet the accuracy bar on SmolLM2-135M: >= 97% of
    # float32's greedy choices and perplexity within 3% on 256 teacher-forced positions (float16 100%, int4
    # 98.0% widened for prompts, 98.8% through its kernel; int8 96.1% misses: tests/modules/test_quantize.py)
    accurate_forms: tuple[str, ...] = ("float32", "float16", "int4")

    def __init__(self, config: LlamaConfig, tokenizer: Tokenizer | None = None) -> None:
        rope = RotaryEmbedding(config.head_dim, base=config.rope_base, scaling=config.rope_scaling)  # one for all
        blocks = [LlamaBlock(config, self.make_attention(config, rope)) for _ in range(config.num_layers)]
        super().__init__(config, blocks, tokenizer)

    @classmethod
    def make_attention(cls, config: LlamaConfig, rope: RotaryEmbedding) -> MultiHeadAttention:
        """One block's attention layer: grouped-query heads, rotary embedding, the window if any, no biases."""
        heads = Heads(config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
        return MultiHeadAttention(config.d_model, config.d_model, heads, rope=rope, window=config.window,
                                  out_bias=False)


# ---------------------------------------------------------------------------------------------------------------
# From a GGUF file: general.architecture = "llama" (Llama, SmolLM2, Mistral), and what Qwen's readers share


def rope_scaling(metadata: Mapping[str, Any], arch: str = "llama") -> float:
    """The linear RoPE factor a file asks for (1.0: none); any other scaling type is refused by name.

    As llama.cpp reads them, for ``arch`` = "llama": ``llama.rope.scaling.type``
    ("linear" when missing; "none"), ``llama.rope.scaling.factor`` or else the
    older ``llama.rope.scale_linear`` (missing or 0: no scaling), and
    ``llama.rope.scaling.attn_factor``, which must be 1.
    """
    kind = metadata.get(f"{arch}.rope.scaling.type", "linear")
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ValueError(f"RoPE scaling {kind!r} ({arch}.rope.scaling.type) is not supported; only 'linear' is")
    key = f"{arch}.rope.scaling.factor"
    key = key if key in metadata else f"{arch}.rope.scale_linear"
    factor = metadata.get(key)
    if factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 0):
        return 1.0  # llama.cpp: 0 = not scaled
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{key} = {factor!r} cannot scale RoPE: expected a finite number > 0 (or 0: none)")
    attn_factor = metadata.get(f"{arch}.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1:  # llama.cpp scales cos and sin by it
        raise ValueError(f"{arch}.rope.scaling.attn_factor = {attn_factor!r} is not supported (only 1)")
    return float(factor)


def _heads(metadata: Mapping[str, Any], arch: str, own_size: bool) -> tuple[int, int, int, int | None]:
    """Width C, query heads H, key/value heads G and the head size (None: C / H), checked to divide."""
    d = metadata_int(metadata, f"{arch}.embedding_length")
    heads = metadata_int(metadata, f"{arch}.attention.head_count")
    kv_heads = metadata_int(metadata, f"{arch}.attention.head_count_kv", heads)
    if not own_size and d % heads:
        raise ValueError(f"{arch}.embedding_length = {d} is not divisible by {arch}.attention.head_count = {heads}")
    if heads % kv_heads:
        raise ValueError(f"{arch}.attention.head_count = {heads} is not a multiple of "
                         f"{arch}.attention.head_count_kv = {kv_heads}")
    # the head size: width / heads, or the file's key_length whatever the width (Qwen 3)
    size = metadata_int(metadata, f"{arch}.attention.key_length", d // heads) if own_size else d // heads
    for key in (f"{arch}.attention.key_length", f"{arch}.attention.value_length"):
        if key in metadata and metadata[key] != size and own_size:
            raise ValueError(f"{key} = {metadata[key]!r} differs from {arch}.attention.key_length = {size}: keys "
                             "and values of different sizes are not supported")
        if key in metadata and metadata[key] != size:
            raise ValueError(f"{key} = {metadata[key]!r} differs from embedding_length / head_count = {size}: "
                             f"heads of their own size are not supported for {arch} files")
    rope_dims = metadata.get(f"{arch}.rope.dimension_count", size)
    if rope_dims != size:
        raise ValueError(f"partial rotary embedding ({arch}.rope.dimension_count = {rope_dims!r}, head dim "
                         f"{size}) is not supported")
    if size % 2:
        raise ValueError(f"{arch}.embedding_length / {arch}.attention.head_count = {d} / {heads} = {size}: "
                         "rotary embedding needs an even head dim")
    return d, heads, kv_heads, (size if own_size else None)


def _vocab_size(metadata: Mapping[str, Any], arch: str) -> int:
    """``<arch>.vocab_size``, or else the length of ``tokenizer.ggml.tokens``."""
    if f"{arch}.vocab_size" in metadata:
        return metadata_int(metadata, f"{arch}.vocab_size")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError(f"the GGUF metadata gives no vocabulary: neither {arch}.vocab_size nor "
                         "tokenizer.ggml.tokens")
    return len(tokens)


def _window(metadata: Mapping[str, Any], arch: str, context: int) -> int | None:
    """``<arch>.attention.sliding_window`` (Mistral's), None when the file gives none (or 0)."""
    key = f"{arch}.attention.sliding_window"
    if not metadata.get(key):
        return None
    window = metadata_int(metadata, key)
    if window > context:
        raise ValueError(f"{key} = {window} is larger than {arch}.context_length = {context}")
    return window


def llama_family_config(metadata: Mapping[str, Any], arch: str, *, tie_embeddings: bool = True,
                        own_head_size: bool = False) -> LlamaConfig:
    """The config of a Llama-like file (``general.architecture`` = ``arch``), every ``<arch>.*`` key checked;
    ``own_head_size``: heads as wide as ``<arch>.attention.key_length`` says (Qwen 3), not width / heads."""
    found = metadata.get("general.architecture")
    if found != arch:
        raise ValueError(f"architecture {found!r} is not supported here: only general.architecture = {arch!r}")
    d, heads, kv_heads, size = _heads(metadata, arch, own_head_size)
    context = metadata_int(metadata, f"{arch}.context_length", 2048)
    return LlamaConfig(vocab_size=_vocab_size(metadata, arch), d_model=d,
                       num_layers=metadata_int(metadata, f"{arch}.block_count"), num_heads=heads,
                       num_kv_heads=kv_heads, ffn_size=metadata_int(metadata, f"{arch}.feed_forward_length"),
                       context_length=context,
                       rope_base=metadata_float(metadata, f"{arch}.rope.freq_base", 10000.0, above=1),
                       rope_scaling=rope_scaling(metadata, arch),
                       norm_eps=metadata_float(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, above=0),
                       tie_embeddings=tie_embeddings, window=_window(metadata, arch, context), head_size=size)


def llama_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
    """The config of a ``general.architecture = "llama"`` file, every value checked."""
    return llama_family_config(metadata, "llama", tie_embeddings=tie_embeddings)


def llama_block(config: LlamaConfig, layer: int, *, permuted: bool = True) -> dict[str, list[Part]]:
    """Where block ``layer``'s parameters lie in a Llama-like file: Q/K/V and gate/up fused by rows.

    ``permuted``: llama.cpp's converter interleaved the Q and K rows of each head for its rotary embedding
    (Llama files); Qwen's files keep the half-split rows attnkit's rotary embedding turns.
    """
    c, i, d, h, g = config.d_model, config.ffn_size, config.head_dim, config.num_heads, config.num_kv_heads
    n = f"blk.{layer}."
    return {"attention.qkv_proj.weight": [Part(n + "attn_q.weight", (h * d, c), h if permuted else None),
                                          Part(n + "attn_k.weight", (g * d, c), g if permuted else None),
                                          Part(n + "attn_v.weight", (g * d, c))],
            "attention.out_proj.weight": [Part(n + "attn_output.weight", (c, h * d))],
            "attention_norm.weight": [Part(n + "attn_norm.weight", (c,))],
            "mlp_norm.weight": [Part(n + "ffn_norm.weight", (c,))],
            "mlp.gate_up_proj.weight": [Part(n + "ffn_gate.weight", (i, c)), Part(n + "ffn_up.weight", (i, c))],
            "mlp.down_proj.weight": [Part(n + "ffn_down.weight", (c, i))]}


def _llama_block(config: LlamaConfig, layer: int) -> BlockTensors:
    return llama_block(config, layer)


LLAMA = register(Architecture("llama", config=llama_config, block=_llama_block, model=LlamaModel))
