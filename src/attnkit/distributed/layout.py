"""How a sequence is split across the P ranks of a process group.

- ``"contiguous"``: rank r holds positions [r * T/P, (r + 1) * T/P).
- ``"zigzag"``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P - 1 - r, so that under a causal mask every rank has the same work (an
  early chunk sees few keys, its partner many).

Legend: B batch, T positions of the whole sequence, P ranks, n = T / P
positions per rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .group import check_agreement, rank_and_world

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: object) -> str:
    """``layout`` if it is a known layout's name; else a ValueError listing them."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got layout={layout!r}")
    return layout


def num_chunks(world: int, layout: str) -> int:
    """How many equal chunks the layout cuts the sequence into: P or 2P."""
    return 2 * world if check_layout(layout) == "zigzag" else world


def rank_chunks(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The chunk indices rank ``rank`` holds, in the order of its local tensor."""
    return (rank, 2 * world - 1 - rank) if check_layout(layout) == "zigzag" else (rank,)


def check_length(length: int, world: int, layout: str, *, what: str = "sequence length") -> int:
    """The chunk length; a clear error when ``length`` does not split evenly."""
    chunks = num_chunks(world, layout)
    if length % chunks or length <= 0:
        need = "2P" if layout == "zigzag" else "P"
        raise ValueError(f"{what} {length} cannot be split by layout {layout!r} over P={world} ranks: it must be "
                         f"a positive multiple of {chunks} ({need})")
    return length // chunks


def chunk_positions(rank: int, world: int, layout: str, length: int) -> list[range]:
    """The global positions of each chunk a rank holds, for a sequence of ``length``."""
    size = check_length(length, world, layout)
    return [range(c * size, (c + 1) * size) for c in rank_chunks(rank, world, layout)]


def shard_positions(length: int, *, layout: str = "zigzag", group: dist.ProcessGroup | None = None,
                    device: torch.device | str | None = None) -> Tensor:
    """The global positions (n,) this rank holds of a sequence of ``length`` (for RoPE), int64."""
    rank, world = rank_and_world(group)
    ranges = chunk_positions(rank, world, layout, length)
    return torch.cat([torch.arange(r.start, r.stop, device=device) for r in ranges])  # (n,)


def _check_tensor_dim(x: object, dim: object, what: str) -> tuple[Tensor, int]:
    """(x, dim) when x is a tensor and dim one of its dimensions; else a ValueError naming them."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{what} takes a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim must be an int in [{-x.dim()}, {x.dim()}) for a {x.dim()}-d tensor, "
                         f"got dim={dim!r}")
    return x, dim


def shard(x: Tensor, dim: int, *, layout: str = "zigzag", group: dist.ProcessGroup | None = None) -> Tensor:
    """This rank's part of the whole tensor ``x`` along ``dim`` (a copy): (..., T, ...) -> (..., n, ...)."""
    rank, world = rank_and_world(group)
    x, dim = _check_tensor_dim(x, dim, "shard")
    size = check_length(x.shape[dim], world, layout, what=f"length along dim {dim}")
    parts = [x.narrow(dim, c * size, size) for c in rank_chunks(rank, world, layout)]
    return torch.cat(parts, dim=dim)  # (..., n, ...)


def unshard(x_local: Tensor, dim: int, *, layout: str = "zigzag", group: dist.ProcessGroup | None = None
            ) -> Tensor:
    """The whole tensor from every rank's part (an all-gather; not differentiable): (..., n, ...) -> (..., T, ...)."""
    rank, world = rank_and_world(group)
    x_local, dim = _check_tensor_dim(x_local, dim, "unshard")
    chunks = num_chunks(world, layout)
    per_rank = len(rank_chunks(rank, world, layout))
    problem = None
    if x_local.shape[dim] % per_rank:
        problem = (f"a {layout!r} shard holds {per_rank} equal chunks, but its length along dim {dim} is "
                   f"{x_local.shape[dim]}")
    facts = {"shape": tuple(x_local.shape), "dtype": str(x_local.dtype)}
    check_agreement((problem, facts), rank=rank, world=world, group=group, what="unshard")  # same error everywhere
    gathered = [torch.empty_like(x_local) for _ in range(world)]
    dist.all_gather(gathered, x_local.contiguous(), group=group)
    pieces: list[Tensor | None] = [None] * chunks
    for r, part in enumerate(gathered):
        for c, piece in zip(rank_chunks(r, world, layout), part.chunk(per_rank, dim=dim), strict=True):
            pieces[c] = piece
    return torch.cat(pieces, dim=dim)  # type: ignore[arg-type]  # (..., T, ...)
