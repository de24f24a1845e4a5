"""Pretrained models rebuilt on attnkit layers."""

from .generation import GenerationStats
from .llama import LlamaConfig, LlamaModel
from .loader import load_gguf, load_smollm2
from .minilm import BertConfig, MiniLM, load_minilm

__all__ = ["BertConfig", "GenerationStats", "LlamaConfig", "LlamaModel", "MiniLM", "load_gguf", "load_minilm",
           "load_smollm2"]
