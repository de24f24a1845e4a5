"""Checks that every rank agrees before a ring starts, with the same error on every rank.

A rank whose arguments are wrong does not raise alone (its peers would wait
for it until the process group times out): it describes the problem here, and
:func:`attnkit.distributed.group.check_agreement` gathers every rank's
description so that every rank raises the same ValueError naming the rank and
what differs. What one rank's arguments must be is checked by the backends'
own validators (:mod:`attnkit.backends.call`), turned into these descriptions.

Modifiers are checked here too, at the whole sequence's T = n * P global
positions: their signatures, whether they fit the call (head counts, document
ids for all T positions), and one evaluation of each at position (0, 0), so
that a modifier returning the wrong kind of tensor is refused on every rank
alike before the ring starts. That evaluation also finds the tensors a score
modifier closes over (:func:`captured_by`), whose need of gradients every
rank must share.

Legend: B batch, H query heads, G key/value heads, n positions per rank, T =
n * P the whole sequence, D head dim.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from attnkit.backends.blockmods import block_mods, captured_tensors
from attnkit.backends.call import check_key_mask, check_qkv, check_scale, compute_dtype
from attnkit.backends.modifiers import (
    MASK_ARGS,
    SCORE_ARGS,
    apply_mask_mod,
    check_geometry,
    check_modifier,
    check_sinks,
    index_grid,
)
from attnkit.functional.modifiers import ScoreMod, modifier_name

from .group import Meta
from .layout import LAYOUTS, num_chunks


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
    if q.dtype != k.dtype:
        return f"ring attention takes q, k, v in one dtype, got q {q.dtype} and k, v {k.dtype}"
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


def captured_by(score_mod: ScoreMod | None, q: Tensor, length: int) -> tuple[Tensor, ...]:
    """The tensors ``score_mod`` closes over that require grad (one evaluation, at position (0, 0) of the
    ``length`` global positions, which checks what it returns); () without a score modifier."""
    if score_mod is None:
        return ()
    b, h = q.shape[:2]
    mods = block_mods(score_mod, None, batch=b, num_heads=h, q_positions=range(length),
                      kv_positions=range(length), device=q.device)
    probe = torch.zeros(b, h, 1, 1, dtype=compute_dtype(q.dtype), device=q.device)  # (B, H, 1, 1)
    return captured_tensors(score_mod, probe, mods, 0)


def _modifier_problem(q: Tensor, score_mod: object, mask_mod: object, sinks: object,
                      length: int) -> tuple[str | None, tuple[Tensor, ...]]:
    """(what is wrong with this rank's modifiers and sinks or None, the tensors score_mod closes over)."""
    b, h = q.shape[:2]
    try:
        check_modifier(score_mod, "score_mod", SCORE_ARGS)
        check_modifier(mask_mod, "mask_mod", MASK_ARGS)
        for fn in (score_mod, mask_mod):
            check_geometry(fn, b, h, range(length), range(length))
        check_sinks(sinks, q)
        if mask_mod is not None:
            apply_mask_mod(mask_mod, index_grid(b, h, range(1), range(1), q.device))  # type: ignore[arg-type]
        return None, captured_by(score_mod, q, length)  # type: ignore[arg-type]
    except (TypeError, ValueError) as err:
        return str(err), ()


def _name(fn: object) -> str | None:
    """How ranks compare a modifier: its name, without the memory address a default repr holds."""
    return None if fn is None else re.sub(r" at 0x[0-9a-fA-F]+", "", modifier_name(fn))


def describe(q: object, k: object, v: object, *, causal: object, key_mask: object, layout: object,
             world: int, scale: object = None, score_mod: object = None, mask_mod: object = None,
             sinks: object = None) -> tuple[str | None, Meta]:
    """(this rank's problem or None, the facts every rank must share)."""
    problem = _tensor_problem(q, k, v)
    if problem is not None:
        return problem, {}
    q, k, v = cast(Tensor, q), cast(Tensor, k), cast(Tensor, v)  # checked above
    problem = _option_problem(q, causal, key_mask, scale, layout, world)
    (b, h, n, d), g, dv = q.shape, k.shape[1], v.shape[-1]
    mod_problem, captured = _modifier_problem(q, score_mod, mask_mod, sinks, n * world)
    problem = problem or mod_problem
    learned = [*captured, *([sinks] if isinstance(sinks, Tensor) else [])]
    return problem, {
        "batch size B": b, "query heads H": h, "key/value heads G": g, "shard length n": n, "head dim D": d,
        "value head dim Dv": dv, "dtype": str(q.dtype), "device type": q.device.type, "causal": causal,
        "layout": layout, "key_mask given": key_mask is not None,
        "scale": None if problem or scale is None else float(scale),  # type: ignore[arg-type]
        "score_mod": _name(score_mod), "mask_mod": _name(mask_mod), "sinks given": sinks is not None,
        "gradients needed": torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *learned)),
    }
