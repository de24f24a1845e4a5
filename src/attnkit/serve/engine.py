"""Continuous batching: requests wait, run and finish; every step is one batched pass over what runs.

Each :meth:`Engine.step`

1. drops cancelled sequences (their blocks are freed at once),
2. admits waiting requests while there is room (batch size and KV blocks),
   reusing cached prefixes (:class:`attnkit.serve.blocks.BlockManager`),
3. finds each decoding sequence a slot for its next token; when the pool is
   full, the newest running sequence is preempted (its blocks freed, its
   tokens recomputed when it runs again),
4. runs one forward for every decoding sequence (one token each) and one per
   prompt chunk of a prefilling sequence (within a token budget per step),
5. samples each sequence with its own options and seed
   (:mod:`attnkit.models.sampling`: the same random numbers as ``generate``
   alone, so the same tokens with float32 / float16 weights up to rounding; with
   int8 / int4 weights a batch moves the logits by tenths and a sampled request
   generally differs from the same request alone),
   and ends it on a stop id, a stop string, ``max_tokens`` or the context.

The engine runs in a thread of its own (:meth:`Engine.start`); other threads
only :meth:`submit` and :meth:`cancel`. Every event of a sequence goes to its
``on_event`` callback, called from the engine thread.

Legend: B sequences in a forward, T tokens per row, V vocabulary.
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
from torch import Tensor

from attnkit.models.generation import IncrementalDecoder
from attnkit.models.generation_options import kv_storage
from attnkit.models.sampling import Sampler, row_seeds

from .blocks import BlockManager
from .paged import PagedBatch, PagedKVPool


class EngineError(RuntimeError):
    """The engine cannot take a request (full queue, dead engine)."""


class QueueFullError(EngineError):
    """Too many requests wait already: retry later."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's options, checked when it is submitted."""

    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_ids: tuple[int, ...] | None = None  # None: the model's end-of-turn ids

    def sampler(self) -> Sampler:
        return Sampler(self.temperature, self.top_k, self.top_p)


