"""The production layers: MultiHeadAttention, CrossAttention, the KV caches, and converters."""

from .attention import MultiHeadAttention
from .cache_protocol import Cache
from .convert import from_textbook, from_torch, to_torch
from .cross import CrossAttention
from .heads import Heads
from .kv_cache import KVCache
from .sink_window import SinkWindow
from .static_cache import StaticKVCache

__all__ = ["Cache", "CrossAttention", "Heads", "KVCache", "MultiHeadAttention", "SinkWindow", "StaticKVCache",
           "from_textbook", "from_torch", "to_torch"]
