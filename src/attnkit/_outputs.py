"""Checks on the paths a command will write, made before the work starts (not after it).

A mistyped ``--png`` or ``--out`` should cost a second, not the minutes of the
run it follows. Each check raises ValueError naming the option, the path and
what is wrong with it; the command line prints that as its one-line error.
"""

from __future__ import annotations

import os
from pathlib import Path


def _writable_folder(folder: Path, option: str, path: Path) -> None:
    """``folder`` exists, is a folder, and this process may create files in it."""
    if not folder.exists():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: no permission to write in the folder {folder}")


def check_output_file(path: str | os.PathLike[str], option: str) -> Path:
    """A file ``option`` will write: not a folder, in a folder that exists and is writable, itself writable."""
    target = Path(path)
    if not str(path):
        raise ValueError(f"{option} is empty: give a file name")
    if target.is_dir():
        raise ValueError(f"{option} {target} is a folder: give a file name, such as {target / 'out'}")
    _writable_folder(target.parent, option, target)
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{option} {target}: the file exists and this process may not overwrite it")
    return target


def check_output_dir(path: str | os.PathLike[str], option: str) -> Path:
    """A folder ``option`` will write files into (created later, with its parents, if missing).

    It must not be a file, and its nearest existing ancestor must be a writable folder.
    """
    target = Path(path)
    if not str(path):
        raise ValueError(f"{option} is empty: give a folder name")
    if target.exists():
        if not target.is_dir():
            raise ValueError(f"{option} {target} is a file: give a folder (it holds several files)")
        _writable_folder(target, option, target)
        return target
    ancestor = target.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    _writable_folder(ancestor, option, target)
    return target
