"""Serving: a paged KV cache with prefix reuse, continuous batching, and an OpenAI-compatible HTTP API.

- :mod:`attnkit.serve.blocks`: which blocks each request holds (reference counts, prefix hashes, LRU reuse);
- :mod:`attnkit.serve.paged`: the blocks' tensors, read by the decoder through the cache protocol;
- :mod:`attnkit.serve.scheduler`: which requests run in a step (admission, preemption, the prefill budget);
- :mod:`attnkit.serve.runner`: a step's rows through the model, and each request's next token;
- :mod:`attnkit.serve.engine`: the engine thread, events, cancellation and metrics;
- :mod:`attnkit.serve.events`: what the engine hands back (each request's events) and the errors it raises;
- :mod:`attnkit.serve.graph`: the engine's decode step compiled in the background, kept on disk;
- :mod:`attnkit.serve.driver`: one request's events read in the caller's thread (``attnkit chat``'s loop);
- :mod:`attnkit.serve.chat_cli`: ``attnkit chat``, a terminal conversation over the engine;
- :mod:`attnkit.serve.embeddings`: ``/v1/embeddings`` requests checked and run on MiniLM;
- :mod:`attnkit.serve.checks`: an OpenAI request's fields checked one by one, and OpenAI's error shape;
- :mod:`attnkit.serve.tools`: tool calls: whether a template offers tools, the call syntax, its grammar;
- :mod:`attnkit.serve.grammar`: JSON Schemas (and tool calls) as llguidance constraints on the logits;
- :mod:`attnkit.serve.parsing`: a checked request turned into what the engine runs (``Server``);
- :mod:`attnkit.serve.answers`: results and streams shaped as OpenAI's answers;
- :mod:`attnkit.serve.api`: the HTTP routes (extra ``serve``: FastAPI and uvicorn) and the chat page.

A request's options are :class:`attnkit.models.generation_options.GenerationOptions`, the type ``generate()`` takes.
"""

from .blocks import BlockManager
from .engine import Engine
from .events import EngineError, Event, QueueFullError
from .paged import PagedBatch, PagedKVPool
from .scheduler import Request

__all__ = ["BlockManager", "Engine", "EngineError", "Event", "PagedBatch", "PagedKVPool", "QueueFullError",
           "Request"]
