"""Helpers shared by the tests."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

Nested = Sequence[object]


def assert_printed(actual: Tensor, printed: Nested | Tensor, atol: float = 1e-4) -> None:
    """Compare a whole tensor with numbers a notebook printed to 4 decimals.

    Rounding to 4 decimals is off by at most 5e-5, so 1e-4 is the tolerance;
    -inf entries must match exactly. Shapes must match too.
    """
    expected = printed if isinstance(printed, Tensor) else torch.tensor(printed, dtype=actual.dtype)
    torch.testing.assert_close(actual.detach(), expected.to(actual.dtype), atol=atol, rtol=0)


def assert_close64(actual: Tensor, reference: Tensor, **kw: float) -> None:
    """Compare with a float64 reference, at the precision of ``actual``'s dtype."""
    torch.testing.assert_close(actual.detach().double(), reference.detach().double(), **kw)


def need(module: str):
    """Import an optional test dependency: skip without it locally, but fail under CI=true.

    CI installs every dependency (scripts/test.sh), so there a missing one is an error, never a skip.
    """
    import importlib
    import os

    import pytest

    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)


CHROMIUM = "/usr/bin/chromium"  # Debian's, which scripts/browser.sh installs
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                  "--disable-default-apps", "--disable-extensions"]


@contextlib.contextmanager
def one_gguf_parse() -> Iterator[None]:
    """transformers parses a GGUF file's metadata once inside this block, not once per ``from_pretrained``.

    Loading a model from a GGUF file, transformers builds a ``gguf.GGUFReader`` for the config, another for the
    weights and a third for the tokenizer; each walks the whole vocabulary in Python (Gemma 3's 262,144 tokens:
    about 35 s each on 2 cores). The readers only read, so one per path serves every load.
    """
    gguf = need("gguf")
    readers: dict[str, Any] = {}
    original = gguf.GGUFReader

    def reader(path: str | os.PathLike[str]) -> Any:
        key = os.fspath(path)
        if key not in readers:
            readers[key] = original(key)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports it from gguf inside load_gguf_checkpoint, at each call
    try:
        yield
    finally:
        gguf.GGUFReader = original
