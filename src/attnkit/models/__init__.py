"""Pretrained models rebuilt on attnkit layers.

Importing this package registers every architecture :func:`load_gguf` reads
(:mod:`attnkit.models.registry`): each model file registers its own when
imported (llama, gemma3, then qwen2 and qwen3).
"""

from .gemma3 import Gemma3Config, Gemma3Model, load_gemma3
from .generation_options import GenerationStats
from .llama import LlamaConfig, LlamaModel
from .loader import load_gguf, load_smollm2
from .minilm import BertConfig, MiniLM, load_minilm
from .qwen import Qwen2Model, Qwen3Model

__all__ = ["BertConfig", "Gemma3Config", "Gemma3Model", "GenerationStats", "LlamaConfig", "LlamaModel", "MiniLM",
           "Qwen2Model", "Qwen3Model", "load_gemma3", "load_gguf", "load_minilm", "load_smollm2"]
