"""One step's rows through the model over the paged pool, then each request's next token.

The runner builds the step's :class:`attnkit.serve.paged.PagedBatch` once
(where each new token is written, which slots each row reads), runs the
model's ``step`` over it and samples every finished row with its own options
and seed (:mod:`attnkit.models.sampling`: the same random numbers as
``generate`` alone).

Legend: B rows in a forward, T tokens per row, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .paged import PagedBatch, PagedKVPool
from .scheduler import Request, Row


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
    """Runs rows of requests through ``model`` (an attnkit decoder) over ``pool``."""

    def __init__(self, model: Any, pool: PagedKVPool) -> None:
        self.model, self.pool = model, pool

    def forward(self, rows: list[Row]) -> Tensor:
        """Feed each row's tokens (right-aligned, padded to one width); logits (B, V) of each row's last token."""
        width = max(row.length for row in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T)
        positions = torch.full((len(rows), width), -1, dtype=torch.long)  # (B, T), -1 = padding
        for b, row in enumerate(rows):
            start = row.request.computed
            ids[b, width - row.length :] = torch.tensor(row.request.tokens[start : start + row.length])
            positions[b, width - row.length :] = torch.arange(start, start + row.length)
        lengths = [row.request.computed + row.length for row in rows]
        self.pool.batch = PagedBatch.build([row.request.blocks for row in rows], positions, lengths,
                                           self.pool.block_size, self.pool.spare)
        try:
            return self.model.step(ids, positions, self.pool.layers)  # (B, V): the last column is real
        finally:
            self.pool.batch = None

    @staticmethod
    def sample(requests: list[Request], logits: Tensor) -> list[int]:
        """Each request's next token from its row of ``logits`` (B, V), grouped by sampling options."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for b, request in enumerate(requests):
            o = request.options
            groups.setdefault((o.temperature, o.top_k, o.top_p), []).append(b)
        chosen = [0] * len(requests)
        for rows in groups.values():
            sampler = requests[rows[0]].options.sampler
            seeds = torch.tensor([requests[b].seed for b in rows])  # (n,)
            steps = torch.tensor([requests[b].generated for b in rows])  # (n,)
            for b, token in zip(rows, sampler(logits[rows], seeds, steps).tolist(), strict=True):
                chosen[b] = token
        return chosen