@dataclass
class Event:
    """What a sequence produced in one step."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    error: str | None = None


@dataclass(eq=False)
class Sequence_:
    """A request inside the engine."""

    id: int
    prompt: list[int]
    params: SamplingParams
    on_event: Callable[[Event], None]
    seed: int
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose keys and values are in the cache
    generated: int = 0
    cancelled: bool = False
    finished: bool = False
    text: IncrementalDecoder | None = None
    held: str = ""  # text held back: it may be the start of a stop string
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None

    @property
    def prefilling(self) -> bool:
        return self.computed < len(self.tokens) - 1


def _pool_dtype(model_dtype: torch.dtype, kv_dtype: torch.dtype | str | None) -> torch.dtype:
    """The paged pool's dtype: the model's, or a narrower one under a float32 model."""
    stored = kv_storage(kv_dtype)
    if stored is None:
        return model_dtype
    if stored is torch.int8:
        raise ValueError("kv_dtype=int8 is generate()'s Int8KVCache; the paged pool stores None (the model's dtype), "
                         "bfloat16 or float16")
    if model_dtype != torch.float32:
        raise ValueError(f"kv_dtype={stored} stores a float32 model's keys in fewer bytes; this model computes in "
                         f"{model_dtype}: use kv_dtype=None")
    return stored


class Engine:
    """Serve a decoder model to many requests at once over a paged KV cache.

    Args:
        model: an attnkit decoder (``LlamaModel``): ``step(ids, positions, caches)``,
            ``config``, ``vocab_size``, ``context_length``, ``stop_token_ids``.
        decode: token ids -> text (the tokenizer's decode).
        kv_memory_mib: memory for keys and values of every layer.
        block_size: positions per KV block.
        max_batch: most sequences running at once.
        token_budget: most prompt tokens prefilled per step.
        max_waiting: most requests waiting; more are refused (:class:`QueueFullError`).
        kv_dtype: the dtype the pool stores keys and values in: None (the
            model's), or bfloat16 / float16 under a float32 model: twice the
            blocks in ``kv_memory_mib`` (attention reads the rounded keys).
    """

    def __init__(self, model: Any, decode: Callable[[list[int]], str], *, kv_memory_mib: float = 256,
                 block_size: int = 16, max_batch: int = 16, token_budget: int = 512, max_waiting: int = 256,
                 kv_dtype: torch.dtype | str | None = None) -> None:
        config = model.config
        dtype = _pool_dtype(next(model.parameters()).dtype, kv_dtype)
        per_block = PagedKVPool.bytes_per_block(num_layers=config.num_layers, block_size=block_size,
                                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                                                dtype=dtype)
        num_blocks = int(kv_memory_mib * 2**20 // per_block)
        if num_blocks < 2:
            raise ValueError(f"kv_memory_mib={kv_memory_mib} holds {num_blocks} blocks of {block_size} positions "
                             f"({per_block / 2**20:.2f} MiB each); give at least {2 * per_block / 2**20:.2f} MiB")
        self.model, self.decode = model, decode
        self.pool = PagedKVPool(num_layers=config.num_layers, num_blocks=num_blocks, block_size=block_size,
                                num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
        self.blocks = BlockManager(num_blocks, block_size)
        self.max_batch, self.token_budget, self.max_waiting = max_batch, token_budget, max_waiting
        self.waiting: deque[Sequence_] = deque()
        self.running: list[Sequence_] = []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.error: BaseException | None = None
        self.stats = {"requests_total": 0, "generated_tokens_total": 0, "prompt_tokens_total": 0,
                      "preemptions_total": 0}
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) of recent steps

    @property
    def capacity(self) -> int:
        """The most positions (prompt + answer) one sequence can hold in the KV memory."""
        return self.blocks.num_blocks * self.blocks.block_size

    # -- the other threads' side -------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], params: SamplingParams, on_event: Callable[[Event], None]) -> Sequence_:
        """Queue a request; raises ValueError if it can never fit, QueueFullError, or EngineError if the engine died."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty")
        room = self.model.context_length - len(prompt)
        if room < params.max_tokens:
            raise ValueError(f"the prompt has {len(prompt)} tokens and max_tokens={params.max_tokens}: together "
                             f"more than the context window of {self.model.context_length} tokens")
        if self.blocks.blocks_for(len(prompt) + params.max_tokens) > self.blocks.num_blocks:
            raise ValueError(f"the prompt ({len(prompt)} tokens) and max_tokens={params.max_tokens} need more KV "
                             f"memory than the server has ({self.blocks.num_blocks} blocks of "
                             f"{self.blocks.block_size} positions)")
        with self._lock:
            if self.error is not None:
                raise EngineError(f"the engine stopped after an error: {self.error!r}")
            if len(self.waiting) >= self.max_waiting:
                raise QueueFullError(f"{len(self.waiting)} requests are waiting already")
            seed = int(row_seeds(params.seed, 1)[0])
            seq = Sequence_(next(self._ids), prompt, params, on_event, seed, tokens=list(prompt),
                            text=IncrementalDecoder(self.decode))
            self.waiting.append(seq)
            self.stats["requests_total"] += 1
            self._lock.notify()
        return seq

    def cancel(self, seq: Sequence_) -> None:
        """Stop a request (a client went away); its blocks are freed at the next step."""
        with self._lock:
            seq.cancelled = True
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

    @property
    def alive(self) -> bool:
        return self.error is None and (self._thread is None or self._thread.is_alive())

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self.waiting and not self.running:
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
            everyone = list(self.running) + list(self.waiting)
            self.running, self.waiting = [], deque()
        for seq in everyone:
            self._emit(seq, Event("", [], "error", error=f"engine error: {err!r}"))

    # -- one step ----------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> None:
        """Admit, schedule, run one batched pass, sample; see the module docstring."""
        self._drop_cancelled()
        self._admit()
        decoding = self._make_room([s for s in self.running if not s.prefilling])
        prefilling, budget = [], self.token_budget
        for seq in self.running:
            if seq.prefilling and budget > 0:
                chunk = min(len(seq.tokens) - seq.computed, budget)
                prefilling.append((seq, chunk))
                budget -= chunk
        produced = 0
        if decoding:
            logits = self._forward(decoding, [1] * len(decoding))  # (B, V)
            produced += self._sample(decoding, logits)
        for seq, chunk in prefilling:
            logits = self._forward([seq], [chunk])  # (1, V)
            if seq.computed == len(seq.tokens):  # the whole prompt is in: its last token's logits count
                produced += self._sample([seq], logits)
        self._rate.append((time.monotonic(), produced))

    def _drop_cancelled(self) -> None:
        with self._lock:
            gone = [s for s in itertools.chain(self.running, self.waiting) if s.cancelled and not s.finished]
            self.waiting = deque(s for s in self.waiting if not s.cancelled)
        for seq in gone:
            self._finish(seq, "cancelled")

    def _admit(self) -> None:
        with self._lock:
            while self.waiting and len(self.running) < self.max_batch:
                seq = self.waiting[0]
                allocation = self.blocks.allocate(seq.tokens, reserve=1)
                if allocation is None:
                    break
                self.waiting.popleft()
                seq.blocks, seq.computed = allocation.blocks, allocation.cached_tokens
                self.running.append(seq)
                self.stats["prompt_tokens_total"] += len(seq.tokens) - allocation.cached_tokens

    def _make_room(self, decoding: list[Sequence_]) -> list[Sequence_]:
        """A slot for each decoding sequence's next token; preempt the newest running ones while none is free."""
        ready = []
        for seq in sorted(decoding, key=lambda s: s.arrival):
            while seq in self.running and not self.blocks.grow(seq.blocks, len(seq.tokens)):
                self._preempt(max(self.running, key=lambda s: s.arrival))  # the newest (maybe seq itself)
            if seq in self.running:
                ready.append(seq)
        return [s for s in ready if s in self.running]

    def _preempt(self, seq: Sequence_) -> None:
        """Free a running sequence's blocks and queue it first again (it recomputes its tokens later)."""
        self.blocks.release(seq.blocks)
        seq.blocks, seq.computed = [], 0
        self.running.remove(seq)
        with self._lock:
            self.waiting.appendleft(seq)
        self.stats["preemptions_total"] += 1

    def _forward(self, seqs: list[Sequence_], chunks: list[int]) -> Tensor:
        """Feed each sequence's next ``chunk`` tokens (right-padded to one width); logits (B, V) of each last."""
        width = max(chunks)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)  # (B, T)
        positions = torch.full((len(seqs), width), -1, dtype=torch.long)  # (B, T), -1 = padding
        for row, (seq, chunk) in enumerate(zip(seqs, chunks, strict=True)):
            start = seq.computed if seq.prefilling else len(seq.tokens) - 1
            ids[row, width - chunk :] = torch.tensor(seq.tokens[start : start + chunk])
            positions[row, width - chunk :] = torch.arange(start, start + chunk)
            seq.computed = start + chunk
        lengths = [s.computed for s in seqs]
        self.pool.batch = PagedBatch.build([s.blocks for s in seqs], positions, lengths, self.blocks.block_size,
                                           self.pool.spare)
        try:
            logits = self.model.step(ids, positions, self.pool.layers)  # (B, V): the last column is real
        finally:
            self.pool.batch = None
        for seq in seqs:
            self.blocks.written(seq.blocks, seq.computed, seq.tokens)
        return logits

    def _sample(self, seqs: list[Sequence_], logits: Tensor) -> int:
        """Choose each sequence's next token (grouped by options) and hand out what it completes."""
        chosen: dict[int, int] = {}
        groups: dict[tuple[Any, ...], list[int]] = {}
        for row, seq in enumerate(seqs):
            p = seq.params
            groups.setdefault((p.temperature, p.top_k, p.top_p), []).append(row)
        for rows in groups.values():
            sampler = seqs[rows[0]].params.sampler()
            seeds = torch.tensor([seqs[r].seed for r in rows])
            steps = torch.tensor([seqs[r].generated for r in rows])
            for r, token in zip(rows, sampler(logits[rows], seeds, steps).tolist(), strict=True):
                chosen[r] = token
        for row, seq in enumerate(seqs):
            self._accept(seq, chosen[row])
        return len(seqs)

    def _accept(self, seq: Sequence_, token: int) -> None:
        seq.tokens.append(token)
        seq.generated += 1
        self.stats["generated_tokens_total"] += 1
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
        stops = self.model.stop_token_ids if seq.params.stop_ids is None else seq.params.stop_ids
        if token in stops:  # the stop id itself is not text
            self._finish(seq, "stop")
            return
        assert seq.text is not None
        text = seq.held + seq.text.add(token)
        seq.held = ""
        at = min((i for i in (text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if at >= 0:  # the earliest match in the text, whatever the order of the stop strings
            self._emit(seq, Event(text[:at], [token]))
            self._finish(seq, "stop", flush=False)  # nothing after the stop string is shown
            return
        keep = max((len(s) - 1 for s in seq.params.stop), default=0)  # the end may start a stop string
        cut = len(text)
        for n in range(min(keep, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in seq.params.stop):
                cut = len(text) - n
                break
        seq.held = text[cut:]
        if seq.generated >= seq.params.max_tokens or len(seq.tokens) >= self.model.context_length:
            self._emit(seq, Event(text[:cut], [token]))
            self._finish(seq, "length")
            return
        self._emit(seq, Event(text[:cut], [token]))

    def _finish(self, seq: Sequence_, reason: str, *, flush: bool = True) -> None:
        if seq.finished:
            return
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
            self.blocks.release(seq.blocks)
            seq.blocks = []
        rest = seq.held + seq.text.flush() if flush and seq.text is not None else ""
        self._emit(seq, Event(rest, [], reason))

    @staticmethod
    def _emit(seq: Sequence_, event: Event) -> None:
        try:
            seq.on_event(event)
        except Exception:  # a client's callback never takes the engine down
            seq.cancelled = True

    # -- what /metrics reports ---------------------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Counters and gauges, Prometheus-style names without the prefix."""
        now = time.monotonic()
        recent = [(t, n) for t, n in self._rate if now - t < 10]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        with self._lock:
            return {"requests_running": len(self.running), "requests_waiting": len(self.waiting),
                    "kv_blocks": self.blocks.num_blocks, "kv_blocks_free": self.blocks.free_blocks,
                    "kv_blocks_used": self.blocks.num_blocks - self.blocks.free_blocks,
                    "prefix_cache_hit_tokens_total": self.blocks.hit_tokens, "tokens_per_second": rate,
                    **self.stats}
