"""The production layers: MultiHeadAttention, CrossAttention, the KV cache, and converters."""

from .attention import MultiHeadAttention
from .convert import from_textbook, from_torch, to_torch
from .cross import CrossAttention
from .heads import Heads
from .int8_cache import Int8KVCache
from .kv_cache import Cache, KVCache
from .sink_cache import SinkCache
from .static_cache import StaticKVCache

__all__ = ["Cache", "CrossAttention", "Heads", "Int8KVCache", "KVCache", "MultiHeadAttention", "SinkCache",
           "StaticKVCache", "from_textbook", "from_torch", "to_torch"]
