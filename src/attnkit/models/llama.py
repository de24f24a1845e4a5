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
Files are read by :mod:`attnkit.models.loader`, text is the tokenizer's, and
the generation loop is :mod:`attnkit.models.generation`'s (GenerationMixin).

Legend: B batch, T tokens, S positions incl. cached ones, C model width,
I feed-forward width, V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.functional import RotaryEmbedding
from attnkit.modules import KVCache, MultiHeadAttention, StaticKVCache
from attnkit.modules.kv_cache import Cache, check_cache, check_positions, transaction

from . import generation
from .generation import GenerationMixin, Tokenizer


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


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in at least float32 as Llama does."""

    def __init__(self, size: int, *, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64):  # (no conversions: each costs a call per layer and step)
            return self.weight * F.rms_norm(x, x.shape[-1:], eps=self.eps)  # (B, T, C): one fused op
        h = F.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # half precision: normalised in float32
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one fused ``nn.Linear`` (rows: gate, then up)."""

    def __init__(self, d_model: int, ffn_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(d_model, 2 * ffn_size, bias=False)
        self.down_proj = nn.Linear(ffn_size, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (B, T, C) -> 2 x (B, T, I)
        return self.down_proj(F.silu(gate) * up)  # (B, T, I) -> (B, T, C)


def transposed_storage(weight: Tensor) -> Tensor:
    """The same (out, in) matrix stored column-major: a (out, in) view of an (in, out) tensor.

    ``F.linear`` over it reads the (in, out) layout, which measured 1.7x faster
    than row-major for SmolLM2's (49152, 576) head at batch 1 on an AVX2 CPU
    (BENCHMARKS.md); embedding lookups gather columns, a negligible cost.
    """
    return weight.t().contiguous().t()


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

    def forward(self, x: Tensor, positions: Tensor | None, key_mask: Tensor | None, kv_cache: Cache | None) -> Tensor:
        h = self.attention(self.attention_norm(x), positions=positions, key_mask=key_mask, kv_cache=kv_cache)
        x = x + h  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))


