"""What the engine hands back: each request's :class:`Event` (text, tokens, finish reason, and the
:class:`Choice` of each token when logprobs are asked for), the errors it raises, and the recent token rate
its metrics report (:class:`RecentRate`).

Plain data, no behaviour beyond the rate's arithmetic: the scheduler, runner and engine make them; the driver,
the HTTP server and the chat read them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    """A request's next token, with its log-probability and the ``top`` most likely tokens' when asked for."""

    token: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


class EngineError(RuntimeError):
    """The engine cannot take a request (full queue, dead engine)."""


class QueueFullError(EngineError):
    """Too many requests wait already: retry later."""


@dataclass
class Event:
    """What a request produced in one step: new text, the tokens sampled (a stop id included), and with
    ``logprobs`` asked for, the :class:`Choice` of each token of the text."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    logprobs: list[Choice] = field(default_factory=list)


class ConstraintError(ValueError):
    """A request's constraint (its grammar) could not take the token sampled under it."""


class RecentRate(deque[tuple[float, int]]):
    """(time.monotonic(), tokens) of the recent steps (the last ``maxlen``), appended by the engine after each step
    (a plain deque append: the step calls nothing here), and their rate over the last ``seconds``."""

    def __init__(self, steps: Iterable[tuple[float, int]] = (), maxlen: int | None = 64, *,
                 seconds: float = 10.0) -> None:
        super().__init__(steps, maxlen)
        self.seconds = seconds

    def per_second(self) -> float:
        """The tokens of the recent steps after the first, over the time since it; 0.0 with fewer than two. Safe
        beside the thread that appends: the steps are copied in one call first."""
        now = time.monotonic()
        recent = [(t, n) for t, n in tuple(self) if now - t < self.seconds]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        return sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
