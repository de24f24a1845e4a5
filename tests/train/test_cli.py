"""`attnkit train induction` from the command line: the files it writes and its errors."""

from __future__ import annotations

import json

import pytest
import torch

from attnkit import cli
from tests._util import need


def test_a_short_run_writes_metrics_curves_heatmap_and_page(tmp_path, capsys):
    need("rich")
    need("matplotlib")
    code = cli.main(["train", "induction", "--steps", "4", "--seed", "2", "--vocab-size", "7", "--seq-len", "10",
                     "--out", str(tmp_path)])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "induction head L" in out and "previous-token head L" in out and "every induction head" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["config"]["steps"] == 4 and metrics["config"]["seed"] == 2 and metrics["config"]["vocab_size"] == 7
    assert [h["step"] for h in metrics["history"]] == [1, 4]
    assert len(metrics["final"]["induction"]) == 2 and len(metrics["final"]["induction"][0]) == 4
    assert set(metrics["ablation"]) == {"none", "induction_head", "previous_token_head", "induction_heads",
                                        "previous_token_heads"}
    for name in ("training.png", "induction_head.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "attention.html").read_text()
    assert '"name":"layer 0"' in page and '"name":"layer 1"' in page


@pytest.mark.parametrize(("args", "message"), [
    (["--steps", "0"], "steps=0"),
    (["--seq-len", "3"], "seq_len=3 is too short to repeat"),
    (["--vocab-size", "1"], "vocab_size=1"),
    (["--device", "tpu9"], "device='tpu9'"),
    (["--device", "meta"], "takes 'cpu' or 'cuda', got a meta device"),
])
def test_bad_input_is_one_line_naming_the_value(tmp_path, capsys, args, message):
    code = cli.main(["train", "induction", *args, "--out", str(tmp_path)])
    _, err = capsys.readouterr()
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "metrics.json").exists()


def test_cuda_without_a_gpu_is_an_error_naming_it(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["train", "induction", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "device='cuda'" in capsys.readouterr().err


def test_a_missing_matplotlib_hint_keeps_its_brackets(monkeypatch, tmp_path, capsys):
    """rich read "[viz]" in the hint as markup and printed pip install 'attnkit'."""
    from attnkit import cli
    from attnkit._optional import MissingDependencyError
    from attnkit.train import report

    def missing(*_: object, **__: object) -> None:
        raise MissingDependencyError("attnkit's heatmaps needs the optional package 'matplotlib', which is not "
                                     "installed: pip install 'attnkit[viz]'")

    monkeypatch.setattr(report, "write_figures", missing)
    assert cli.main(["train", "induction", "--steps", "2", "--out", str(tmp_path)]) == 0
    assert "pip install 'attnkit[viz]'" in " ".join(capsys.readouterr().out.split())
