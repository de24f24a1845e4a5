"""The production layer: MultiHeadAttention, its KV cache, and converters."""

from .attention import MultiHeadAttention
from .convert import from_textbook, from_torch, to_torch
from .kv_cache import KVCache

__all__ = ["KVCache", "MultiHeadAttention", "from_textbook", "from_torch", "to_torch"]
