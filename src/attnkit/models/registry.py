"""Architectures as registrations: what :func:`attnkit.models.load_gguf` looks up by ``general.architecture``.

Each model file registers its architecture when it is imported
(``attnkit.models`` imports them all), and the loader holds no architecture
names: adding one is a model file and a test.

    register(Architecture("qwen2", config=qwen2_config, block=qwen2_tensors, model=Qwen2Model))

A registration needs:

- ``config(metadata, *, tie_embeddings)``: the model's config from the file's
  metadata, every key it uses checked and named when wrong (RoPE scaling
  kinds it cannot honour refused by name). It has the sizes
  :class:`DecoderModel` reads, and ``num_layers``.
- ``block(config, layer)``: where each parameter of block ``layer`` lies in
  the file: {parameter name under ``layers.<layer>.``: the file tensors
  (:class:`Part`) whose rows it concatenates}. The embedding, final norm and
  head are every decoder's and need no entry.
- ``model``: the :class:`~attnkit.models.decoder.DecoderModel` class,
  built as ``model(config, tokenizer)``; its ``accurate_forms`` say which
  weight form ``weights="auto"`` may pick.

:func:`read_weights` reads every tensor a registration names, checks its
shape, fuses the parts, and refuses a file holding tensors nobody named.

Legend: V vocabulary, C width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from attnkit.modules.packed import int4_fits

from .decoder import DecoderConfig, DecoderModel, transposed_storage
from .generation import Tokenizer
from .gguf import Q4_1_BLOCK, GGUFFile, q4_1_grid, unpermute_rows

Grids = dict[str, tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Part:
    """One file tensor read into a parameter: its llama.cpp name, the shape the config implies, and the heads
    whose rows llama.cpp's converter interleaved for its rotary embedding (None: rows kept as stored)."""

    name: str
    shape: tuple[int, ...]
    heads: int | None = None


BlockTensors = Mapping[str, Sequence[Part]]  # parameter name -> the parts fused into it by rows


class GGUFConfig(DecoderConfig, Protocol):
    """What the loader reads from any registered architecture's config."""

    @property
    def num_layers(self) -> int: ...


class ConfigReader(Protocol):
    def __call__(self, metadata: Mapping[str, Any], *, tie_embeddings: bool = True) -> Any: ...


@dataclass(frozen=True)
class Architecture:
    """One ``general.architecture``: its config reader, where its block parameters lie in a file, its model."""

    name: str
    config: ConfigReader
    block: Callable[[Any, int], BlockTensors]
    model: type[DecoderModel]  # built as model(config, tokenizer)

    def build(self, config: Any, tokenizer: Tokenizer | None) -> DecoderModel:
        """The model of ``config`` with ``tokenizer`` (random weights, or on the meta device to be loaded)."""
        make: Callable[..., DecoderModel] = self.model  # (config, tokenizer): every registered class's signature
        return make(config, tokenizer)


_REGISTRY: dict[str, Architecture] = {}
NEEDS = ("a registration (attnkit.models.registry.register) needs the architecture's config reader, where each "
         "block parameter lies in the file and its DecoderModel class")


def register(architecture: Architecture) -> Architecture:
    """Add ``architecture`` under its name; a second registration of one name is refused (naming it)."""
    if not isinstance(architecture, Architecture):
        raise TypeError(f"register() takes an Architecture, got {type(architecture).__name__}")
    if architecture.name in _REGISTRY:
        raise ValueError(f"architecture {architecture.name!r} is already registered")
    _REGISTRY[architecture.name] = architecture
    return architecture


def registered() -> tuple[str, ...]:
    """The registered architecture names, in the order they were registered."""
    return tuple(_REGISTRY)


