"""One request run to its end by stepping the engine in the caller's thread: ``attnkit chat``'s loop.

The server runs the engine in a thread of its own (:meth:`Engine.start`) for many clients. A terminal
conversation has one request at a time and waits for it, so it steps the engine itself: :func:`run_request`
submits a prompt and yields its :class:`Event` s as the steps produce them (the engine in its own thread
measured slower, by about this VM's noise: BENCHMARKS.md, rounds eighteen and nineteen). The steps are the
server's (the same scheduler, runner and compiled graph): a later prompt that starts with an earlier one's
tokens finds them in the prefix cache and prefills only the rest.

Ctrl-C (SIGINT, delivered to the main thread) is held back while a step runs and raised between two steps, so
it never leaves the engine's bookkeeping half done; leaving the iteration early (``close()``) cancels the
request and steps until the engine dropped it, its blocks free.
"""

from __future__ import annotations

import signal
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from attnkit.models.generation_options import GenerationOptions

from .engine import Engine
from .events import Event
from .scheduler import Request

STUCK = 1000  # steps in a row that move the request no further before it ends with an error, not a hang


@contextmanager
def sigint_held(replay: bool = True) -> Iterator[None]:
    """Hold Ctrl-C back for the block, then replay it (``replay``) to the handler that was there, or drop it. Only
    in the main thread (elsewhere there is no SIGINT to hold) and where Python handles SIGINT (an ignored one stays
    ignored)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield
        return
    pressed: list[int] = []
    signal.signal(signal.SIGINT, lambda number, frame: pressed.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed and replay:
        signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt under Python's default handler


class Answering(Iterator[Event]):
    """The events of one request, stepped here; the last has its ``finish_reason``. ``close()`` (also on
    leaving a ``with closing(...)`` block early) cancels the request and steps until the engine ended it.
    ``request``: the engine's (its ``cached_tokens``: prompt tokens the prefix cache held)."""

    def __init__(self, engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> None:
        if engine.running:
            raise RuntimeError("run_request steps the engine in this thread; this one runs its own "
                               "(Engine.start): submit() to it instead")
        self.engine, self.finished = engine, False
        self.events: deque[Event] = deque()
        self.request: Request = engine.submit(prompt, options, self.events.append)

    def __next__(self) -> Event:
        if self.finished:
            raise StopIteration
        stuck = 0
        while not self.events:
            where = (self.request.computed, self.request.generated)
            self._step()
            stuck = stuck + 1 if (self.request.computed, self.request.generated) == where else 0
            if stuck >= STUCK and not self.events:
                self.close()  # cancelled: the engine holds nothing of it
                return Event("", [], "error", error=f"the engine did not move the request in {STUCK} steps")
        event = self.events.popleft()
        self.finished = event.finish_reason is not None
        return event

    def _step(self) -> None:
        with sigint_held():
            self.engine.step_or_die()  # a dead engine ends the request with an "error" event

    def close(self) -> None:
        """Cancel the request unless it ended, and step until the engine dropped it (its blocks are then free); a
        Ctrl-C meanwhile is dropped (the request is being stopped already)."""
        with sigint_held(replay=False):
            if not self.request.finished:
                self.engine.cancel(self.request)
            for _ in range(STUCK):
                if self.request.finished or not self.engine.alive:
                    break
                self.engine.step_or_die()
        self.finished = True


def run_request(engine: Engine, prompt: Sequence[int], options: GenerationOptions) -> Answering:
    """Submit ``prompt`` to ``engine`` (not started: this thread steps it) and iterate its events, the last with
    its ``finish_reason`` set. ``close()`` the result when leaving early (``contextlib.closing``): the request is
    cancelled. Refused requests raise as :meth:`Engine.submit` does."""
    return Answering(engine, prompt, options)
