"""Fixtures shared by test folders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """torch.compile's caches emptied before and after the test: compiled frames left by other tests count
    toward dynamo's limit of recompilations per function (8), which a test run in another order would pass."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
