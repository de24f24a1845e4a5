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


@pytest.fixture
def uncached_compile(fresh_dynamo: None) -> Iterator[None]:
    """torch.compile without Inductor's on-disk caches: a graph loaded from one carries the guards it was
    compiled with, perhaps by other code (a test counting graphs would count those)."""
    import torch._functorch.config
    import torch._inductor.config

    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
