"""Checks that every rank agrees before a ring starts, with the same error on every rank.

A rank whose arguments are wrong does not raise alone (its peers would wait
for it until the process group times out): it describes the problem, every
rank takes part in one small all-gather of these descriptions, and then every
rank raises the same ValueError naming the rank and what differs.

Legend: B batch, H query heads, G key/value heads, n positions per rank, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .layout import LAYOUTS, num_chunks

Meta = dict[str, Any]


def _tensor_problem(q: object, k: object, v: object) -> str | None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            return f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4 or not t.is_floating_point():
            return f"{name} must be a 4-d floating point tensor, got {t.dtype} {tuple(t.shape)}"
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    if not q.dtype == k.dtype == v.dtype or not q.device == k.device == v.device:
        return (f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                f"{q.device}/{k.device}/{v.device}")
    (b, h, n, d), (bk, g, nk, dk), (bv, gv, nv, _) = q.shape, k.shape, v.shape
    if not (b == bk == bv and g == gv and n == nk == nv and d == dk):
        return (f"shapes do not fit: q (B, H, n, D) = {tuple(q.shape)}, k (B, G, n, D) = {tuple(k.shape)}, "
                f"v (B, G, n, Dv) = {tuple(v.shape)}")
    if g == 0 or h % g or n == 0 or d == 0:
        return f"q has H={h} heads and k, v have G={g}: H must be a positive multiple of G; n={n} and D={d} >= 1"
    return None


def _option_problem(q: Tensor, causal: object, key_mask: object, layout: object, world: int) -> str | None:
    if not isinstance(causal, bool):
        return f"causal must be a bool, got {causal!r}"
    if layout not in LAYOUTS:
        return f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got layout={layout!r}"
    per_rank = num_chunks(world, layout) // world
    if q.shape[2] % per_rank:
        return f"a {layout!r} shard holds {per_rank} equal chunks, so its length n={q.shape[2]} must be even"
    if key_mask is not None:
        b, n = q.shape[0], q.shape[2]
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, n):
            got = f"{key_mask.dtype} {tuple(key_mask.shape)}" if isinstance(key_mask, Tensor) else repr(key_mask)
            return f"key_mask must be a bool (B, n) = ({b}, {n}) tensor, True = real token; got {got}"
        if key_mask.device != q.device:
            return f"key_mask is on {key_mask.device} but q is on {q.device}"
    return None


def describe(q: object, k: object, v: object, *, causal: object, key_mask: object, layout: object,
             world: int) -> tuple[str | None, Meta]:
    """(this rank's problem or None, the facts every rank must share)."""
    problem = _tensor_problem(q, k, v)
    if problem is not None:
        return problem, {}
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)
    problem = _option_problem(q, causal, key_mask, layout, world)
    (b, h, n, d), g, dv = q.shape, k.shape[1], v.shape[-1]
    return problem, {
        "batch size B": b, "query heads H": h, "key/value heads G": g, "shard length n": n, "head dim D": d,
        "value head dim Dv": dv, "dtype": str(q.dtype), "device type": q.device.type, "causal": causal,
        "layout": layout, "key_mask given": key_mask is not None,
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
