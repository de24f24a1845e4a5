"""Continuous batching: requests wait, run and finish; every step is one batched pass over what runs.

The engine ties three parts together, each in its own file: the :class:`~attnkit.serve.scheduler.Scheduler`
(which requests run this step: admission, preemption, prefix reuse, the prefill budget), the
:class:`~attnkit.serve.runner.Runner` (the step's rows through the model over the paged pool, each request's next
token) and, with ``compile=True``, the :class:`~attnkit.serve.graph.CompiledDecode` (the all-decode step compiled
in the background, run once ready). This module holds the thread, the events (:mod:`.events`), cancellation and
metrics. Each :meth:`Engine.step` drops cancelled requests, asks the scheduler for the step's rows, runs them in one
forward per length (:func:`~attnkit.serve.runner.batches`) and ends a request on a stop id, a stop string
(:class:`~attnkit.models.text.TextStream`, as ``stream()``), ``max_new_tokens``, the context, or a complete
constraint (:mod:`attnkit.serve.grammar`).

Options are :class:`GenerationOptions`, as ``generate()`` takes them (the same defaults, greedy, and checks).
Tokens equal ``generate`` alone up to rounding with float32 / float16 weights; with int8 / int4 weights a batch
moves the logits by tenths and a sampled request generally differs from the same request alone. All runs on the
model's device; tokens come back to the host once per step. The engine runs in a thread of its own
(:meth:`Engine.start`; other threads only :meth:`submit` and :meth:`cancel`), or one thread submits and steps it
(:mod:`attnkit.serve.driver`, ``attnkit chat``); each request's events go to its ``on_event``, in that thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from math import inf
from typing import Any

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.sampling import row_seeds
from attnkit.models.text import TextStream

from .blocks import BlockManager
from .compile_cache import CompileCache
from .door import check_request, check_window
from .events import Choice, ConstraintError, EngineError, Event, QueueFullError, RecentRate
from .grammar import Constraint
from .graph import compile_in_background
from .paged import PagedKVPool
from .runner import Runner, batches
from .scheduler import Request, Row, Scheduler


class Engine:
    """Serve a decoder model to many requests at once over a paged KV cache.

    Args:
        model: an attnkit decoder (``LlamaModel``): ``step(ids, positions, caches)``, ``config``, ``vocab_size``,
            ``context_length``, ``stop_token_ids``.
        decode: token ids -> text (the tokenizer's decode).
        kv_memory_mib: memory for keys and values of every layer.
        block_size: positions per KV block.
        max_batch: most requests running at once.
        token_budget: most prompt tokens prefilled per step.
        max_waiting: most requests waiting; more are refused (:class:`QueueFullError`).
        kv_dtype: what the pool stores: None (the model's dtype), bfloat16 / float16 under a float32 model, or
            int8 (codes and bfloat16 scales, as ``generate(kv_dtype="int8")``) under a float32 or bfloat16 one.
        compile: compile the all-decode step (:mod:`attnkit.serve.graph`) in a background thread; the eager step
            serves until it is ready (:meth:`compile_status`, :meth:`wait_compiled`), and on if it fails.
        compile_cache: where the compiled step is kept (default :meth:`CompileCache.for_model`).
        device: the model's device (None, the default); another is refused.
        cache: "full" (default: every position, up to the model's context) or "sink:SINKS,WINDOW[,CHUNK]": each
            request keeps generate's sink window, of any length (:mod:`.scheduler`).
    """

    def __init__(self, model: Any, decode: Callable[[list[int]], str], *, kv_memory_mib: float = 256,
                 block_size: int = 16, max_batch: int = 16, token_budget: int = 512, max_waiting: int = 256,
                 kv_dtype: torch.dtype | str | None = None, compile: bool = False,
                 compile_cache: CompileCache | None = None, device: torch.device | str | None = None,
                 cache: str = "full") -> None:
        self.model, self.decode, self.max_waiting = model, decode, max_waiting
        self.pool = PagedKVPool.for_model(model, kv_memory_mib=kv_memory_mib, block_size=block_size,
                                          kv_dtype=kv_dtype, device=device)
        windows = check_window(model, cache, self.pool.dtype, self.pool.num_blocks * block_size)
        self.window = windows[0] if windows else None  # what the scheduler evicts by (each layer's rope aside)
        self.context = model.context_length if self.window is None else inf  # where an answer must end
        self.blocks = BlockManager(self.pool.num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_batch=max_batch, token_budget=token_budget, window=self.window)
        self.graph = compile_in_background(model, self.pool.dtype, compile_cache) if compile else None
        self.runner = Runner(model, self.pool, self.graph, windows)
        self._inbox: deque[Request] = deque()  # submitted, not yet seen by the engine thread
        self._ids, self._lock, self._stop = itertools.count(), threading.Condition(), False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.stats = {"requests_total": 0, "generated_tokens_total": 0}
        self._rate = RecentRate()

    @property
    def capacity(self) -> int:
        """The most positions (prompt + answer) one request can hold in the KV memory."""
        return self.blocks.num_blocks * self.blocks.block_size

    @property
    def idle(self) -> bool:
        """Nothing waits and nothing runs."""
        return not (self._inbox or self.scheduler.waiting or self.scheduler.running)

    # -- the other threads' side -------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], options: GenerationOptions, on_event: Callable[[Event], None],
               constraint: Constraint | None = None) -> Request:
        """Queue a request; raises ValueError if it can never fit, QueueFullError, or EngineError if the engine died.

        ``options``: the request's sampling options and limits (``compile``, ``cache`` and ``kv_dtype`` are the
        engine's, not a request's). ``constraint``: the tokens its answer may take, fresh (at the answer's start)
        and this request's alone; the request stops ("stop") when it is done.
        """
        prompt = list(prompt)
        stop_ids = check_request(self.model, prompt, options, self.capacity, self.window)
        with self._lock:
            if self.error is not None:
                raise EngineError(f"the engine stopped after an error: {self.error!r}")
            if len(self._inbox) + len(self.scheduler.waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self._inbox) + len(self.scheduler.waiting)} requests are waiting already")
            seed = int(row_seeds(options.seed, 1)[0])
            request = Request(next(self._ids), prompt, options, on_event, seed, stop_ids,
                              TextStream(self.decode, options.stop, prompt[-1:]), tokens=list(prompt),
                              constraint=constraint)
            self._inbox.append(request)
            self.stats["requests_total"] += 1
            self._lock.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request (a client went away); its blocks are freed at the next step."""
        with self._lock:
            request.cancelled = True
            self._lock.notify()

    def start(self) -> None:
        """Run steps in a daemon thread until :meth:`shutdown`."""
        self._thread = threading.Thread(target=self._loop, name="attnkit-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def compile_status(self) -> dict[str, Any]:
        """{"state": "off"} without ``compile``, else :meth:`attnkit.serve.graph.CompiledDecode.status`."""
        return {"state": "off"} if self.graph is None else self.graph.status()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile ends (or ``timeout`` seconds); True if decode steps now run compiled."""
        return self.graph is not None and self.graph.wait(timeout)

    @property
    def running(self) -> bool:
        """Whether the engine's own thread runs its steps (:meth:`start`)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    def _loop(self) -> None:
        while self._work_waits() and self.step_or_die():
            pass

    def _work_waits(self) -> bool:
        """Wait until a request waits or runs (True) or :meth:`shutdown` (False)."""
        with self._lock:
            self._lock.wait_for(lambda: self._stop or not self.idle)
            return not self._stop

    def step_or_die(self) -> bool:
        """:meth:`step`; on an exception the engine is dead (:attr:`error`), every request ends with an "error"
        event (none hangs) and False comes back."""
        try:
            self.step()
        except BaseException as err:
            self._die(err)
            return False
        return True

    def _die(self, err: BaseException) -> None:
        with self._lock:
            self.error = err
            everyone = [*self.scheduler.running, *self.scheduler.waiting, *self._inbox]
            self.scheduler.running, self.scheduler.waiting, self._inbox = [], deque(), deque()
        for request in everyone:
            self._emit(request, Event("", [], "error", error=f"engine error: {err!r}"))

    # -- one step ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Drop the cancelled, schedule, run the rows (:meth:`_run`), each finished request's next token."""
        with self._lock:
            self.scheduler.waiting.extend(self._inbox)
            self._inbox.clear()
        for request in [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.cancelled]:
            self._finish(request, "cancelled")
        plan = self.scheduler.schedule()
        for shift in plan.shifts:
            self.runner.evict(shift)
        produced = sum(self._run(rows) for rows in batches(plan.decoding + plan.prefill))
        self._rate.append((time.monotonic(), produced))

    def _run(self, rows: list[Row]) -> int:
        """One forward over ``rows`` and the next token of each request whose known tokens are then all in the
        pool (:meth:`Runner.run`)."""
        chosen = self.runner.run(rows)
        self.scheduler.written(rows)
        for request, choice in chosen:
            self._accept(request, choice)
        return len(chosen)

    def _accept(self, request: Request, choice: Choice) -> None:
        self.stats["generated_tokens_total"] += 1
        try:
            piece, reason = request.take(choice.token, self.context)
        except ConstraintError as err:  # a grammar that broke down ends its request alone
            self._finish(request, "error", [choice.token], error=f"constrained decoding failed: {err}")
            return
        if piece is None:  # a stop id: a token of the answer (usage counts it), not text
            self._finish(request, "stop", [choice.token])
            return
        self._emit(request, Event(piece, [choice.token], logprobs=[choice] if choice.logprob is not None else []))
        if reason is not None:
            self._finish(request, reason)

    def _finish(self, request: Request, reason: str, tokens: list[int] | None = None, error: str | None = None
                ) -> None:
        if request.finished:
            return
        request.finished = True
        self.scheduler.drop(request)
        self._emit(request, Event(request.text.flush(), tokens or [], reason, error=error))

    @staticmethod
    def _emit(request: Request, event: Event) -> None:
        try:
            request.on_event(event)
        except Exception:  # a client's callback never takes the engine down
            request.cancelled = True

    def metrics(self) -> dict[str, float]:
        """Counters and gauges, Prometheus-style names without the prefix."""
        with self._lock:
            gauges = self.scheduler.gauges()
            gauges["requests_waiting"] += len(self._inbox)
            return {**gauges, "tokens_per_second": self._rate.per_second(), **self.stats}
