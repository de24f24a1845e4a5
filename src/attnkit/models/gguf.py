"""Reading GGUF files (llama.cpp's format) with the ``gguf`` package.

A GGUF file holds metadata (architecture, sizes, tokenizer vocabulary and
merges, chat template) and tensors, often quantised. This module reads both,
dequantises with gguf's own ``dequantize`` (never a hand-written one) and
undoes the row permutation llama.cpp applies to the query and key projections
of Llama models, so the weights fit attnkit's half-split rotary embedding.

    file = read_gguf("model.gguf")
    file.metadata["llama.block_count"]      # 30
    weight = file.tensor("blk.0.attn_q.weight")  # np.float32 (out, in)

Reading a file's metadata with ``gguf.GGUFReader`` parses every entry of its
vocabulary one at a time: 5 s of SmolLM2's load. What it found (the metadata
and where each tensor lies) is kept as a small JSON *index* in attnkit's cache
folder (``$ATTNKIT_CACHE``, else ``~/.cache/attnkit``), keyed by the file's
path, size and modification time; a later read of the same file loads the
index and memory-maps the tensors, without the reader. Files under
:data:`INDEX_MIN_BYTES` are not indexed.

Legend: H heads (query or key/value), D head dim.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnkit._optional import require

# Metadata arrays that are read in full; other arrays are kept as their length only.
_FULL_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
INDEX_MIN_BYTES = 32 << 20  # smaller files parse in well under a second: not worth an index
_INDEX_VERSION = 1


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a file: its bytes (a memory-mapped view, as ``gguf.GGUFReader`` lays them out), type and
    dims (GGUF's order, innermost first)."""

    data: np.ndarray
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file


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

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape as stored (GGUF's order, fastest dimension first), without reading its data."""
        return tuple(int(n) for n in self._get(name).shape)

    def _get(self, name: str) -> Any:
        if name not in self._tensors:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from this GGUF file")
        return self._tensors[name]

    def q4_1_rows(self, name: str) -> np.ndarray:
        """A Q4_1 tensor's blocks as stored: uint8 (out, in / 32 * 20), one row of blocks per output row."""
        tensor = self._get(name)
        if tensor.tensor_type.name != "Q4_1":
            raise ValueError(f"{self.path}: tensor {name!r} is {tensor.tensor_type.name}, not Q4_1")
        return np.asarray(tensor.data)

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


def read_gguf(path: str | Path, *, index: bool | None = None) -> GGUFFile:
    """Open a GGUF file: its metadata now, its tensors on demand (memory-mapped).

    ``index``: keep (and use) the file's index in the cache folder (see the
    module docstring); None: for files of at least :data:`INDEX_MIN_BYTES`.
    An index that is missing, stale or unreadable is rebuilt from the file;
    one that cannot be written is skipped.

    Raises FileNotFoundError for a missing file and ValueError for one that is
    not a readable GGUF file (truncated, corrupt, or another format).
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    indexed = path.stat().st_size >= INDEX_MIN_BYTES if index is None else index
    if not indexed:
        return _parse(path)
    where = index_path(path)
    file = _from_index(path, where)
    if file is None:
        file = _parse(path)
        _write_index(file, where)
    return file


def _parse(path: Path) -> GGUFFile:
    """The file read by ``gguf.GGUFReader``."""
    gguf = require("gguf", "Reading GGUF files")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: _field_value(f) for name, f in reader.fields.items()}
        tensors = {t.name: GGUFTensor(t.data, t.tensor_type, tuple(int(n) for n in t.shape), int(t.data_offset))
                   for t in reader.tensors}
    except (ValueError, IndexError, KeyError, TypeError, OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): "
                         f"{type(err).__name__}: {err}") from err
    return GGUFFile(path, metadata, tensors)


def index_path(path: Path) -> Path:
    """Where the index of ``path`` lives in the cache folder: keyed by the file as it is now (size, modification
    and change times, inode: a copy that keeps the modification time is another file) and the gguf package's
    version (which reads it)."""
    from importlib.metadata import version

    stat = path.stat()
    key = (f"{_INDEX_VERSION}:{version('gguf')}:{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:"
           f"{stat.st_ctime_ns}:{stat.st_ino}")
    cache = Path(os.environ.get("ATTNKIT_CACHE") or Path.home() / ".cache" / "attnkit")
    return cache / "gguf-index" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _write_index(file: GGUFFile, where: Path) -> None:
    """Save ``file``'s metadata and tensor places at ``where``, atomically; skipped if it cannot be written."""
    tensors = [[name, int(t.tensor_type), list(t.shape), t.offset, t.data.dtype.str, list(t.data.shape)]
               for name, t in file._tensors.items()]
    record = {"version": _INDEX_VERSION, "metadata": file.metadata, "tensors": tensors}
    try:
        where.parent.mkdir(parents=True, exist_ok=True)
        partial = where.with_suffix(f".{os.getpid()}.part")
        partial.write_text(json.dumps(record))
        partial.replace(where)
    except (OSError, TypeError, ValueError):  # a read-only cache, or metadata JSON cannot hold: read it each time
        return


def _from_index(path: Path, where: Path) -> GGUFFile | None:
    """The file from its index (tensors memory-mapped), or None when there is no usable index."""
    gguf = require("gguf", "Reading GGUF files")
    try:
        record = json.loads(where.read_text())
        if not isinstance(record, dict) or record.get("version") != _INDEX_VERSION:
            return None
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {}
        for name, kind, dims, offset, dtype, shape in record["tensors"]:
            count = int(np.prod(shape))
            data = np.frombuffer(mm, dtype=np.dtype(dtype), count=count, offset=offset).reshape(shape)
            tensors[name] = GGUFTensor(data, gguf.GGMLQuantizationType(kind), tuple(dims), offset)
        return GGUFFile(path, record["metadata"], tensors)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing or damaged: parse the file again
        return None


def metadata_int(metadata: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """An integer >= 1 at ``key`` (or ``default``); a ValueError naming the key when missing or not one."""
    value = metadata.get(key, default)
    if value is None:
        raise ValueError(f"the GGUF metadata lacks {key!r}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"the GGUF metadata's {key} = {value!r} cannot describe a model: expected an integer >= 1")
    return value


def metadata_float(metadata: Mapping[str, Any], key: str, default: float, *, above: float) -> float:
    """A finite number greater than ``above`` at ``key`` (or ``default``); a ValueError naming the key otherwise."""
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > above):
        raise ValueError(f"the GGUF metadata's {key} = {value!r} cannot describe a model: expected a finite "
                         f"number > {above:g}")
    return float(value)


Q4_1_BLOCK = 20  # bytes per 32 weights: d and m (float16), then 16 bytes of 4-bit codes


def q4_1_grid(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 blocks (out, in / 32 * 20 bytes) as (codes int32 (out, in) in 0..15, scale d and minimum m
    float32 (out, in / 32)): weight = m + codes * d, group by group of 32 inputs, read without dequantising."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, Q4_1_BLOCK)  # (N, K/32, 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/32)
    nibbles = blocks[..., 4:]  # (N, K/32, 16): element j in the low nibble, element j + 16 in the high one
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # (N, K/32, 32)
    return codes.reshape(n, -1).astype(np.int32), d, m  # (N, K), (N, K/32), (N, K/32)


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
