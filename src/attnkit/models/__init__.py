"""Pretrained models rebuilt on attnkit layers.

Importing this package registers every architecture :func:`load_gguf` reads
(:mod:`attnkit.models.registry`): each model file registers its own when
imported (llama, gemma3, gemma2, then phi3, qwen2 and qwen3).
"""

from .gemma2 import Gemma2Config, Gemma2Model
from .gemma3 import Gemma3Config, Gemma3Model, load_gemma3
from .generation_options import GenerationStats
from .llama import LlamaConfig, LlamaModel
from .loader import load_gguf, load_smollm2
from .minilm import BertConfig, MiniLM, load_minilm
from .phi3 import Phi3Model
from .qwen import Qwen2Model, Qwen3Model

__all__ = ["BertConfig", "Gemma2Config", "Gemma2Model", "Gemma3Config", "Gemma3Model", "GenerationStats",
           "LlamaConfig", "LlamaModel", "MiniLM", "Phi3Model", "Qwen2Model", "Qwen3Model", "load_gemma3", "load_gguf",
           "load_minilm", "load_smollm2"]
