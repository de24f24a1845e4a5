"""Continuous batching: requests wait, run and finish; every step is one batched pass over what runs.

The engine ties three parts together, each in its own file:

- :class:`attnkit.serve.scheduler.Scheduler`: which requests run this step
  (admission, preemption, prefix reuse, the prefill budget);
- :class:`attnkit.serve.runner.Runner`: the step's rows through the model
  over the paged pool, and each request's next token;
- :class:`attnkit.serve.graph.CompiledDecode` (``compile=True``): the
  all-decode step compiled in the background, run once it is ready;
- this module: the thread, the events each request's callback receives,
  cancellation and metrics.

Each :meth:`Engine.step` drops cancelled requests, asks the scheduler for
the step's rows, runs them in one forward per length (every decoding
request's token in one, prompt chunks of one length from several requests in
one: :func:`attnkit.serve.runner.batches`), samples the requests whose
known tokens are all in the pool, and ends a request on a stop id, a stop
string, ``max_new_tokens`` or the context (:class:`attnkit.models.text.TextStream`,
as ``stream()`` does), or once its constraint (:mod:`attnkit.serve.grammar`: a JSON Schema,
say) is complete. A request's options are :class:`GenerationOptions`,
the type ``generate()`` takes: the same defaults (greedy), the same checks.
Sampled tokens equal ``generate`` alone up to rounding with float32 /
float16 weights; with int8 / int4 weights a batch moves the logits by tenths
and a sampled request generally differs from the same request alone.

The engine runs on its model's device (the CPU, or a GPU once ``model.to("cuda")``):
the pool, each step's ids, positions and slots, and the sampling all live
there; tokens come back to the host once per step.

The engine runs in a thread of its own (:meth:`Engine.start`); other threads
only :meth:`submit` and :meth:`cancel`. Every event of a request goes to its
``on_event`` callback, called from the engine thread.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from attnkit.models.generation_options import GenerationOptions, check_budget, check_fit, kv_storage
from attnkit.models.sampling import row_seeds
from attnkit.models.text import TextStream

from .blocks import BlockManager
from .compile_cache import CompileCache
from .grammar import Constraint
from .graph import compile_in_background
from .paged import PagedKVPool
from .runner import Choice, Runner, batches
from .scheduler import Request, Row, Scheduler


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


def _pool_dtype(model_dtype: torch.dtype, kv_dtype: torch.dtype | str | None) -> torch.dtype:
    """The paged pool's dtype: the model's, or a narrower one under a float32 model."""
    stored = kv_storage(kv_dtype)
    if stored is None:
        return model_dtype
    if stored is torch.int8:
        raise ValueError("kv_dtype=int8 is generate()'s KVCache(dtype=torch.int8); the paged pool stores None "
                         "(the model's dtype), bfloat16 or float16")
    if model_dtype != torch.float32:
        raise ValueError(f"kv_dtype={stored} stores a float32 model's keys in fewer bytes; this model computes in "
                         f"{model_dtype}: use kv_dtype=None")
    return stored


def _engine_device(model: Any, device: torch.device | str | None) -> torch.device:
    """The device the engine runs on: the model's parameters', which ``device``, if given, must name."""
    held, given = next(model.parameters()).device, None if device is None else str(device)
    try:
        asked = held if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"Engine(device={given!r}) is not a device: expected cpu, cuda or cuda:N") from None
    if "meta" in (held.type, asked.type):
        raise ValueError(f"Engine(device={given!r}) with the model's parameters on {held}: the meta device holds "
                         "shapes, no numbers; serve a model on the cpu or a GPU (its weights loaded)")
    if asked.type != held.type or asked.index not in (None, held.index):
        raise ValueError(f"Engine(device={given!r}) and the model's parameters on {held}: move the model first "
                         f"(model.to({given!r})), or leave device=None (the model's)")
    return held


class Engine:
    """Serve a decoder model to many requests at once over a paged KV cache.

    Args:
        model: an attnkit decoder (``LlamaModel``): ``step(ids, positions, caches)``,
            ``config``, ``vocab_size``, ``context_length``, ``stop_token_ids``.
        decode: token ids -> text (the tokenizer's decode).
        kv_memory_mib: memory for keys and values of every layer.
        block_size: positions per KV block.
        max_batch: most requests running at once.
        token_budget: most prompt tokens prefilled per step.
        max_waiting: most requests waiting; more are refused (:class:`QueueFullError`).
        kv_dtype: the dtype the pool stores keys and values in: None (the
            model's), or bfloat16 / float16 under a float32 model: twice the
            blocks in ``kv_memory_mib`` (attention reads the rounded keys).
        compile: compile the all-decode step (:mod:`attnkit.serve.graph`) in
            a background thread from construction on; the eager step serves
            until it is ready (:meth:`compile_status`, :meth:`wait_compiled`),
            and on if it fails. Greedy tokens equal the eager step's with
            float32 weights.
        compile_cache: where the compiled step is kept (default: under
            attnkit's cache folder, :meth:`CompileCache.for_model`).
        device: where the pool lives and every step runs: the model's device
            (None, the default: move the model first, ``model.to("cuda")``);
            another device than the model's is refused.
    """

    def __init__(self, model: Any, decode: Callable[[list[int]], str], *, kv_memory_mib: float = 256,
                 block_size: int = 16, max_batch: int = 16, token_budget: int = 512, max_waiting: int = 256,
                 kv_dtype: torch.dtype | str | None = None, compile: bool = False,
                 compile_cache: CompileCache | None = None, device: torch.device | str | None = None) -> None:
        config = model.config
        device = _engine_device(model, device)
        dtype = _pool_dtype(next(model.parameters()).dtype, kv_dtype)
        per_block = PagedKVPool.bytes_per_block(num_layers=config.num_layers, block_size=block_size,
                                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                                dtype=dtype)
        num_blocks = int(kv_memory_mib * 2**20 // per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_memory_mib={kv_memory_mib} holds {num_blocks} blocks of {block_size} positions "
                             f"({per_block / 2**20:.2f} MiB each); give at least {2 * per_block / 2**20:.2f} MiB")
        self.model, self.decode, self.max_waiting = model, decode, max_waiting
        self.pool = PagedKVPool(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype,
                                device=device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_batch=max_batch, token_budget=token_budget)
        self.graph = compile_in_background(model, dtype, compile_cache) if compile else None
        self.runner = Runner(model, self.pool, self.graph)
        self._inbox: deque[Request] = deque()  # submitted, not yet seen by the engine thread
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.stats = {"requests_total": 0, "generated_tokens_total": 0}
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) of recent steps

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
        if not prompt:
            raise ValueError("the prompt is empty")
        if options.compile or options.sink is not None or options.kv_dtype is not None:
            raise ValueError("compile, cache and kv_dtype are the engine's settings (Engine(kv_dtype=...)), not a "
                             f"request's: got compile={options.compile}, cache={options.cache!r}, "
                             f"kv_dtype={options.kv_dtype}")
        if min(prompt) < 0 or max(prompt) >= self.model.vocab_size:
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {self.model.vocab_size})")
        stop_ids = check_budget(self.model, len(prompt), options)
        check_fit(len(prompt), options.max_new_tokens, self.capacity, "the server's KV memory")
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
        """The compiled decode step's state: {"state": "off"} without ``compile``, else
        :meth:`attnkit.serve.graph.CompiledDecode.status` ("compiling", "ready" or "failed", with its seconds,
        error and the steps it ran)."""
        return {"state": "off"} if self.graph is None else self.graph.status()

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Block until the background compile ends (or ``timeout`` seconds); True if decode steps now run compiled."""
        return self.graph is not None and self.graph.wait(timeout)

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and self.idle:
                    self._lock.wait()
                if self._stop:
                    return
            try:
                self.step()
            except BaseException as err:  # the engine is dead: every request fails now, none hangs
                self._die(err)
                return

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
        """Drop the cancelled, schedule, run the decoding rows and the prefill rows, sample; see the module."""
        with self._lock:
            self.scheduler.waiting.extend(self._inbox)
            self._inbox.clear()
        for request in [r for r in (*self.scheduler.running, *self.scheduler.waiting) if r.cancelled]:
            self._finish(request, "cancelled")
        decoding, prefill = self.scheduler.schedule()
        produced = sum(self._run(rows) for rows in batches(decoding + prefill))
        self._rate.append((time.monotonic(), produced))

    def _run(self, rows: list[Row]) -> int:
        """One forward over ``rows``; sample each request whose known tokens are now all in the pool."""
        logits = self.runner.forward(rows)  # (B, V)
        self.scheduler.written(rows)
        ready = [b for b, row in enumerate(rows) if row.request.computed == len(row.request.tokens)]
        if not ready:
            return 0
        requests = [rows[b].request for b in ready]
        for request, choice in zip(requests, self.runner.sample(requests, logits[ready]), strict=True):
            self._accept(request, choice)
        return len(requests)

    def _accept(self, request: Request, choice: Choice) -> None:
        token = choice.token
        request.tokens.append(token)
        request.generated += 1
        self.stats["generated_tokens_total"] += 1
        if request.first_token_at is None:
            request.first_token_at = time.monotonic()
        if request.constraint is not None:
            try:
                request.constraint.advance(token)
            except ValueError as err:  # a grammar that broke down ends its request alone
                self._finish(request, "error", [token], error=f"constrained decoding failed: {err}")
                return
        if token in request.stop_ids:  # the stop id itself is not text, but a token of the answer (usage counts it)
            self._finish(request, "stop", [token])
            return
        piece = request.text.add(token)
        self._emit(request, Event(piece, [token], logprobs=[choice] if choice.logprob is not None else []))
        if request.text.stopped or (request.constraint is not None and request.constraint.done):
            self._finish(request, "stop")  # nothing after the stop string is shown; nothing may follow the grammar
        elif request.generated >= request.options.max_new_tokens or len(request.tokens) >= self.model.context_length:
            self._finish(request, "length")

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

    # -- what /metrics reports ---------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counters and gauges, Prometheus-style names without the prefix."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self._rate if now - t < 10]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        with self._lock:
            return {"requests_running": len(self.scheduler.running),
                    "requests_waiting": len(self.scheduler.waiting) + len(self._inbox),
                    "kv_blocks": self.blocks.num_blocks, "kv_blocks_free": self.blocks.free_blocks,
                    "kv_blocks_used": self.blocks.num_blocks - self.blocks.free_blocks,
                    "prefix_cache_hit_tokens_total": self.blocks.hit_tokens, "tokens_per_second": rate,
                    "prompt_tokens_total": self.scheduler.prompt_tokens,
                    "preemptions_total": self.scheduler.preemptions, **self.stats}
