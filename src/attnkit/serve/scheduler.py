"""Which requests run in a step: admission, preemption, prefix reuse and the prefill budget.

A :class:`Request` waits, runs (holding KV blocks) and finishes. Each step the :class:`Scheduler`

1. admits waiting requests while there is room (``max_batch`` running, KV blocks for the prompt), reusing
   cached prefixes (:class:`attnkit.serve.blocks.BlockManager`);
2. finds each decoding request a slot for its next token; when the pool is full, the newest running request
   is preempted (its blocks freed, its tokens recomputed when it runs again);
3. hands the runner its rows: each decoding request's last token, and prompt chunks of prefilling requests
   within ``token_budget`` tokens.

With a sink window (``Engine(cache="sink:4,1020")``) a request keeps its first tokens and a recent window as
``generate(cache=...)`` does: fed in ``generate``'s pieces, a row that would pass the window first evicts the
oldest window positions (a :class:`Shift`, which the runner carries out). Until then it shares cached prefixes
as any other; at its first eviction the blocks it shares are copied, and the others leave the prefix cache
(evictions rewrite blocks in place). No tensors and no threads here: the engine calls it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.text import TextStream

from .blocks import BlockManager
from .events import ConstraintError

if TYPE_CHECKING:
    from attnkit.modules.sink_window import SinkWindow

    from .grammar import Constraint


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
    computed: int = 0  # tokens whose keys and values went into the pool
    evicted: int = 0  # of those, window positions a sink window dropped (see :class:`Shift`)
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

    @property
    def held(self) -> int:
        """Positions the request holds in the pool: its next token's position."""
        return self.computed - self.evicted

    def take(self, token: int, context_length: float) -> tuple[str | None, str | None]:
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
    """One row of a step's forward: ``length`` tokens of ``request`` from token ``request.computed``, at
    positions from ``request.held``."""

    request: Request
    length: int


@dataclass(frozen=True)
class Shift:
    """A sink window's eviction, for the runner to carry out before the step's forwards: first each (original,
    copy) block of ``copies`` is copied, then ``request``'s window positions ``sinks + by .. held - 1`` move to
    ``sinks .. held - by - 1`` (keys re-rotated by ``-by``)."""

    request: Request
    held: int  # positions held before the eviction
    by: int
    copies: tuple[tuple[int, int], ...] = ()  # at a request's first eviction: the blocks it made its own


@dataclass(frozen=True)
class Plan:
    """One step: its decoding rows, its prefill rows, and the evictions to carry out before them."""

    decoding: list[Row]
    prefill: list[Row]
    shifts: list[Shift] = field(default_factory=list)


class Scheduler:
    """Admission, preemption and the prefill budget over one :class:`BlockManager`.

    Args:
        blocks: the KV blocks the running requests hold.
        max_batch: most requests running at once.
        token_budget: most prompt tokens prefilled per step.
        window: None (every position kept), or a sink window every request keeps.
    """

    def __init__(self, blocks: BlockManager, *, max_batch: int, token_budget: int,
                 window: SinkWindow | None = None) -> None:
        self.blocks, self.max_batch, self.token_budget, self.window = blocks, max_batch, token_budget, window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = self.prompt_tokens = 0

    def schedule(self) -> Plan:
        """Admit what fits, then this step's decoding rows, prefill rows and evictions."""
        self._admit()
        shifts = []
        for request in list(self.running):  # a copy: an eviction may preempt (when its copies need blocks)
            if not request.prefilling and request in self.running:
                shifts.append(self._evict(request, 1))
        decoding = [Row(r, 1) for r in self._make_room([r for r in self.running if not r.prefilling])]
        prefill, budget = [], self.token_budget
        for request in list(self.running):
            chunk = min(self._piece(request), budget) if request.prefilling else 0
            if chunk > 0 and request in self.running:
                shifts.append(self._evict(request, chunk))
                if request in self.running:
                    prefill.append(Row(request, chunk))
                    budget -= chunk
        running = set(self.running)  # an eviction's copies may have preempted a request given a row already
        return Plan([row for row in decoding if row.request in running],
                    [row for row in prefill if row.request in running],
                    [s for s in shifts if s is not None and s.request in running])

    def _piece(self, request: Request) -> int:
        """The most tokens of a prefilling request the next row may take: the rest of its tokens, or with a sink
        window the rest of the piece ``generate`` would feed (a piece cut by the budget evicts as the whole piece:
        all at its first row)."""
        if self.window is None:
            return len(request.tokens) - request.computed
        return self.window.piece(len(request.tokens), request.computed)

    def _evict(self, request: Request, length: int) -> Shift | None:
        """With a sink window, the eviction a row of ``length`` tokens needs first (as ``KVCache`` evicts); at the
        request's first, the blocks it shares are copied first (preempting the newest while the pool lacks blocks
        for the copies: maybe the request itself, then None)."""
        by = 0 if self.window is None else self.window.evicted_before(request.held, length)
        if by == 0:
            return None
        copies: list[tuple[int, int]] | None = []
        while request.evicted == 0 and request in self.running:
            copies = self.blocks.private(request.blocks)
            if copies is not None:
                break
            self._preempt(max(self.running, key=lambda r: r.arrival))
        if request not in self.running:
            return None
        shift = Shift(request, request.held, by, tuple(copies or ()))
        request.evicted += by
        return shift

    def gauges(self) -> dict[str, float]:
        """What /metrics reports of the queue and the KV blocks (Prometheus-style names without the prefix)."""
        blocks = self.blocks
        return {"requests_running": len(self.running), "requests_waiting": len(self.waiting),
                "kv_blocks": blocks.num_blocks, "kv_blocks_free": blocks.free_blocks,
                "kv_blocks_used": blocks.num_blocks - blocks.free_blocks,
                "prefix_cache_hit_tokens_total": blocks.hit_tokens, "prompt_tokens_total": self.prompt_tokens,
                "preemptions_total": self.preemptions}

    def written(self, rows: list[Row]) -> None:
        """The rows' tokens are in the pool: their full blocks become reusable prefixes (not once evicted)."""
        for row in rows:
            request = row.request
            request.computed += row.length
            if request.evicted == 0:
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
            # a sink window holds at most its capacity: blocks for that many positions at most, then reused
            held = request.tokens if self.window is None else request.tokens[: self.window.capacity - 1]
            allocation = self.blocks.allocate(held, reserve=1)
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
            while request in self.running and not self.blocks.grow(request.blocks, request.held + 1):
                self._preempt(max(self.running, key=lambda r: r.arrival))  # the newest (maybe this one)
            if request in self.running:
                ready.append(request)
        return [r for r in ready if r in self.running]

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it first again (it recomputes its tokens later)."""
        self.blocks.release(request.blocks)
        request.blocks, request.computed, request.evicted = [], 0, 0
        self.running.remove(request)
        self.waiting.appendleft(request)
        self.preemptions += 1
