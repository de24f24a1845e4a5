"""One request's events, read in the caller's thread from an engine running in its own: ``attnkit chat``'s loop.

The server hands each request's events to its HTTP stream; a terminal conversation has one request at a time
and waits for it: :func:`run_request` submits a prompt to a started :class:`Engine` and iterates the events
as the engine's thread produces them. The steps are the server's (the same scheduler, runner and compiled
graph): a later prompt that starts with an earlier one's tokens finds them in the prefix cache and prefills
only the rest. The engine's state is only touched by its own thread, so a KeyboardInterrupt in the caller
(Ctrl-C, which Python raises in the main thread) cannot leave a step half done: it cancels the request, whose
blocks the engine frees at its next step.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

from attnkit.models.generation_options import GenerationOptions

from .engine import Engine
from .scheduler import Event, Request

WAIT = 0.1  # seconds between checks that the engine is still alive while waiting for an event


class Answering(Iterator[Event]):
    """The events of one request to a running engine, in order, the last with its ``finish_reason``; ``close()``
    (also on leaving a ``with closing(...)`` block early) cancels the request and waits until the engine ended it.
    ``request``: the engine's (its ``cached_tokens``: prompt tokens the prefix cache held)."""

    def __init__(self, engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> None:
        if not engine.running:
            raise RuntimeError("run_request reads the events of an engine that runs in its own thread: call "
                               "engine.start() first")
        self.engine, self.finished = engine, False
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.request: Request = engine.submit(prompt, options, self.events.put)

    def __next__(self) -> Event:
        if self.finished:
            raise StopIteration
        event = self._next_event()
        self.finished = event.finish_reason is not None
        return event

    def _next_event(self) -> Event:
        while True:
            try:
                return self.events.get(timeout=WAIT)
            except queue.Empty:
                if not self.engine.alive:  # its thread died: every request got an "error" event, or it was stopped
                    return Event("", [], "error", error=f"the engine stopped: {self.engine.error!r}")

    def close(self) -> None:
        """Cancel the request unless it ended, and wait for its last event (its blocks are then free)."""
        if self.finished:
            return
        self.engine.cancel(self.request)
        while not self.finished:
            self.finished = self._next_event().finish_reason is not None


def run_request(engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> Answering:
    """Submit ``prompt`` to ``engine`` (started: :meth:`Engine.start`) and iterate its events here, the last with
    its ``finish_reason`` set. ``close()`` the result when leaving early (``contextlib.closing``): the request is
    cancelled. Refused requests raise as :meth:`Engine.submit` does."""
    return Answering(engine, prompt, options)
