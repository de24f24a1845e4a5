"""The process group's ranks, and one step in which they agree or fail alike.

A rank whose arguments are wrong must not raise alone (its peers would wait
for it until the process group times out): :func:`check_agreement` gathers
every rank's description of its call once, and every rank raises the same
ValueError naming the rank and what differs.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

Meta = dict[str, Any]


def rank_and_world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank in ``group``, the group's size); a clear error when there is no process group."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("attnkit.distributed needs a process group: call "
                         "torch.distributed.init_process_group(...) first (torchrun sets up its environment)")
    return dist.get_rank(group), dist.get_world_size(group)


def check_agreement(described: tuple[str | None, Meta], *, rank: int, world: int,
                    group: dist.ProcessGroup | None, what: str = "ring_attention") -> Meta:
    """One all-gather of every rank's description; the same ValueError on every rank if any is off."""
    if world == 1:
        gathered: list[Any] = [described]
    else:
        gathered = [None] * world
        dist.all_gather_object(gathered, described, group=group)
    problems = [f"rank {r}: {p}" for r, (p, _) in enumerate(gathered) if p is not None]
    if problems:
        raise ValueError(f"{what}: invalid arguments on " + "; ".join(problems))
    first = gathered[0][1]
    for key, value in first.items():
        for r, (_, meta) in enumerate(gathered[1:], start=1):
            if meta[key] != value:
                raise ValueError(f"{what}: ranks disagree on {key}: rank 0 has {value!r}, rank {r} has "
                                 f"{meta[key]!r} (every rank must pass the same shapes and options, with T / P "
                                 "positions each)")
    return first
