"""`attnkit explain` from the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnkit import cli
from attnkit.inspect.walkthrough import STEPS


@pytest.fixture(autouse=True)
def _eighty_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.delenv("FORCE_COLOR", raising=False)


def run(capsys, *args):
    code = cli.main(["explain", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_default_walkthrough_shows_every_step_in_80_columns(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    for number, title in enumerate(STEPS.values(), start=1):
        assert f"{number}. {title}" in out
    assert "Your journey starts with one step" in out
    assert "0.4300  0.1500  0.8900" in out  # the book's embedding of "Your"
    assert max(len(line) for line in out.splitlines()) <= 80


def test_steps_option_and_numbers_follow_the_seed(capsys):
    _, out1, _ = run(capsys, "--steps", "output", "--seed", "1")
    _, out2, _ = run(capsys, "--steps", "output", "--seed", "2")
    assert "12. Output" in out1 and "1. Input" not in out1
    assert out1 != out2


def test_own_text_says_embeddings_are_random(capsys):
    code, out, _ = run(capsys, "cats", "chase", "mice", "--steps", "inputs")
    assert code == 0
    assert "cats chase mice  (3 tokens)" in out
    assert "random 3-d embeddings from torch.randn with seed 123" in out


def test_long_text_is_cut_to_fit_and_says_so(capsys):
    words = [f"w{i}" for i in range(20)]
    _, out, _ = run(capsys, *words, "--steps", "softmax")
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "of 20 columns" in out and "--json has every number" in out


def test_no_causal_and_dropout_options(capsys):
    _, out, _ = run(capsys, "--no-causal", "--steps", "mask")
    assert "No mask (--no-causal)" in out
    _, out, _ = run(capsys, "--dropout", "0.5", "--steps", "dropout")
    assert "Training mode: each weight is zeroed with p=0.5" in out


def test_json_has_every_step_and_every_number(capsys, tmp_path):
    path = tmp_path / "steps.json"
    code, out, _ = run(capsys, "--heads", "2", "--d-out", "6", "--json", str(path))
    assert code == 0 and str(path) in out
    doc = json.loads(path.read_text())
    assert doc["tokens"] == "Your journey starts with one step".split()
    assert [s["key"] for s in doc["steps"]] == list(STEPS)
    scaled = next(s for s in doc["steps"] if s["key"] == "scaled")["tensors"]["scaled"]
    assert scaled["shape"] == [2, 6, 6] and scaled["axes"] == ["head", "query", "key"]
    assert scaled["data"][0][0][1] is None  # -inf written as null
    assert doc["head_dim"] == 3 and doc["causal"] is True


@pytest.mark.parametrize(("args", "message"), [
    (["--heads", "3"], "d_out=4 is not divisible by num_heads=3"),
    (["--dropout", "1.0"], "dropout=1.0 is outside [0, 1)"),
    (["--steps", "scores,nope"], "unknown step(s) nope"),
    (["   "], "is empty: give at least one word"),
    (["--d-out", "0"], "d_out must be positive"),
])
def test_bad_input_is_a_clear_error(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("attnkit explain: error: ") and message in err


def test_python_dash_m_runs_the_same_command():
    result = subprocess.run([sys.executable, "-m", "attnkit", "explain", "--steps", "output"],
                            capture_output=True, text=True, check=True)
    assert "12. Output" in result.stdout
