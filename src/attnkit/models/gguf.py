"""Reading GGUF files (llama.cpp's format) with the ``gguf`` package.

A GGUF file holds metadata (architecture, sizes, tokenizer vocabulary and
merges, chat template) and tensors, often quantised. This module reads both,
dequantises with gguf's own ``dequantize`` (never a hand-written one) and
undoes the row permutation llama.cpp applies to the query and key projections
of Llama models, so the weights fit attnkit's half-split rotary embedding.

    file = read_gguf("model.gguf")
    file.metadata["llama.block_count"]      # 30
    weight = file.tensor("blk.0.attn_q.weight")  # np.float32 (out, in)

Legend: H heads (query or key/value), D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnkit._optional import require

# Metadata arrays that are read in full; other arrays are kept as their length only.
_FULL_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")


@dataclass
class GGUFFile:
    """The metadata and tensors of one GGUF file.

    ``metadata`` maps each key to a Python value (str, int, float, bool, or a
    list for the tokenizer's arrays; other arrays become their length).
    ``tensor(name)`` dequantises one tensor to float32 in PyTorch's
    (out_features, in_features) order.
    """

    path: Path
    metadata: dict[str, Any]
    _tensors: dict[str, Any] = field(repr=False)

    @property
    def tensor_names(self) -> list[str]:
        """Names of the tensors the file holds, in file order."""
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The storage type of a tensor, e.g. "Q4_1" or "F32"."""
        return str(self._get(name).tensor_type.name)

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from this GGUF file")
        return self._tensors[name]

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantised to float32, in PyTorch's (out, in) order."""
        gguf = require("gguf", "Reading GGUF files")
        tensor = self._get(name)
        try:
            array = gguf.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as err:
            raise ValueError(f"{self.path}: tensor {name!r} has type {tensor.tensor_type.name}, which the "
                             f"gguf package cannot dequantise ({err})") from err
        expected = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
        if array.shape != expected:
            raise ValueError(f"{self.path}: tensor {name!r} dequantised to shape {array.shape}, expected "
                             f"{expected}; the file may be corrupt")
        array = np.asarray(array, dtype=np.float32)
        return array if array.flags.writeable else array.copy()  # F32 tensors are read-only views of the file


def _field_value(reader_field: Any) -> Any:
    """A metadata field as a Python value; long arrays other than the tokenizer's as their length."""
    gguf = require("gguf", "Reading GGUF files")
    is_array = bool(reader_field.types) and reader_field.types[0] == gguf.GGUFValueType.ARRAY
    if is_array and reader_field.name not in _FULL_ARRAYS and len(reader_field.data) > 64:
        return len(reader_field.data)
    return reader_field.contents()


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file: its metadata now, its tensors on demand (memory-mapped).

    Raises FileNotFoundError for a missing file and ValueError for one that is
    not a readable GGUF file (truncated, corrupt, or another format).
    """
    gguf = require("gguf", "Reading GGUF files")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: _field_value(f) for name, f in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
    except (ValueError, IndexError, KeyError, TypeError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(err).__name__}: {err}") from err
    return GGUFFile(path, metadata, tensors)


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: interleaved rotary pairs -> half-split.

    llama.cpp's converter reorders each head's D rows from (first half, second
    half) to interleaved pairs (0, D/2, 1, D/2 + 1, ...). This puts them back,
    as ``convert_hf_to_gguf.py``'s ``permute`` inverted.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {num_heads} heads of even size")
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])  # (H*D, ...) -> (H, D/2, 2, ...)
    return w.swapaxes(1, 2).reshape(weight.shape)  # (H, 2, D/2, ...) -> (H*D, ...)
