"""attnkit: attention for transformer language models.

- :func:`attention`: one attention function, several kernels ("math", "sdpa",
  "chunked", "auto"), one mask convention (True = may attend), bottom-right
  causal alignment, zeros (not NaN) for queries with no visible key.
- :class:`MultiHeadAttention`: fused QKV, grouped-query heads, padding masks,
  rotary embeddings, sliding windows and a :class:`KVCache`;
  :class:`CrossAttention` for attending to another sequence.
- :func:`from_torch`, :func:`from_textbook`: converters.
- :func:`trace`: every intermediate of every attention layer in a model.
- :mod:`attnkit.textbook`: the chapter "Coding attention mechanisms" as code.
- :mod:`attnkit.inspect`: walkthroughs, heatmaps, an interactive page.
- :mod:`attnkit.models`: pretrained models rebuilt on attnkit (MiniLM).
- :class:`MissingDependencyError`: the ImportError of a feature whose optional
  package is missing; its message is the command that installs it.
"""

from ._optional import MissingDependencyError
from .backends import attention
from .functional import RotaryEmbedding
from .inspect import trace
from .modules import (
    CrossAttention,
    Heads,
    KVCache,
    MultiHeadAttention,
    SinkWindow,
    StaticKVCache,
    from_textbook,
    from_torch,
)

__version__ = "0.1.0"

__all__ = [
    "CrossAttention", "Heads", "KVCache", "MissingDependencyError", "MultiHeadAttention", "RotaryEmbedding",
    "SinkWindow", "StaticKVCache",
    "attention", "from_textbook", "from_torch",
    "trace",
]
