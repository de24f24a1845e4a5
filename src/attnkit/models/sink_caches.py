"""Constant-memory generation: one ``KVCache(eviction=SinkWindow(...))`` per attention layer of a decoder.

``generate(..., cache="sink:4,1020")`` (or ``attnkit generate --cache sink:4,1020``)
names the caches with a :class:`SinkSpec`; :func:`sink_caches` builds them, each
with a :class:`attnkit.SinkWindow` of its own layer's rotary embedding (so Gemma 3's two kinds work too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from attnkit.modules.cache_protocol import Cache
from attnkit.modules.kv_cache import KVCache
from attnkit.modules.sink_window import SinkWindow


@dataclass(frozen=True)
class SinkSpec:
    """``cache="sink:SINKS,WINDOW[,CHUNK]"``: one KVCache per attention layer, evicting by a :class:`SinkWindow`
    (see its arguments)."""

    sinks: int
    window: int
    chunk: int = 64

    def __post_init__(self) -> None:
        SinkWindow(sinks=self.sinks, window=self.window, chunk=self.chunk, rope=None)  # raises naming a bad count

    @classmethod
    def parse(cls, cache: object) -> SinkSpec | None:
        """None for "full" (the model's own caches); a SinkSpec for "sink:4,1020" or "sink:4,1020,64"."""
        if isinstance(cache, SinkSpec) or cache == "full":
            return cache if isinstance(cache, SinkSpec) else None
        text = cache if isinstance(cache, str) else ""
        kind, _, numbers = text.partition(":")
        parts = [p.strip() for p in numbers.split(",")]
        if kind.strip() != "sink" or len(parts) not in (2, 3) or not all(p.isascii() and p.isdigit() for p in parts):
            raise ValueError(f'cache must be "full" (the default: a cache that grows) or "sink:SINKS,WINDOW" or '
                             f'"sink:SINKS,WINDOW,CHUNK" (attention sinks and a recent window, e.g. "sink:4,1020"), '
                             f"got cache={cache!r}")
        return cls(*(int(p) for p in parts))

    @property
    def capacity(self) -> int:
        """The most positions a cache holds (:attr:`SinkWindow.capacity`)."""
        return SinkWindow(sinks=self.sinks, window=self.window, chunk=self.chunk, rope=None).capacity

    def caches(self, model: object) -> list[Cache]:
        """One KVCache per attention layer of ``model`` (its blocks' ``attention``), evicting with that layer's
        rope."""
        return sink_caches(model, sinks=self.sinks, window=self.window, chunk=self.chunk)

    def windows(self, model: object) -> list[SinkWindow]:
        """One :class:`SinkWindow` per attention layer of ``model``, each with that layer's rope (what the serving
        engine's paged pool evicts by)."""
        return [SinkWindow(sinks=self.sinks, window=self.window, chunk=self.chunk, rope=attention.rope)
                for attention in _attentions(model)]

    def pieces(self, length: int) -> list[int]:
        """The sizes a prompt of ``length`` tokens is fed in: as much as fits the bound, then a chunk at a time."""
        window = SinkWindow(sinks=self.sinks, window=self.window, chunk=self.chunk, rope=None)
        sizes = [min(length, self.capacity)]
        while sum(sizes) < length:
            sizes.append(window.piece(length, sum(sizes)))
        return sizes

    def check_fits(self, context_length: int, cache: object) -> None:
        """Raise a ValueError naming ``cache`` (as the user gave it) if the window holds more positions than the
        model's ``context_length``."""
        if self.capacity > context_length:
            raise ValueError(f"cache={cache!r} holds up to {self.capacity} positions (sinks + window + chunk - 1), "
                             f"beyond the model's context length {context_length}: choose a smaller window")


def sink_caches(model: object, *, sinks: int = 4, window: int = 1020, chunk: int = 64) -> list[Cache]:
    """One ``KVCache(eviction=SinkWindow(...))`` per attention layer of a decoder, each window with its own layer's
    rotary embedding.

    The layers are ``model.layers[i].attention`` (:class:`attnkit.models.decoder.DecoderModel`'s blocks).
    """
    return [KVCache(eviction=SinkWindow(sinks=sinks, window=window, chunk=chunk, rope=attention.rope))
            for attention in _attentions(model)]


def _attentions(model: object) -> list[Any]:
    """The attention layer of each block of a decoder (``model.layers[i].attention``); TypeError without them."""
    attentions: list[Any] = [getattr(block, "attention", None) for block in getattr(model, "layers", None) or []]
    if not attentions or not all(hasattr(attention, "rope") for attention in attentions):
        raise TypeError(f"sink caches need a decoder whose blocks hold their attention layer as `attention` "
                        f"(model.layers[i].attention, as attnkit's decoders do); {type(model).__name__} has none")
    return attentions