class LlamaModel(GenerationMixin, nn.Module):
    """A Llama decoder: token ids in, logits out; with a tokenizer, text in and out (GenerationMixin).

    ``forward(input_ids, attention_mask=None, kv_caches=None, positions=None)``
    returns logits (B, T, V). Attention layers are ``layers.<i>.attention``
    (for :func:`attnkit.trace`).
    """

    def __init__(self, config: LlamaConfig, tokenizer: Tokenizer | None = None) -> None:
        super().__init__()
        self.config = config
        head = transposed_storage(torch.empty(config.vocab_size, config.d_model).normal_())  # (V, C)
        self.embed = nn.Embedding(config.vocab_size, config.d_model, _weight=head)
        rope = RotaryEmbedding(config.head_dim, base=config.rope_base, scaling=config.rope_scaling)  # one for all
        self.layers = nn.ModuleList([LlamaBlock(config, rope) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        self.tokenizer = tokenizer
        # what the generation loop reads (attnkit.models.generation.CausalLM)
        self.vocab_size, self.context_length = config.vocab_size, config.context_length
        self.pad_token_id: int = 0 if tokenizer is None else tokenizer.pad_id  # type: ignore[attr-defined]
        self.stop_token_ids: tuple[int, ...] = () if tokenizer is None else tokenizer.stop_ids  # type: ignore

    def tie_weights(self) -> None:
        """With tied embeddings, the head is the embedding matrix (one Parameter, as after loading)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def new_caches(self, capacity: int | None = None, *, static: bool = False) -> list[Cache]:
        """One empty cache per layer: a growing :class:`attnkit.KVCache` (up to ``capacity`` positions,
        or unbounded), or with ``static`` a :class:`attnkit.StaticKVCache` of ``capacity`` slots."""
        if static:
            if capacity is None:
                raise ValueError("a static cache needs a capacity (positions 0 .. capacity - 1)")
            return [StaticKVCache(capacity) for _ in self.layers]
        return [KVCache(capacity) for _ in self.layers]

    def _hidden(self, input_ids: Tensor, positions: Tensor | None, key_mask: Tensor | None,
                kv_caches: Sequence[Cache | None]) -> Tensor:
        x = self.embed(input_ids)  # (B, T) -> (B, T, C)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, key_mask, cache)
        return self.norm(x)

    def _run(self, input_ids: Tensor, positions: Tensor | None, key_mask: Tensor | None,
             kv_caches: Sequence[Cache] | None) -> Tensor:
        if kv_caches is None:
            return self._hidden(input_ids, positions, key_mask, [None] * len(self.layers))
        with transaction(kv_caches, [block.attention for block in self.layers]):  # all caches, or none, change
            return self._hidden(input_ids, positions, key_mask, kv_caches)

    def _check_caches(self, kv_caches: object) -> Sequence[Cache] | None:
        if kv_caches is None:
            return None
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches must be a list of {len(self.layers)} caches (one per layer), e.g. "
                             f"model.new_caches(); got {type(kv_caches).__name__}")
        return [check_cache(c, f"kv_caches[{i}]") for i, c in enumerate(kv_caches)]

    def _key_mask(self, input_ids: Tensor, attention_mask: object, kv_caches: Sequence[Cache] | None
                  ) -> Tensor | None:
        if attention_mask is None:
            return None
        if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 2 or (
                attention_mask.shape[0] != input_ids.shape[0] or attention_mask.shape[1] < input_ids.shape[1]):
            got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be (B, S) with B = {input_ids.shape[0]} and S = the cache's "
                             f"positions + {input_ids.shape[1]} new ones, got {got}")
        return generation.mask_to_bool(attention_mask).to(input_ids.device)

    def _check_room(self, input_ids: Tensor, positions: Tensor | None, caches: Sequence[Cache] | None) -> None:
        """Every position must lie in the context window."""
        b, t = input_ids.shape
        if positions is None:
            at = 0 if caches is None else caches[0].next_positions(b, t, input_ids.device)
            if isinstance(at, int):
                if at + t > self.context_length:
                    raise ValueError(f"{at} cached + {t} new positions exceed the model's context length "
                                     f"{self.context_length}")
                return
            positions = at
        if int(positions.max()) >= self.context_length:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context length "
                             f"{self.context_length} (positions 0 .. {self.context_length - 1})")

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                kv_caches: Sequence[Cache] | None = None, positions: Tensor | None = None) -> Tensor:
        """Logits (B, T, V) for input_ids (B, T).

        Args:
            attention_mask: (B, S) bool or 0/1, True/1 = real token, False/0 =
                padding; S = cached + T positions. None = all real.
            kv_caches: one cache per layer (``new_caches()``); the new
                positions are stored and attention covers all they hold.
            positions: (B, T) long, each token's position (-1: padding, a
                token nobody sees); rows may sit at different positions, so
                left padding is not needed. None = 0 .. T - 1 or after what
                the caches hold.
        """
        generation.check_input_ids(self, input_ids)
        caches = self._check_caches(kv_caches)
        if positions is not None:
            positions = check_positions(positions, *input_ids.shape)
        self._check_room(input_ids, positions, caches)
        key_mask = self._key_mask(input_ids, attention_mask, caches)
        return self.lm_head(self._run(input_ids, positions, key_mask, caches))  # (B, T, C) -> (B, T, V)

    def step(self, input_ids: Tensor, positions: Tensor | None, kv_caches: Sequence[Cache]) -> Tensor:
        """Logits (B, V) of the last position only; no checks (the generation loop made them)."""
        return self.lm_head(self._run(input_ids, positions, None, kv_caches)[:, -1])  # (B, T, C) -> (B, V)


def __getattr__(name: str) -> Any:
    """``load_gguf``, ``load_smollm2``, ``smollm2_path`` moved to :mod:`attnkit.models.loader`."""
    if name in ("load_gguf", "load_smollm2", "smollm2_path", "convert_gguf_weights", "SMOLLM2_FILE"):
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
