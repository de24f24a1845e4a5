"""The engine driven from the caller's thread, one request at a time: ``attnkit chat``'s loop.

The server runs the engine in a thread of its own (:meth:`Engine.start`) for many clients. A terminal
conversation has one request at a time and nothing else to do while it is answered, so it steps the engine
itself: :func:`run_request` submits a prompt and yields its :class:`Event` s as the steps produce them. The
steps are the server's (the same scheduler, runner and compiled graph): a later prompt that starts with an
earlier one's tokens finds them in the prefix cache and prefills only the rest, and with ``compile=True`` the
eager step answers until the graph compiled in the background is ready.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence

from attnkit.models.generation_options import GenerationOptions

from .engine import Engine
from .scheduler import Event, Request


class Answering:
    """One request run to its end by :func:`run_request`: iterate for its events; ``request`` is the engine's
    (its ``cached_tokens``: prompt tokens the prefix cache held)."""

    def __init__(self, engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> None:
        if engine.running:
            raise RuntimeError("the engine runs in its own thread (Engine.start): submit() to it instead of "
                               "driving it from this one")
        self.engine = engine
        self.events: deque[Event] = deque()
        self.request: Request = engine.submit(prompt, options, self.events.append)

    def __iter__(self) -> Generator[Event, None, None]:
        try:
            while True:
                if not self.events:
                    self.engine.step()
                while self.events:
                    event = self.events.popleft()
                    yield event
                    if event.finish_reason is not None:
                        return
        finally:  # closed early, or an exception (Ctrl-C) inside a step: the request ends, its blocks go back
            if not self.request.finished:
                self.engine.cancel(self.request)
                self.engine.step()


def run_request(engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> Answering:
    """Submit ``prompt`` to ``engine`` (not started) and step it in this thread: iterate the result for the
    request's events until the last (its ``finish_reason`` set). Leaving the loop early cancels the request."""
    return Answering(engine, prompt, options)
