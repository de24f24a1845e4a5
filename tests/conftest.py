"""Fixtures shared by test folders."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# ATEN_CPU_CAPABILITY=avx2 runs PyTorch's AVX2 kernels (and attnkit's choices for an AVX2 CPU, attnkit.cpu) on
# any x86 machine; fbgemm and oneDNN read their own variables, set here before either is first used, so the
# suite runs every kernel as an AVX2 CPU would (scripts/test.sh's second pass). Inductor's on-disk cache does not
# tell the two apart (a graph compiled for AVX512 and loaded under AVX2 decoded other tokens than eager AVX2
# kernels): this pass keeps its own.
if os.environ.get("ATEN_CPU_CAPABILITY", "").lower() == "avx2":
    import getpass
    import tempfile

    os.environ.setdefault("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) /
                                                         f"torchinductor_{getpass.getuser()}_avx2"))


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


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """A headless Chromium (Playwright) for one test module's browser tests: skipped without one, failed under
    CI=true (where scripts/browser.sh installs it). Not session-wide: Playwright's sync API holds an asyncio
    loop and a SIGINT handler while it runs, which later tests' asyncio.run() and Ctrl-C tests trip over."""
    from tests._util import CHROMIUM, CHROMIUM_FLAGS, need

    if not Path(CHROMIUM).exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{CHROMIUM} is missing; scripts/browser.sh installs it")
        pytest.skip(f"no {CHROMIUM}")
    sync_api = need("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()
