"""Serving: a paged KV cache with prefix reuse, continuous batching, and an OpenAI-compatible HTTP API.

- :mod:`attnkit.serve.blocks`: which blocks each sequence holds (reference counts, prefix hashes, LRU reuse);
- :mod:`attnkit.serve.paged`: the blocks' tensors, read by the decoder through the cache protocol;
- :mod:`attnkit.serve.engine`: the scheduler and the engine thread;
- :mod:`attnkit.serve.checks`: an OpenAI request's fields checked one by one, and OpenAI's error shape;
- :mod:`attnkit.serve.api`: the HTTP routes (extra ``serve``: FastAPI and uvicorn) and the chat page.
"""

from .blocks import BlockManager
from .engine import Engine, EngineError, Event, QueueFullError, SamplingParams
from .paged import PagedBatch, PagedKVPool

__all__ = ["BlockManager", "Engine", "EngineError", "Event", "PagedBatch", "PagedKVPool", "QueueFullError",
           "SamplingParams"]
