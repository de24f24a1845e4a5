"""Exact ring attention (context parallelism) over torch.distributed.

Each of the P ranks holds a shard of the sequence (see :mod:`.layout`): its
queries (B, H, n, D), keys and values (B, G, n, D) and key mask (B, n). In P
steps the keys, values and key mask travel once around the ring (rank r sends
to r + 1 and receives from r - 1 with ``batch_isend_irecv``, overlapped with
the computation of the block it holds). Each (query chunk, key chunk) pair is
computed by the chunked backend's block kernel
(:func:`attnkit.backends.chunked.block_forward`) and the partial results are
merged by their log-sum-exps, so the result is exact; pairs the causal band
hides entirely are skipped. The backward pass (a custom autograd Function)
recomputes each block with the global log-sum-exp and sends the key / value
gradients around the ring with their keys: no rank ever holds the whole
sequence. Grouped-query keys and values travel with their G heads.

Legend: B batch, H query heads, G key/value heads, n positions per rank, D
head dim, Dv value head dim, P ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.backends.chunked import block_backward, block_forward, block_plan, merge_blocks, softmax_delta
from attnkit.functional import Visibility, block_visibility

from .checks import check_agreement, describe
from .layout import chunk_positions, rank_and_world


@dataclass
class RingTimes:
    """Seconds spent computing blocks and waiting on communication (see :func:`ring_timing`)."""

    compute_s: float = 0.0
    wait_s: float = 0.0


_TIMES: list[RingTimes] = []


@contextmanager
def ring_timing() -> Iterator[RingTimes]:
    """Accumulate this process's compute and wait time of every ring call in the block (CPU timing)."""
    times = RingTimes()
    _TIMES.append(times)
    try:
        yield times
    finally:
        _TIMES.remove(times)


@contextmanager
def _timed(field: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        for times in _TIMES:
            setattr(times, field, getattr(times, field) + time.perf_counter() - start)


@dataclass(frozen=True)
class _Spec:
    """Static facts of one ring call, identical on every rank (checked before the ring starts)."""

    causal: bool
    scale: float
    layout: str
    rank: int
    world: int
    group: Any
    length: int  # T, the whole sequence

    def peer(self, step: int) -> int:
        """The global rank of this rank's neighbour ``step`` places along the ring."""
        group_rank = (self.rank + step) % self.world
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)


