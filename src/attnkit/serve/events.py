"""What the engine hands back: each request's :class:`Event` (text, tokens, finish reason, and the
:class:`Choice` of each token when logprobs are asked for), and the errors it raises.

Plain data, no behaviour: the scheduler, runner and engine make them; the driver, the HTTP server and the
chat read them.
"""

from __future__ import annotations

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