def lookup(name: object, path: str | Path) -> Architecture:
    """The registration of ``name`` (a file's ``general.architecture``); else a ValueError listing them."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"{path}: architecture {name!r} is not supported (general.architecture); supported: "
                         f"{', '.join(_REGISTRY)}; {NEEDS}")
    return _REGISTRY[name]


# ---------------------------------------------------------------------------------------------------------------
# Reading the tensors a registration names


def _tensor(file: GGUFFile, part: Part) -> np.ndarray:
    """A tensor of the shape the configuration implies; a ValueError naming it otherwise."""
    array = file.tensor(part.name)
    if array.shape != part.shape:
        raise ValueError(f"{file.path}: tensor {part.name!r} has shape {array.shape}, but the metadata implies "
                         f"{part.shape}")
    return array if part.heads is None else unpermute_rows(array, part.heads)


def _fuse(file: GGUFFile, parts: Sequence[Part]) -> Tensor:
    """Tensors concatenated by rows, Q/K rows (heads given) un-permuted for half-split RoPE."""
    arrays = [_tensor(file, part) for part in parts]
    return torch.from_numpy(arrays[0] if len(arrays) == 1 else np.concatenate(arrays, axis=0))  # (sum of outs, ...)


def _grid_rows(file: GGUFFile, parts: Sequence[Part]) -> tuple[Tensor, Tensor, Tensor] | None:
    """The 4-bit grid (codes, scale, minimum) of a matrix fused as :func:`_fuse` fuses it, read from its Q4_1
    blocks without dequantising; None unless every part is Q4_1 and the fused matrix fits the int4 kernel."""
    if any(file.tensor_type(p.name) != "Q4_1" for p in parts):
        return None
    out, width = sum(p.shape[0] for p in parts), parts[0].shape[1]
    if not int4_fits(out, width):
        return None
    rows = []
    for part in parts:
        raw = file.q4_1_rows(part.name)  # (out, in / 32 * 20) bytes
        rows_in = part.shape[1]
        if raw.shape != (part.shape[0], rows_in // 32 * Q4_1_BLOCK) or rows_in % 32:
            raise ValueError(f"{file.path}: tensor {part.name!r} holds {raw.shape[0]} rows of {raw.shape[1]} bytes "
                             f"of Q4_1 blocks, but the metadata implies shape {part.shape}")
        rows.append(raw if part.heads is None else unpermute_rows(raw, part.heads))  # whole rows: permuted alike
    codes, scale, low = q4_1_grid(np.concatenate(rows, axis=0))  # (N, K), (N, K/32), (N, K/32)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(low)


# the decoder's (V, C) embedding and head and a GatedMLP's fused gate/up: stored column-major (transposed_storage)
_COLUMN_MAJOR = ("embed.weight", "lm_head.weight", "gate_up_proj.weight")


def _read(file: GGUFFile, table: BlockTensors, prefix: str, dtype: torch.dtype, grids: Grids | None
          ) -> dict[str, Tensor]:
    """``table``'s parameters under ``prefix``, cast to ``dtype``. ``grids`` (for int4): a matrix whose parts are
    all Q4_1 gets its 4-bit grid there under its module's name, and an unread placeholder in the state dict."""
    out: dict[str, Tensor] = {}
    for name, parts in table.items():
        if grids is not None and name.endswith(".weight") and len(parts[0].shape) == 2:
            grid = _grid_rows(file, parts)
        else:
            grid = None
        if grids is not None and grid is not None:
            grids[prefix + name.removesuffix(".weight")] = grid
            out[prefix + name] = torch.empty(grid[0].shape, dtype=dtype, device="meta")  # never read
            continue
        tensor = _fuse(file, parts).to(dtype)
        out[prefix + name] = transposed_storage(tensor) if name.endswith(_COLUMN_MAJOR) else tensor
    return out


def read_weights(file: GGUFFile, architecture: Architecture, config: GGUFConfig,
                 progress: Callable[[int, int], None] | None = None, *, dtype: torch.dtype = torch.float32,
                 grids: Grids | None = None) -> dict[str, Tensor]:
    """The model's state dict in ``dtype`` from the tensors ``architecture`` names, every shape checked.

    ``progress(done, total)`` is called as layers are read. ``grids`` (a dict to fill, for int4): see
    :func:`_read`. A file holding tensors no registration names is refused, naming them.
    """
    v, c, total = config.vocab_size, config.d_model, config.num_layers + 1
    top: dict[str, Sequence[Part]] = {"embed.weight": [Part("token_embd.weight", (v, c))],
                                      "norm.weight": [Part("output_norm.weight", (c,))]}
    if not config.tie_embeddings:
        top["lm_head.weight"] = [Part("output.weight", (v, c))]
    tables = [architecture.block(config, layer) for layer in range(config.num_layers)]
    _check_table(file, architecture, [top, *tables])  # every name and shape, before any weight is read
    out = _read(file, top, "", dtype, None)
    if config.tie_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    for layer, table in enumerate(tables):
        out |= _read(file, table, f"layers.{layer}.", dtype, grids)
        if progress is not None:
            progress(layer + 1, total)
    if progress is not None:
        progress(total, total)
    return out


def _check_table(file: GGUFFile, architecture: Architecture, tables: Sequence[BlockTensors]) -> None:
    """Refuse, from the file's tensor table alone, a tensor the registration names that is missing or of
    another shape than the metadata implies, and a tensor it does not name."""
    expected = set()
    for table in tables:
        for parts in table.values():
            for part in parts:
                stored = tuple(reversed(file.tensor_shape(part.name)))  # GGUF's dims, innermost first
                if stored != part.shape:
                    raise ValueError(f"{file.path}: tensor {part.name!r} has shape {stored}, but the metadata "
                                     f"implies {part.shape}")
                expected.add(part.name)
    unexpected = sorted(set(file.tensor_names) - expected)
    if unexpected:
        raise ValueError(f"{file.path}: tensors {unexpected[:5]} are not part of the supported {architecture.name} "
                         "architecture")
