"""attnkit._outputs: the paths a command will write are checked before the work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attnkit._outputs import check_output_dir, check_output_file


def test_a_new_file_in_a_folder_or_an_existing_file_is_accepted(tmp_path: Path) -> None:
    assert check_output_file(tmp_path / "a.png", "--png") == tmp_path / "a.png"
    (tmp_path / "old.png").write_text("")
    assert check_output_file(tmp_path / "old.png", "--png") == tmp_path / "old.png"


def test_a_folder_to_create_with_its_parents_or_an_existing_one_is_accepted(tmp_path: Path) -> None:
    assert check_output_dir(tmp_path / "a" / "b" / "c", "--out") == tmp_path / "a" / "b" / "c"
    assert check_output_dir(tmp_path, "--out") == tmp_path
    assert not (tmp_path / "a").exists()  # checking creates nothing


@pytest.mark.parametrize(("make", "message"), [
    (lambda t: t / "missing" / "a.png", "the folder {t}/missing does not exist"),
    (lambda t: t, "{t} is a folder: give a file name"),
    (lambda t: t / "file" / "a.png", "{t}/file is a file, not a folder"),
])
def test_an_output_file_that_cannot_be_written_names_the_option_and_why(tmp_path: Path, make, message) -> None:
    (tmp_path / "file").write_text("")
    path = make(tmp_path)
    with pytest.raises(ValueError, match=f"^--png {path}"):
        check_output_file(path, "--png")
    with pytest.raises(ValueError) as err:
        check_output_file(path, "--png")
    assert message.format(t=tmp_path) in str(err.value)


@pytest.mark.parametrize(("where", "message"), [
    ("file", "--out {t}/file is a file: give a folder"),
    ("file/sub/deeper", "--out {t}/file/sub/deeper: {t}/file is a file, not a folder"),
])
def test_an_output_folder_under_or_at_a_file_is_refused(tmp_path: Path, where: str, message: str) -> None:
    """`--out results` where results was a file failed with "[Errno 17] File exists" after the run."""
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError) as err:
        check_output_dir(tmp_path / where, "--out")
    assert message.format(t=tmp_path) in str(err.value)


def test_empty_paths_and_read_only_places_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="--png is empty: give a file name"):
        check_output_file("", "--png")
    with pytest.raises(ValueError, match="--out is empty: give a folder name"):
        check_output_dir("", "--out")
    (tmp_path / "old.png").write_text("")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path / "old.png")
    with pytest.raises(ValueError, match="the file exists and this process may not overwrite it"):
        check_output_file(tmp_path / "old.png", "--png")
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # root may write anywhere: deny by patching
    with pytest.raises(ValueError, match=f"no permission to write in the folder {tmp_path}"):
        check_output_dir(tmp_path / "new", "--out")
