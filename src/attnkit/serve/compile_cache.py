"""Where the serving engine's compiled decode step (:mod:`attnkit.serve.graph`) is kept between runs.

Under attnkit's cache folder (``$ATTNKIT_CACHE`` or ``~/.cache/attnkit``, then
``compile/``): PyTorch's portable cache artifacts
(``torch.compiler.save_cache_artifacts``) in one file per (torch, CPU
capability, model, weight form, dtypes, and the GPU off the CPU), behind a one-line JSON header that
names that key and the payload's SHA-256; and, unless
``TORCHINDUCTOR_CACHE_DIR`` is set already, Inductor's own cache (the compiled
kernels: without them a restart runs the C++ compiler again), in a folder per
torch version and CPU capability. A file whose header or checksum does not
match is removed unread (never handed to PyTorch's loader), as is one PyTorch
cannot read; the compile then runs cold and writes it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from attnkit.models.gemma3 import cache_dir
from attnkit.modules.quantize import weight_form

FORMAT = "attnkit compiled decode step, 2"  # a cache file header's first field (2: one graph for every B)


class CompileCache:
    """One model's compiled decode step on disk: PyTorch's cache artifacts in one checked file, and Inductor's
    kernels beside it.

    Args:
        folder: where the files go (``compile/`` under attnkit's cache folder by default: :meth:`for_model`).
        key: what the artifacts were compiled for; a file written for another key is never loaded.
    """

    def __init__(self, folder: Path, key: dict[str, str]) -> None:
        self.folder, self.key = folder, key
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = folder / f"decode-{digest}.bin"

    @classmethod
    def for_model(cls, model: Any, kv_dtype: torch.dtype, folder: Path | None = None) -> CompileCache:
        """The cache of ``model``'s decode step over a pool of ``kv_dtype``, under ``folder`` (default: attnkit's
        cache folder's ``compile/``)."""
        parameter = next(model.parameters())
        key = {"format": FORMAT, "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
               "model": type(model).__name__, "config": repr(model.config), "weights": weight_form(model),
               "dtype": str(parameter.dtype), "kv_dtype": str(kv_dtype)}
        if parameter.device.type != "cpu":  # a GPU's kernels; the CPU's key (and its files) as before
            key["device"] = _device_name(parameter.device)
        return cls(folder if folder is not None else cache_dir() / "compile", key)

    def use_kernel_folder(self) -> None:
        """Have Inductor keep its kernels under :attr:`folder` (per torch version and CPU capability: a graph
        compiled for one ISA decodes other tokens under another), unless ``TORCHINDUCTOR_CACHE_DIR`` says where
        already (this process compiled before, or its user chose)."""
        if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            name = f"inductor-{self.key['torch']}-{self.key['cpu']}".replace("/", "_")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.folder / name)

    def load(self) -> str:
        """Hand PyTorch the artifacts of an earlier compile; what happened, for the log: "warm", "cold" (no file),
        or why a file was removed unread (another key, a checksum that does not match, a payload PyTorch refused)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return "cold"
        payload, problem = _checked(data, self.key)
        if problem is None:
            try:
                if torch.compiler.load_cache_artifacts(payload) is not None:
                    return "warm"
                problem = "PyTorch could not read its artifacts"
            except Exception as err:  # whatever PyTorch raises, the file goes and the compile runs cold
                problem = f"PyTorch refused its artifacts: {err!r}"
        self.path.unlink(missing_ok=True)
        return f"cold: {self.path} removed unread ({problem})"

    def save(self) -> None:
        """Write the artifacts this process compiled (or loaded) so far, with the header :meth:`load` checks;
        atomically (a reader never sees half a file)."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        payload = saved[0]
        header = {"format": FORMAT, "key": self.key, "sha256": hashlib.sha256(payload).hexdigest()}
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(json.dumps(header, sort_keys=True).encode() + b"\n" + payload)
        partial.replace(self.path)


def _device_name(device: torch.device) -> str:
    """A GPU as its compiled kernels depend on it: its type, name and compute capability."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor}"


def _checked(data: bytes, key: dict[str, str]) -> tuple[bytes, str | None]:
    """A cache file's payload, and why it must not be loaded (None: it may)."""
    line, _, payload = data.partition(b"\n")
    try:
        header = json.loads(line)
    except (UnicodeDecodeError, ValueError):
        return b"", "no header"
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return b"", "not attnkit's format"
    if header.get("key") != key:
        return b"", "compiled for another torch, CPU, GPU, model or dtype"
    if header.get("sha256") != hashlib.sha256(payload).hexdigest():
        return b"", "its checksum does not match"
    return payload, None
