"""Gemma 3's first use assembles its model file from package parts (a minute or more on a slow disk): it says so
on stderr, also when nothing is a terminal, and later uses say nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models.test_gemma3 import FakePackage, fake_package  # noqa: F401 - the fixture, shared


def test_the_first_assembly_prints_a_progress_line_on_stderr(fake_package: FakePackage,  # noqa: F811
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: ``attnkit generate --model gemma3`` sat silent for 80 s on its first run (its progress bar shows
    only at a terminal)."""
    from attnkit.models.runtime_options import packaged_path

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    path = packaged_path("gemma3")
    out, err = capsys.readouterr()
    assert out == "" and fake_package.assembled == 1
    first, done = err.splitlines()
    assert first.startswith("assembling Gemma 3 270M's model file from its 4 package parts into ")
    assert str(path) in first and "once" in first
    assert done.startswith(f"assembled {path.name} in ")
    assert packaged_path("gemma3") == path and capsys.readouterr().err == ""  # found: nothing to say


def test_the_progress_goes_where_the_caller_says(fake_package: FakePackage, tmp_path: Path,  # noqa: F811
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from attnkit.models.gemma3 import gemma3_path

    lines: list[str] = []
    gemma3_path(tmp_path / "a", progress=lines.append)
    gemma3_path(tmp_path / "b", progress=None)
    assert len(lines) == 2 and capsys.readouterr().err == ""