class _Exchange:
    """Tensors sent to the next rank while the same number arrive from the previous one."""

    def __init__(self, spec: _Spec, tensors: list[Tensor], tag: int) -> None:
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        nxt, prev = spec.peer(1), spec.peer(-1)
        ops = [dist.P2POp(dist.isend, t, nxt, spec.group, tag + i) for i, t in enumerate(self.sent)]
        ops += [dist.P2POp(dist.irecv, t, prev, spec.group, tag + i) for i, t in enumerate(self.received)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        with _timed("wait_s"):
            for work in self.works:
                work.wait()
        return self.received


def _pairs(spec: _Spec, src: int) -> list[tuple[slice, slice, bool, int]]:
    """(local query slice, local key slice, causal, offset) of each pair of chunks not wholly hidden.

    This rank's query chunks against the key chunks of rank ``src``; offset
    is the difference of their first global positions.
    """
    q_ranges = chunk_positions(spec.rank, spec.world, spec.layout, spec.length)
    k_ranges = chunk_positions(src, spec.world, spec.layout, spec.length)
    size = len(q_ranges[0])
    out = []
    for a, qr in enumerate(q_ranges):
        for b, kr in enumerate(k_ranges):
            offset = qr.start - kr.start
            causal = spec.causal
            if causal:
                seen = block_visibility(range(size), range(size), offset=offset, causal=True, window=None)
                if seen is Visibility.NONE:
                    continue  # a key chunk after every query of this chunk: skipped, never computed
                causal = seen is Visibility.SOME  # only the diagonal chunk needs the band
            out.append((slice(a * size, (a + 1) * size), slice(b * size, (b + 1) * size), causal, offset))
    return out


def _key_mask4(mask: Tensor | None, cols: slice) -> Tensor | None:
    return None if mask is None else mask[:, None, None, cols].bool()  # (B, n) -> (B, 1, 1, Sb)


def _ring_forward(spec: _Spec, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out (B, H, n, Dv) in the compute dtype, lse (B, H, n), -inf where a query sees no key)."""
    held = [k, v] if mask is None else [k, v, mask]
    out: Tensor | None = None
    lse: Tensor | None = None
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = _Exchange(spec, held, tag=0) if step < spec.world - 1 else None
        with _timed("compute_s"):
            for rows, cols, causal, offset in _pairs(spec, src):
                plan = block_plan(q, cols.stop - cols.start, causal=causal, scale=spec.scale, offset=offset)
                o, s = block_forward(plan, q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols],
                                     _key_mask4(held[2] if mask is not None else None, cols))
                if out is None or lse is None:
                    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=o.dtype, device=q.device)  # (B, H, n, Dv)
                    lse = torch.full(q.shape[:-1], -torch.inf, dtype=s.dtype, device=q.device)  # (B, H, n)
                out[:, :, rows], lse[:, :, rows] = merge_blocks(out[:, :, rows], lse[:, :, rows], o, s)
        if pending is not None:
            held = pending.wait()
    assert out is not None and lse is not None  # every rank's own diagonal chunk is visible
    return out, lse


def _ring_backward(spec: _Spec, saved: tuple[Tensor, ...], mask: Tensor | None, dout: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in the compute dtype; dk and dv travel the ring with their keys and come home."""
    q, k, v, out, lse = saved
    compute = out.dtype
    delta = softmax_delta(dout, out, compute)  # (B, H, n)
    dq = torch.zeros(q.shape, dtype=compute, device=q.device)
    held = [k, v] if mask is None else [k, v, mask]
    grads: _Exchange | None = None
    for step in range(spec.world):
        src = (spec.rank - step) % spec.world
        pending = _Exchange(spec, held, tag=0) if step < spec.world - 1 else None
        dk = torch.zeros(k.shape, dtype=compute, device=k.device)  # (B, G, n, D): this rank's share for src
        dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        with _timed("compute_s"):
            for rows, cols, causal, offset in _pairs(spec, src):
                plan = block_plan(q, cols.stop - cols.start, causal=causal, scale=spec.scale, offset=offset)
                dq_b, dk_b, dv_b = block_backward(
                    plan, q[:, :, rows], held[0][:, :, cols], held[1][:, :, cols],
                    _key_mask4(held[2] if mask is not None else None, cols),
                    dout[:, :, rows], lse[:, :, rows], delta[:, :, rows])
                dq[:, :, rows] += dq_b
                dk[:, :, cols] += dk_b
                dv[:, :, cols] += dv_b
        if grads is not None:  # what the ranks before this one added for src
            before_k, before_v = grads.wait()
            dk, dv = dk.add_(before_k), dv.add_(before_v)
        if spec.world == 1:
            return dq, dk, dv
        grads = _Exchange(spec, [dk, dv], tag=8)  # on to the next rank; the last step's reach their owner
        if pending is not None:
            held = pending.wait()
    assert grads is not None
    dk, dv = grads.wait()
    return dq, dk, dv


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: _Spec) -> Tensor:
        out, lse = _ring_forward(spec, q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.spec = spec
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("ring_attention has no double backward (create_graph=True / torch.func.grad); "
                               "take second-order gradients of a single-process attnkit.attention instead")
        *saved, mask = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.spec, tuple(saved), mask, dout.contiguous())
        q, k, v = saved[:3]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_mask: Tensor | None = None,
                   layout: str = "zigzag", group: dist.ProcessGroup | None = None) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``: this rank's output shard.

    Args:
        q: this rank's queries (B, H, n, D), n = T / P positions in ``layout``.
        k, v: this rank's keys (B, G, n, D) and values (B, G, n, Dv); H a
            multiple of G (grouped-query heads, sent unexpanded).
        causal: query at global position i sees keys at positions <= i.
        key_mask: bool (B, n), True = a real token (False = padding), for this
            rank's keys; every rank passes one or none does.
        layout: "zigzag" (balanced under causal) or "contiguous"; how the
            sequence was split (see :func:`attnkit.distributed.shard`).
        group: the process group (default: the world).

    Returns:
        out (B, H, n, Dv): this rank's rows of softmax(q k^T / sqrt(D)) v over
        the whole sequence; a query that sees no key gets 0. Differentiable
        (once) in q, k and v.

    Raises:
        ValueError, on every rank, when the ranks disagree on shapes, dtype,
        device type, layout, causal or the presence of a key mask (one small
        all-gather before the ring), when one rank's arguments are invalid,
        or when no process group is initialised.
    """
    rank, world = rank_and_world(group)
    meta = check_agreement(describe(q, k, v, causal=causal, key_mask=key_mask, layout=layout, world=world),
                           rank=rank, world=world, group=group)
    spec = _Spec(causal, q.shape[-1] ** -0.5, layout, rank, world, group, meta["shard length n"] * world)
    mask = None if key_mask is None else key_mask.to(torch.uint8)  # bytes travel on every backend
    return _RingFunction.apply(q, k, v, mask, spec)
