"""Checks that every rank agrees before a ring starts, with the same error on every rank.

A rank whose arguments are wrong does not raise alone (its peers would wait
for it until the process group times out): it describes the problem, every
rank takes part in one small all-gather of these descriptions, and then every
rank raises the same ValueError naming the rank and what differs. What one
rank's arguments must be is checked by the backends' own validators
(:mod:`attnkit.backends.call`), turned into these descriptions.

Legend: B batch, H query heads, G key/value heads, n positions per rank, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.backends.call import check_key_mask, check_qkv, check_scale

from .layout import LAYOUTS, num_chunks

Meta = dict[str, Any]


def _problem(check: Callable[..., object], *args: object, **kwargs: object) -> str | None:
    """The message of what ``check`` (one of the backends' validators) raises, or None: a rank's problem."""
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _tensor_problem(q: object, k: object, v: object) -> str | None:
    """attnkit.attention's checks of q, k, v (one copy, in the backends), and one length n for all three."""
    try:
        q, k, _ = check_qkv(q, k, v)
    except (TypeError, ValueError) as err:
        return str(err)
    if q.shape[2] != k.shape[2]:
        return f"q, k and v must hold the same n positions of this rank, got q n={q.shape[2]}, k n={k.shape[2]}"
    return None


def _option_problem(q: Tensor, causal: object, key_mask: object, scale: object, layout: object,
                    world: int) -> str | None:
    if not isinstance(causal, bool):
        return f"causal must be a bool, got {causal!r}"
    if layout not in LAYOUTS:
        return f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got layout={layout!r}"
    per_rank = num_chunks(world, layout) // world
    if q.shape[2] % per_rank:
        return f"a {layout!r} shard holds {per_rank} equal chunks, so its length n={q.shape[2]} must be even"
    return _problem(check_scale, scale) or _problem(check_key_mask, key_mask, q, q.shape[2], keys="n", note="")


def describe(q: object, k: object, v: object, *, causal: object, key_mask: object, layout: object,
             world: int, scale: object = None) -> tuple[str | None, Meta]:
    """(this rank's problem or None, the facts every rank must share)."""
    problem = _tensor_problem(q, k, v)
    if problem is not None:
        return problem, {}
    q, k, v = cast(Tensor, q), cast(Tensor, k), cast(Tensor, v)  # checked above
    problem = _option_problem(q, causal, key_mask, scale, layout, world)
    (b, h, n, d), g, dv = q.shape, k.shape[1], v.shape[-1]
    return problem, {
        "batch size B": b, "query heads H": h, "key/value heads G": g, "shard length n": n, "head dim D": d,
        "value head dim Dv": dv, "dtype": str(q.dtype), "device type": q.device.type, "causal": causal,
        "layout": layout, "key_mask given": key_mask is not None,
        "scale": None if problem or scale is None else float(scale),  # type: ignore[arg-type]
        "gradients needed": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)),
    }


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
