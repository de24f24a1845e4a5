"""Which requests run in a step: admission, preemption, prefix reuse and the prefill budget.

A :class:`Request` waits, runs (holding KV blocks) and finishes. Each step
the :class:`Scheduler`

1. admits waiting requests while there is room (``max_batch`` running, KV
   blocks for the prompt), reusing cached prefixes
   (:class:`attnkit.serve.blocks.BlockManager`);
2. finds each decoding request a slot for its next token; when the pool is
   full, the newest running request is preempted (its blocks freed, its
   tokens recomputed when it runs again);
3. hands the runner its rows: each decoding request's last token, and
   prompt chunks of prefilling requests within ``token_budget`` tokens.

No tensors and no threads here: the engine calls it from its one thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnkit.models.generation_options import GenerationOptions, check_budget, check_fit
from attnkit.models.text import TextStream

from .blocks import BlockManager

if TYPE_CHECKING:
    from .grammar import Constraint


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
    ``logprobs`` asked for, the :class:`~attnkit.serve.runner.Choice` of each token of the text."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None
    logprobs: list[Choice] = field(default_factory=list)



class ConstraintError(ValueError):
    """A request's constraint (its grammar) could not take the token sampled under it."""


@dataclass(eq=False)
class Request:
    """One request inside the engine: its prompt, options and where its tokens are; ``constraint``: which tokens
    its answer may take (:mod:`attnkit.serve.grammar`), or None."""

    id: int
    prompt: list[int]
    options: GenerationOptions
    on_event: Callable[[Any], None]
    seed: int
    stop_ids: tuple[int, ...]
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the pool
    cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    constraint: Constraint | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.tokens) - 1

    def take(self, token: int, context_length: int) -> tuple[str | None, str | None]:
        """Append a sampled ``token``: the text it shows (None for a stop id: "stop" at once) and the reason the
        request ends after it, if it does ("stop": a stop string or a complete constraint, "length": its
        ``max_new_tokens`` or the model's context). Raises :class:`ConstraintError` if the constraint cannot take it."""
        self.tokens.append(token)
        self.generated += 1
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        if self.constraint is not None:
            try:
                self.constraint.advance(token)
            except ValueError as err:
                raise ConstraintError(str(err)) from err
        if token in self.stop_ids:
            return None, "stop"
        piece = self.text.add(token)
        if self.text.stopped or (self.constraint is not None and self.constraint.done):
            return piece, "stop"  # nothing after the stop string is shown; nothing may follow the grammar
        if self.generated >= self.options.max_new_tokens or len(self.tokens) >= context_length:
            return piece, "length"
        return piece, None


@dataclass(frozen=True)
class Row:
    """One row of a step's forward: ``length`` tokens of ``request`` from position ``request.computed``."""

    request: Request
    length: int


class Scheduler:
    """Admission, preemption and the prefill budget over one :class:`BlockManager`.

    Args:
        blocks: the KV blocks the running requests hold.
        max_batch: most requests running at once.
        token_budget: most prompt tokens prefilled per step.
    """

    def __init__(self, blocks: BlockManager, *, max_batch: int, token_budget: int) -> None:
        self.blocks, self.max_batch, self.token_budget = blocks, max_batch, token_budget
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = self.prompt_tokens = 0

    def schedule(self) -> tuple[list[Row], list[Row]]:
        """Admit what fits, then (decoding rows, prefill rows) for this step."""
        self._admit()
        decoding = [Row(r, 1) for r in self._make_room([r for r in self.running if not r.prefilling])]
        prefill, budget = [], self.token_budget
        for request in self.running:
            if request.prefilling and budget > 0:
                chunk = min(len(request.tokens) - request.computed, budget)
                prefill.append(Row(request, chunk))
                budget -= chunk
        return decoding, prefill

    def gauges(self) -> dict[str, float]:
        """What /metrics reports of the queue and the KV blocks (Prometheus-style names without the prefix)."""
        blocks = self.blocks
        return {"requests_running": len(self.running), "requests_waiting": len(self.waiting),
                "kv_blocks": blocks.num_blocks, "kv_blocks_free": blocks.free_blocks,
                "kv_blocks_used": blocks.num_blocks - blocks.free_blocks,
                "prefix_cache_hit_tokens_total": blocks.hit_tokens, "prompt_tokens_total": self.prompt_tokens,
                "preemptions_total": self.preemptions}

    def written(self, rows: list[Row]) -> None:
        """The rows' tokens are in the pool: their full blocks become reusable prefixes."""
        for row in rows:
            request = row.request
            request.computed += row.length
            self.blocks.written(request.blocks, request.computed, request.tokens)

    def drop(self, request: Request) -> None:
        """Take a request out (finished or cancelled), freeing its blocks."""
        if request in self.running:
            self.running.remove(request)
            self.blocks.release(request.blocks)
            request.blocks = []
        elif request in self.waiting:
            self.waiting.remove(request)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            allocation = self.blocks.allocate(request.tokens, reserve=1)
            if allocation is None:
                break
            self.waiting.popleft()
            request.blocks, request.computed = allocation.blocks, allocation.cached_tokens
            if request.generated == 0:  # not a preempted request coming back
                request.cached_tokens = allocation.cached_tokens
            self.running.append(request)
            self.prompt_tokens += len(request.tokens) - allocation.cached_tokens

    def _make_room(self, decoding: list[Request]) -> list[Request]:
        """A slot for each decoding request's next token; preempt the newest running ones while none is free."""
        ready = []
        for request in sorted(decoding, key=lambda r: r.arrival):
            while request in self.running and not self.blocks.grow(request.blocks, len(request.tokens)):
                self._preempt(max(self.running, key=lambda r: r.arrival))  # the newest (maybe this one)
            if request in self.running:
                ready.append(request)
        return [r for r in ready if r in self.running]

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it first again (it recomputes its tokens later)."""
        self.blocks.release(request.blocks)
        request.blocks, request.computed = [], 0
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.preemptions += 1


def check_request(model: Any, prompt: list[int], options: GenerationOptions, capacity: int) -> tuple[int, ...]:
    """What the engine checks of a request at the door (ValueError naming the problem); its stop ids."""
    if not prompt:
        raise ValueError("the prompt is empty")
    if options.compile or options.sink is not None or options.kv_dtype is not None:
        raise ValueError("compile, cache and kv_dtype are the engine's settings (Engine(kv_dtype=...)), not a "
                         f"request's: got compile={options.compile}, cache={options.cache!r}, "
                         f"kv_dtype={options.kv_dtype}")
    if min(prompt) < 0 or max(prompt) >= model.vocab_size:
        raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {model.vocab_size})")
    stop_ids = check_budget(model, len(prompt), options)
    check_fit(len(prompt), options.max_new_tokens, capacity, "the server's KV memory")
    return stop_ids
