"""Pretrained models rebuilt on attnkit layers."""

from .gemma3 import Gemma3Config, Gemma3Model, load_gemma3
from .generation_options import GenerationStats
from .llama import LlamaConfig, LlamaModel
from .loader import load_gguf, load_smollm2
from .minilm import BertConfig, MiniLM, load_minilm

__all__ = ["BertConfig", "Gemma3Config", "Gemma3Model", "GenerationStats", "LlamaConfig", "LlamaModel", "MiniLM",
           "load_gemma3", "load_gguf", "load_minilm", "load_smollm2"]
