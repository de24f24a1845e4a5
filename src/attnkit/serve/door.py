"""What the engine checks at its door: a request (:func:`check_request`) and a sink window (:func:`check_window`).

Everything a step later trusts is checked here, once: a request's prompt and
options when it is submitted, the engine's window when it is built.
"""

from __future__ import annotations

from typing import Any

from attnkit.models.generation_options import GenerationOptions, check_budget, check_fit, check_stops
from attnkit.models.sink_caches import SinkSpec
from attnkit.modules.sink_window import SinkWindow


def check_request(model: Any, prompt: list[int], options: GenerationOptions, capacity: int,
                  window: SinkWindow | None = None) -> tuple[int, ...]:
    """What the engine checks of a request at the door (ValueError naming the problem); its stop ids. With a sink
    ``window`` a request of any length fits (the engine checked that the window fits the model and the pool)."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if options.compile or options.sink is not None or options.kv_dtype is not None:
        raise ValueError("compile, cache and kv_dtype are the engine's settings (Engine(kv_dtype=...)), not a "
                         f"request's: got compile={options.compile}, cache={options.cache!r}, "
                         f"kv_dtype={options.kv_dtype}")
    if min(prompt) < 0 or max(prompt) >= model.vocab_size:
        raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {model.vocab_size})")
    if window is not None:
        return check_stops(model, options)
    stop_ids = check_budget(model, len(prompt), options)
    check_fit(len(prompt), options.max_new_tokens, capacity, "the server's KV memory")
    return stop_ids


def check_window(model: Any, cache: object, pool_dtype: Any, capacity: int) -> list[SinkWindow]:
    """The sink window of each layer for ``Engine(cache=...)`` (none for "full"); a ValueError naming what does not
    fit: the pool's dtype (evictions re-rotate the keys kept, which 16-bit or int8 storage would round again),
    the model's context, or the pool's ``capacity`` positions."""
    spec = SinkSpec.parse(cache)
    if spec is None:
        return []
    dtype = next(model.parameters()).dtype
    if pool_dtype != dtype:
        raise ValueError(f"cache={cache!r} re-rotates the keys it keeps at every eviction, which {pool_dtype} storage "
                         f"would round again each time: serve it with kv_dtype=None (the model's {dtype})")
    spec.check_fits(model.context_length, cache)
    if spec.capacity > capacity:
        raise ValueError(f"cache={cache!r} holds up to {spec.capacity} positions per request, more than the KV "
                         f"memory's {capacity}: give more KV memory or a smaller window")
    return spec.windows(model)
