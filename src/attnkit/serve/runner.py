"""One step's rows through the model over the paged pool, then each request's next token.

The runner builds the step's :class:`attnkit.serve.paged.PagedBatch` once
(where each new token is written, which slots each row reads) on the pool's
device (the model's: the CPU or a GPU), runs the model's ``step`` over it (an
all-decode step through the compiled graph once it is ready:
:mod:`attnkit.serve.graph`) and samples every finished row with its own options
and seed (:mod:`attnkit.models.sampling`: the same random numbers, penalties
and sampler as ``generate`` alone), with its logprobs when asked for. A row's
``logit_bias`` is added to its logits first; then a row whose request carries
a constraint (:mod:`attnkit.serve.grammar`) has the tokens it forbids set to
-inf, each row by its own constraint. A penalised request's (counts, seen) are
kept between steps (:class:`History`) and take each new token as it comes.
With a sink window, the runner carries out the scheduler's evictions
(:meth:`Runner.evict`) before the step's forwards.

Legend: B rows in a forward, T tokens per row, V vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.modules.sink_window import SinkWindow

from .events import Choice
from .graph import CompiledDecode
from .paged import PagedBatch, PagedKVPool, layer_caches, slots
from .scheduler import Request, Row, Shift


def batches(rows: list[Row]) -> list[list[Row]]:
    """The step's rows in one forward per length: every decoding request's token together, and prompt chunks
    of one length (several requests') together. Padding a shorter chunk to a longer one's width costs the MLPs
    a padded token as much as a real one: on a CPU that was slower than a forward more (BENCHMARKS.md, round
    thirteen)."""
    by_length: dict[int, list[Row]] = {}
    for row in rows:
        by_length.setdefault(row.length, []).append(row)
    return list(by_length.values())


class Runner:
    """Runs rows of requests through ``model`` (an attnkit decoder) over ``pool``; all-decode steps through
    ``graph`` once it is ready (:mod:`attnkit.serve.graph`), every other step eagerly. ``windows``: each layer's
    sink window (its rotary embedding re-rotates the keys an eviction moves), or none."""

    def __init__(self, model: Any, pool: PagedKVPool, graph: CompiledDecode | None = None,
                 windows: list[SinkWindow] | None = None) -> None:
        self.model, self.pool, self.graph, self.windows = model, pool, graph, windows or []
        # each penalised request's History, dropped with the request (its last reference gone)
        self.histories: weakref.WeakKeyDictionary[Request, History] = weakref.WeakKeyDictionary()

    def run(self, rows: list[Row]) -> list[tuple[Request, Choice]]:
        """One forward over ``rows``, then the next token of each request whose known tokens the forward
        finished writing (a prompt's last chunk, or a decoding token); the rest of a prompt samples nothing."""
        logits = self.forward(rows)  # (B, V)
        ready = [b for b, row in enumerate(rows) if row.request.computed + row.length == len(row.request.tokens)]
        if not ready:
            return []
        requests = [rows[b].request for b in ready]
        logits = logits if len(ready) == len(rows) else logits[ready]  # (B, V) -> (n, V): no copy when all are
        return list(zip(requests, self.sample(requests, logits), strict=True))

    def forward(self, rows: list[Row]) -> Tensor:
        """Feed each row's tokens (right-aligned, padded to one width); logits (B, V) of each row's last token."""
        width = max(row.length for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T)
        positions = torch.full((len(rows), width), -1, dtype=torch.long)  # (B, T), -1 = padding
        for b, row in enumerate(rows):
            start, held = row.request.computed, row.request.held  # the next token's index and its position
            ids[b, width - row.length :] = torch.tensor(row.request.tokens[start : start + row.length])
            positions[b, width - row.length :] = torch.arange(held, held + row.length)
        device = self.pool.device  # filled row by row on the CPU, then one copy each to a GPU (none on the CPU)
        ids, positions = ids.to(device), positions.to(device)
        lengths = [row.request.held + row.length for row in rows]
        batch = PagedBatch.build([row.request.blocks for row in rows], positions, lengths, self.pool.block_size,
                                 self.pool.spare)
        pool = self.pool  # an int8 pool's scales go with its codes; a float pool's scale lists are empty
        if width == 1 and self.graph is not None and self.graph.ready:
            logits = self.graph(ids, positions, batch, pool.k, pool.v, pool.k_scales, pool.v_scales)  # (B, V)
            if logits is not None:  # None: run eagerly
                return logits
        return self.model.step(ids, positions, layer_caches(pool.k, pool.v, batch, pool.k_scales,
                                                            pool.v_scales))  # (B, V)

    def evict(self, shift: Shift) -> None:
        """Carry out a sink window's eviction in every layer: copy the blocks the request made its own, then move
        the window positions after the ``shift.by`` oldest down by ``shift.by`` (keys re-rotated by ``-shift.by``,
        as ``KVCache`` with a SinkWindow does)."""
        size, sinks, device = self.pool.block_size, self.windows[0].sinks, self.pool.device
        if shift.copies:
            blocks = torch.tensor(shift.copies, device=device).T  # (n, 2) -> (2, n): originals, copies
            whole = blocks[..., None] * size + torch.arange(size, device=device)  # (2, n, size): every slot
            originals, copies = whole.flatten(1)  # (n * size,) each
            for keys, values in zip(self.pool.k, self.pool.v, strict=True):
                keys[copies] = keys[originals]  # (n * size, G, D)
                values[copies] = values[originals]
        table = torch.tensor(shift.request.blocks, device=device)  # (blocks,)
        kept = torch.arange(sinks + shift.by, shift.held, device=device)  # (n,) positions kept
        source, target = slots(table, kept, size), slots(table, kept - shift.by, size)  # (n,) each
        for keys, values, window in zip(self.pool.k, self.pool.v, self.windows, strict=True):
            rotated = window.shifted(keys[source].transpose(0, 1)[None], shift.by)  # (n, G, D) -> (1, G, n, D)
            keys[target] = rotated[0].transpose(0, 1)  # (1, G, n, D) -> (n, G, D)
            values[target] = values[source]  # the gather copies before the overlapping write

    def sample(self, requests: list[Request], logits: Tensor) -> list[Choice]:
        """Each request's next token from its row of ``logits`` (B, V), grouped by sampling options, with the
        penalties of its options and, when asked for, its logprobs. A request's logit_bias is added first, then a
        constrained request's row is masked, so penalties, sampler and logprobs all see the biased, masked scores
        (OpenAI's logprobs reflect logit_bias too)."""
        logits = _constrain(requests, _bias(requests, logits))
        groups: dict[tuple[Any, ...], list[int]] = {}
        for b, request in enumerate(requests):
            o = request.options
            groups.setdefault((o.sampler, o.penalties), []).append(b)
        chosen: list[Choice] = [Choice(0)] * len(requests)
        for rows in groups.values():
            options = requests[rows[0]].options
            scores = logits if len(rows) == len(requests) else logits[rows]  # (B, V) -> (n, V)
            if options.penalties.active:
                counts, seen = _history([requests[b] for b in rows], self.histories, scores.shape[-1],
                                        scores.device)
                scores = options.penalties(scores, counts, seen)
            seeds = torch.tensor([requests[b].seed for b in rows], device=scores.device)  # (n,)
            steps = torch.tensor([requests[b].generated for b in rows], device=scores.device)  # (n,)
            tokens = options.sampler(scores, seeds, steps).tolist()
            for i, (b, token) in enumerate(zip(rows, tokens, strict=True)):
                k = requests[b].options.logprobs
                chosen[b] = Choice(token) if k is None else _logprobs(scores[i], token, k)
        return chosen


def _logprobs(scores: Tensor, token: int, k: int) -> Choice:
    """The chosen token's log-softmax and the k most likely tokens', from one row's scores (V,)."""
    logp = scores.double().log_softmax(dim=-1)  # (V,)
    values, ids = logp.topk(k) if k else (logp[:0], logp[:0].long())  # (k,)
    finite = values > float("-inf")  # a constraint may allow fewer than k tokens: the rest are not alternatives
    values, ids = values[finite], ids[finite]
    return Choice(token, float(logp[token]), tuple(zip(ids.tolist(), values.tolist(), strict=True)))


def _bias(requests: list[Request], logits: Tensor) -> Tensor:
    """``logits`` (B, V) with each request's ``logit_bias`` added to its row (a copy; the same tensor if no request
    has one)."""
    biased = logits
    for b, request in enumerate(requests):
        bias = request.options.logit_bias
        if not bias:
            continue
        if biased is logits:
            biased = logits.clone()
        ids = torch.tensor(list(bias), dtype=torch.long, device=logits.device)  # (k,)
        values = torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)  # (k,)
        biased[b].index_add_(0, ids, values)  # (V,): the bias added at its ids
    return biased


def _constrain(requests: list[Request], logits: Tensor) -> Tensor:
    """``logits`` (B, V) with each constrained request's forbidden tokens at -inf (a copy; the same tensor if no
    request is constrained). A constraint that cannot say (its grammar broke down) leaves its row as it is: the
    engine ends that request when its constraint refuses the token sampled."""
    masked = logits
    for b, request in enumerate(requests):
        if request.constraint is None:
            continue
        try:
            allowed = request.constraint.allowed()  # (V,)
        except ValueError:
            continue
        assert allowed.shape == logits.shape[-1:], f"a constraint's mask {tuple(allowed.shape)} for logits (V,) = " \
                                                   f"{tuple(logits.shape[-1:])}"
        if masked is logits:
            masked = logits.clone()
        masked[b].masked_fill_(~allowed.to(logits.device), float("-inf"))  # a constraint's mask is on the CPU
    return masked


@dataclass
class History:
    """A penalised request's tokens so far, as the penalties read them: ``counts`` (V,) how often each token
    appears in its answer, ``seen`` (V,) bool which tokens its prompt or answer holds; ``upto``: how many of
    ``request.tokens`` they count. A request's tokens only grow (a preempted one keeps them and recomputes only
    their keys and values), so each step adds the tokens after ``upto``: one per step, not all of them again."""

    counts: Tensor
    seen: Tensor
    upto: int = 0

    def update(self, request: Request) -> None:
        """Count ``request.tokens[upto:]``: the prompt at the first sampling step, then each token sampled."""
        new = request.tokens[self.upto :]
        if not new:
            return
        ids = torch.tensor(new, dtype=torch.long, device=self.seen.device)  # (k,)
        self.seen[ids] = True
        answer = ids[max(len(request.prompt) - self.upto, 0) :]  # (a,): the new tokens after the prompt
        self.counts.index_put_((answer,), torch.ones_like(answer, dtype=self.counts.dtype), accumulate=True)
        self.upto = len(request.tokens)


def _history(requests: list[Request], histories: MutableMapping[Request, History], vocab_size: int,
             device: torch.device) -> tuple[Tensor, Tensor]:
    """(counts, seen) (n, V): each request's answer tokens counted, and its prompt's and answer's tokens; kept
    per request in ``histories`` (created at its first sampling step) and brought up to date with its new
    tokens."""
    for request in requests:
        history = histories.get(request)
        if history is None:
            history = histories[request] = History(torch.zeros(vocab_size, device=device),
                                                   torch.zeros(vocab_size, dtype=torch.bool, device=device))
        history.update(request)
    counts = torch.stack([histories[request].counts for request in requests])  # n x (V,) -> (n, V)
    seen = torch.stack([histories[request].seen for request in requests])  # n x (V,) -> (n, V)
    return counts, seen
