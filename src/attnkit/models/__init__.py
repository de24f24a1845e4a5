"""Pretrained models rebuilt on attnkit layers."""

from .minilm import BertConfig, MiniLM, load_minilm

__all__ = ["BertConfig", "MiniLM", "load_minilm"]
