"""The paths a command will write are checked before the work, and a bad one is refused naming the option and why.

A mistyped ``--png`` or ``--out`` should cost a second, not the minutes of the run it follows. The files are
those of ``attnkit explain`` (``--png``, ``--html``, ``--json``); the folder is ``attnkit bench --out``, run on
a suite of one registered function (``ROW_SUITES``, as a plugin adds one) that records being run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from attnkit.bench import command
from attnkit.cli import main
from tests._util import need

need("rich")


def explain(capsys: pytest.CaptureFixture[str], flag: str, path: Path | str) -> tuple[int, str, str]:
    code = main(["explain", "--steps", "inputs", flag, str(path)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    """``bench(out, *args)``: ``attnkit bench --suite record --out out``; returns (code, err, whether it ran)."""
    runs: list[object] = []

    def record(options: Any) -> list[dict[str, Any]]:
        runs.append(options)
        return [{"name": "a", "value": 1}]

    monkeypatch.setitem(command.ROW_SUITES, "record", record)

    def run(out: Path | str, *args: str) -> tuple[int, str, bool]:
        code = main(["bench", "--suite", "record", "--out", str(out), *args])
        _, err = capsys.readouterr()
        return code, err, bool(runs)

    return run


def test_a_new_file_in_a_folder_or_an_existing_file_is_written(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = explain(capsys, "--json", tmp_path / "a.json")
    assert code == 0, err
    assert json.loads((tmp_path / "a.json").read_text())["tokens"]
    (tmp_path / "old.json").write_text("")
    code, _, err = explain(capsys, "--json", tmp_path / "old.json")
    assert code == 0, err
    assert json.loads((tmp_path / "old.json").read_text())["tokens"]  # overwritten


def test_a_folder_to_create_with_its_parents_or_an_existing_one_is_written_into(tmp_path: Path, bench: Any) -> None:
    code, err, ran = bench(tmp_path / "a" / "b" / "c")
    assert (code, ran) == (0, True), err
    assert (tmp_path / "a" / "b" / "c" / "results.json").is_file()
    code, err, _ = bench(tmp_path)
    assert code == 0, err
    assert (tmp_path / "results.json").is_file()


def test_an_accepted_folder_is_not_created_when_the_command_then_fails(tmp_path: Path, bench: Any) -> None:
    """Bug to catch: checking --out by creating it, which left an empty folder behind a command refused next."""
    code, err, ran = bench(tmp_path / "a" / "b" / "c", "--repeats", "0")
    assert (code, ran) == (2, False) and "--repeats must be >= 1" in err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("flag", ["--png", "--html", "--json"])
@pytest.mark.parametrize(("make", "message"), [
    (lambda t: t / "missing" / "a.png", "the folder {t}/missing does not exist"),
    (lambda t: t, "{t} is a folder: give a file name"),
    (lambda t: t / "file" / "a.png", "{t}/file is a file, not a folder"),
])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_work_naming_the_option_and_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, make: Any, message: str) -> None:
    (tmp_path / "file").write_text("")
    path = make(tmp_path)
    code, out, err = explain(capsys, flag, path)
    assert code == 2 and out == ""  # nothing shown: the walkthrough comes after the check
    assert err.startswith(f"attnkit explain: error: {flag} {path}") and message.format(t=tmp_path) in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("where", "message"), [
    ("file", "--out {t}/file is a file: give a folder"),
    ("file/sub/deeper", "--out {t}/file/sub/deeper: {t}/file is a file, not a folder"),
])
def test_an_output_folder_under_or_at_a_file_is_refused_before_the_work(tmp_path: Path, bench: Any, where: str,
                                                                        message: str) -> None:
    """`--out results` where results was a file failed with "[Errno 17] File exists" after the run."""
    (tmp_path / "file").write_text("")
    code, err, ran = bench(tmp_path / where)
    assert (code, ran) == (2, False)
    assert message.format(t=tmp_path) in err


def test_empty_paths_and_read_only_places_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, bench: Any) -> None:
    code, _, err = explain(capsys, "--png", "")
    assert code == 2 and "--png is empty: give a file name" in err
    code, err, ran = bench("")
    assert (code, ran) == (2, False) and "--out is empty: give a folder name" in err
    (tmp_path / "old.png").write_text("")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "old.png")
    code, _, err = explain(capsys, "--png", tmp_path / "old.png")
    assert code == 2 and "the file exists and this process may not overwrite it" in err
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root may write anywhere: deny by patching
    code, err, ran = bench(tmp_path / "new")
    assert (code, ran) == (2, False) and f"no permission to write in the folder {tmp_path}" in err
    assert not (tmp_path / "new").exists()
