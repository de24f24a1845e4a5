"""Helpers shared by the tests."""

from __future__ import annotations

from collections.abc import Sequence

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
