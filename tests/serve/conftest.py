"""Fixtures shared by the serving tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.serve._tools import write_tool_model


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen 2 file of :func:`write_tool_model`, whose chat template (Qwen 2.5's) offers tools."""
    return write_tool_model(tmp_path_factory.mktemp("tools") / "tiny-tools.gguf")
