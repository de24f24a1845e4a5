"""Exact ring attention (context parallelism) over torch.distributed.

Each of the P ranks holds a shard of the sequence (see :mod:`.layout`): its
queries (B, H, n, D), keys and values (B, G, n, D) and key mask (B, n). The
keys, values and key mask travel once around the ring (rank r sends to r + 1
and receives from r - 1 with ``batch_isend_irecv``) in *pieces*: piece j of a
shard is the j-th 1/8 of each of its chunks. All ranks follow one schedule:
at each tick every rank computes one piece, piece j of the rank h places
before it, while it passes that piece on and receives the next one, so
communication overlaps computation and a rank holds two pieces in flight
(about n / 4 positions), never a whole extra shard. Under the zigzag layout
every rank has the same causal work in every tick, not only in total.

Each (query chunk, key piece) pair is computed by the chunked backend's block
kernel (:func:`attnkit.backends.chunked.block_forward`) and merged into the
running output by log-sum-exps (:func:`~attnkit.backends.chunked.merge_into`),
so the result is exact; pairs the causal band hides entirely are skipped.

Score and mask modifiers (FlexAttention's form, see
:mod:`attnkit.functional.modifiers`) see global positions: each pair's
:class:`~attnkit.backends.blockmods.BlockMods` places its query chunk and key
piece where they sit in the whole sequence, the causal band becomes a mask
modifier, and a built-in's block rule skips the pairs it hides before anything
is computed (as it skips blocks inside the kernel). Learned sinks join each
row's log-sum-exp once, after every piece is merged.

The backward pass (a custom autograd Function) recomputes each pair with the
global log-sum-exp. Key / value gradients travel with their piece, two ticks
a hop (computed, then sent while the next piece is computed), and after the
last rank go home to the rank that owns them: no rank ever holds the whole
sequence. Grouped-query keys and values travel with their G heads. The
gradients of sinks and of the tensors a score modifier closes over are each
rank's share (from its own queries), summed over ranks as a replicated
parameter's are.

Legend: B batch, H query heads, G key/value heads, n positions per rank, D
head dim, Dv value head dim, P ranks, C chunks per rank (1 or 2), m pieces
per shard, L positions of a chunk in one piece.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from attnkit.backends.blockmods import BlockMods, block_mods
from attnkit.backends.call import compute_dtype
from attnkit.backends.chunked import BlockPlan, block_forward, block_gradients, block_plan, merge_into, softmax_delta
from attnkit.backends.modifiers import add_sinks, sink_grad
from attnkit.functional import Visibility, and_masks, block_visibility, key_padding_to_mask
from attnkit.functional import causal as causal_band
from attnkit.functional.modifiers import MaskMod, ScoreMod

from .checks import captured_by, describe
from .group import check_agreement, rank_and_world
from .layout import chunk_positions
from .timing import COMPUTE_EVENT, WAIT_EVENT, timed

_PIECES = 8  # pieces per shard: two in flight are n / 4 positions at any P
_MIN_PIECE_ROWS = 128  # positions of a chunk per piece: smaller blocks cost the kernel more than they save


def _piece_rows(chunk: int) -> int:
    """Positions of each chunk in one piece: 1/8 of the chunk, at least 128, at most the chunk."""
    return min(chunk, max(_MIN_PIECE_ROWS, -(-chunk // _PIECES)))


@dataclass(frozen=True)
class RingSpec:
    """Static facts of one ring call, identical on every rank (checked before the ring starts).

    With :func:`phase`, :func:`hop_tick` and :func:`blocks` it plans the whole
    schedule without processes: which piece each rank computes at each tick,
    and which (query chunk, key piece) pairs it computes or skips.
    """

    causal: bool
    scale: float
    layout: str
    rank: int
    world: int
    group: Any
    length: int  # T, the whole sequence
    mods: BlockMods | None = None  # score / mask modifiers over the whole sequence (the causal band included)

    def peer(self, step: int) -> int:
        """The global rank of this rank's neighbour ``step`` places along the ring."""
        group_rank = (self.rank + step) % self.world
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def chunks(self, rank: int) -> list[range]:
        """The global positions of each chunk ``rank`` holds, in local order."""
        return chunk_positions(rank, self.world, self.layout, self.length)

    def pieces(self) -> list[range]:
        """Piece j's positions within each chunk (the same in every chunk and on every rank)."""
        size = len(self.chunks(0)[0])
        rows = _piece_rows(size)
        return [range(i, min(i + rows, size)) for i in range(0, size, rows)]


def hop_tick(index: int, hops: int, world: int, hop_ticks: int) -> int:
    """When piece ``index`` makes its ``hops``-th hop: pieces go round in groups of ``hop_ticks``, interleaved."""
    return hop_ticks * world * (index // hop_ticks) + hop_ticks * hops + index % hop_ticks


def phase(tick: int, world: int, num_pieces: int, hop_ticks: int) -> tuple[int, int] | None:
    """(piece j, hops h) that every rank computes at ``tick`` (piece j of rank r - h), or None when idle.

    The inverse of :func:`hop_tick`: with one tick a hop (the forward pass) piece j
    visits the ranks at ticks jP .. jP + P - 1; with two (the backward pass,
    which sends a piece only after computing it) pieces 2i and 2i + 1 take
    turns over ticks 2iP .. 2iP + 2P - 1.
    """
    group, rest = divmod(tick, hop_ticks * world)
    hops, turn = divmod(rest, hop_ticks)
    index = hop_ticks * group + turn
    return (index, hops) if tick >= 0 and index < num_pieces else None


class _Exchange:
    """Tensors sent to the next rank while the previous one's arrive in ``received`` (empty buffers)."""

    def __init__(self, spec: RingSpec, sent: list[Tensor], received: list[Tensor]) -> None:
        self.received = received
        nxt, prev = spec.peer(1), spec.peer(-1)
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, spec.group, tag) for tag, t in enumerate(sent)]
        ops += [dist.P2POp(dist.irecv, t, prev, spec.group, tag) for tag, t in enumerate(self.received)]
        self.works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> list[Tensor]:
        with timed(WAIT_EVENT):
            for work in self.works:
                work.wait()
        return self.received


def blocks(spec: RingSpec, q: Tensor, src: int, keys: range) -> list[tuple[slice, slice, BlockPlan]]:
    """(piece columns, local query rows, plan) of each (query chunk, key chunk part) pair not hidden.

    A piece of rank ``src`` holds positions ``keys`` of each of its chunks, one
    after the other; a plan's offset is the difference of the first global
    positions of the query chunk and the key part (query i sees key j when
    j <= i + offset), and its modifiers start at the key part's global position.
    """
    q_chunks = spec.chunks(spec.rank)
    size, width = len(q_chunks[0]), len(keys)
    out = []
    for c, k_chunk in enumerate(spec.chunks(src)):
        cols = slice(c * width, (c + 1) * width)
        first_key = k_chunk.start + keys.start
        mods = None if spec.mods is None else replace(spec.mods, key_start=first_key)
        for a, q_chunk in enumerate(q_chunks):
            offset = q_chunk.start - first_key
            if mods is not None:
                seen = mods.visibility(range(size), range(width), offset)  # the block rule, or None: unknown
            elif spec.causal:
                seen = block_visibility(range(size), range(width), offset=offset, causal=True, window=None)
            else:
                seen = Visibility.ALL
            if seen is Visibility.NONE:
                continue  # hidden from every query of this chunk: skipped, never computed
            causal = mods is None and seen is Visibility.SOME  # only pairs that cross the diagonal need the band
            plan = block_plan(q, width, causal=causal, scale=spec.scale, offset=offset, mods=mods)
            out.append((cols, slice(a * size, (a + 1) * size), plan))
    return out


def _key_mask4(mask: Tensor | None) -> Tensor | None:
    return None if mask is None else key_padding_to_mask(mask.bool())  # (B, S) -> (B, 1, 1, S)


def _buffer(x: Tensor, width: int) -> Tensor:
    """An empty piece of ``width`` positions: (B, G, n, D) -> (B, G, width, D), (B, n) -> (B, width)."""
    shape = (*x.shape[:2], width, *x.shape[3:]) if x.dim() == 4 else (x.shape[0], width)
    return torch.empty(shape, dtype=x.dtype, device=x.device)


def _cut(x: Tensor, keys: range, size: int, chunks: int) -> Tensor:
    """Positions ``keys`` of each chunk of a local tensor, along dim 2 (dim 1 for a key mask).

    (B, G, n, D) -> (B, G, C*L, D); a view when the rank has one chunk.
    """
    dim = 2 if x.dim() == 4 else 1
    parts = [x.narrow(dim, c * size + keys.start, len(keys)) for c in range(chunks)]
    return parts[0] if chunks == 1 else torch.cat(parts, dim=dim)  # (B, G, C*L, D)


def _ring_forward(spec: RingSpec, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out (B, H, n, Dv) in the compute dtype, lse (B, H, n), -inf where a query sees no key)."""
    pieces, chunks = spec.pieces(), len(spec.chunks(0))
    size = q.shape[2] // chunks
    local = [k, v] if mask is None else [k, v, mask]
    last = spec.world - 1
    compute = compute_dtype(q.dtype)
    acc = (torch.zeros(*q.shape[:-1], v.shape[-1], dtype=compute, device=q.device),  # (B, H, n, Dv)
           torch.full(q.shape[:-1], -torch.inf, dtype=compute, device=q.device))  # (B, H, n): nothing seen yet
    arrived: list[Tensor] = []
    for tick in range(len(pieces) * spec.world):
        index, hops = phase(tick, spec.world, len(pieces), 1)  # type: ignore[misc]  # never idle
        held = [_cut(x, pieces[index], size, chunks) for x in local] if hops == 0 else arrived
        following = phase(tick + 1, spec.world, len(pieces), 1)  # from rank r - 1, unless it is our own
        coming = [] if following is None or following[1] == 0 else [
            _buffer(x, chunks * len(pieces[following[0]])) for x in local]
        exchange = _Exchange(spec, held if hops < last else [], coming)
        with timed(COMPUTE_EVENT):
            _forward_piece(spec, q, (spec.rank - hops) % spec.world, pieces[index], held, acc)
        arrived = exchange.wait()
    return acc


def _forward_piece(spec: RingSpec, q: Tensor, src: int, keys: range, held: list[Tensor],
                   acc: tuple[Tensor, Tensor]) -> None:
    """Merge this rank's attention over one piece of rank ``src`` into ``acc`` = (out (B, H, n, Dv), lse (B, H, n))."""
    kp, vp, *mp = held
    for cols, rows, plan in blocks(spec, q, src, keys):
        o, s = block_forward(plan, q[:, :, rows], kp[:, :, cols], vp[:, :, cols],
                             _key_mask4(mp[0][:, cols] if mp else None))
        merge_into(acc[0][:, :, rows], acc[1][:, :, rows], o, s)


@dataclass
class _Queries:
    """This rank's side of the backward pass: its queries' tensors, and the gradients they collect.

    q (B, H, n, D), dout (B, H, n, Dv), lse and delta (B, H, n) in the compute
    dtype, dq (B, H, n, D); ``captured``: the tensors the score modifier closes
    over, whose gradients (this rank's share) add up in ``dcaptured``.
    """

    q: Tensor
    dout: Tensor
    lse: Tensor
    delta: Tensor
    dq: Tensor
    captured: tuple[Tensor, ...] = ()
    dcaptured: list[Tensor | None] = field(default_factory=list)


def _ring_backward(spec: RingSpec, k: Tensor, v: Tensor, mask: Tensor | None, mine: _Queries) -> tuple[Tensor, Tensor]:
    """(dk, dv) in the compute dtype, adding into ``mine``'s dq; key / value gradients travel with their
    piece and come home."""
    compute = mine.dq.dtype
    dk = torch.zeros(k.shape, dtype=compute, device=k.device)  # (B, G, n, D): filled piece by piece at home
    dv = torch.zeros(v.shape, dtype=compute, device=v.device)
    pieces, chunks = spec.pieces(), len(spec.chunks(0))
    size = k.shape[2] // chunks
    local = [k, v] if mask is None else [k, v, mask]
    last = spec.world - 1

    def own_piece(index: int) -> list[Tensor]:  # k, v, (mask,) and zero dk, dv of one of this rank's pieces
        width = chunks * len(pieces[index])
        return [_cut(x, pieces[index], size, chunks) for x in local] + [_buffer(g, width).zero_() for g in (dk, dv)]

    def buffers(index: int, with_keys: bool) -> list[Tensor]:  # where a piece from rank r - 1 arrives
        width = chunks * len(pieces[index])
        return [_buffer(x, width) for x in ((*local, dk, dv) if with_keys else (dk, dv))]

    def home(index: int, grads: list[Tensor]) -> None:  # a piece's gradients after the whole ring
        for g, got in zip((dk, dv), grads, strict=True):
            for c, part in enumerate(got.chunk(chunks, dim=2)):  # (B, G, C*L, D) -> (B, G, L, D) each
                g[:, :, c * size + pieces[index].start:c * size + pieces[index].stop] = part

    done: tuple[int, int, list[Tensor]] | None = None  # computed last tick: sent on (or home) this tick
    arrived: list[Tensor] = []
    ticks = hop_tick(len(pieces) - 1, last, spec.world, 2) + (2 if last else 1)  # + the last trip home
    for tick in range(ticks):
        coming = phase(tick - 1, spec.world, len(pieces), 2) if last else None  # what rank r - 1 computed
        sent = [] if done is None or not last else done[2] if done[1] < last else done[2][-2:]
        exchange = _Exchange(spec, sent, [] if coming is None else buffers(coming[0], with_keys=coming[1] < last))
        now = phase(tick, spec.world, len(pieces), 2)
        done = None
        if now is not None:
            index, hops = now
            held = own_piece(index) if hops == 0 else arrived
            with timed(COMPUTE_EVENT):
                _backward_piece(spec, mine, (spec.rank - hops) % spec.world, pieces[index], held)
            done = (index, hops, held)
            if not last:  # one rank: the piece is home after its only computation
                home(index, held[-2:])
        received = exchange.wait()
        if coming is not None and coming[1] < last:
            arrived = received
        elif coming is not None:  # rank r - 1 was the piece's last stop: its gradients are this rank's
            home(coming[0], received)
    return dk, dv


def _backward_piece(spec: RingSpec, mine: _Queries, src: int, keys: range, held: list[Tensor]) -> None:
    """Add this rank's share of one piece's gradients: into dq (and the captured tensors'), and into the
    piece's own dk, dv (``held`` = the piece's k, v, (key mask,) dk, dv)."""
    kp, vp, *mp, dkp, dvp = held
    for cols, rows, plan in blocks(spec, mine.q, src, keys):
        dq_b, dk_b, dv_b, dcaptured = block_gradients(
            plan, mine.q[:, :, rows], kp[:, :, cols], vp[:, :, cols], _key_mask4(mp[0][:, cols] if mp else None),
            mine.dout[:, :, rows], mine.lse[:, :, rows], mine.delta[:, :, rows], mine.captured)
        mine.dq[:, :, rows] += dq_b
        dkp[:, :, cols] += dk_b
        dvp[:, :, cols] += dv_b
        for i, grad in enumerate(dcaptured):
            if grad is not None:
                total = mine.dcaptured[i]
                mine.dcaptured[i] = grad if total is None else total + grad


class _RingFunction(torch.autograd.Function):
    """out = ring attention of q, k, v (and sinks); inputs q, k, v, mask, spec, sinks or None, then the
    tensors the score modifier closes over, which receive this rank's share of their gradients."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, spec: RingSpec,
                sinks: Tensor | None, *captured: Tensor) -> Tensor:
        out, lse = _ring_forward(spec, q, k, v, mask)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)  # (B, H, n, Dv), (B, H, n) over keys and sink
        ctx.save_for_backward(q, k, v, out, lse, mask, sinks, *captured)
        ctx.spec = spec
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("ring_attention has no double backward (create_graph=True / torch.func.grad); "
                               "take second-order gradients of a single-process attnkit.attention instead")
        q, k, v, out, lse, mask, sinks, *captured = ctx.saved_tensors
        delta = softmax_delta(dout, out, out.dtype)  # (B, H, n)
        mine = _Queries(q, dout.contiguous(), lse, delta, torch.zeros(q.shape, dtype=out.dtype, device=q.device),
                        tuple(captured), [None] * len(captured))
        dk, dv = _ring_backward(ctx.spec, k, v, mask, mine)
        dsinks = sink_grad(sinks, lse, delta) if sinks is not None and ctx.needs_input_grad[5] else None
        dcaptured = [None if g is None else g.to(x.dtype) for g, x in zip(mine.dcaptured, captured, strict=True)]
        return mine.dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks, *dcaptured


def _modifiers(q: Tensor, causal: bool, score_mod: ScoreMod | None, mask_mod: MaskMod | None,
               length: int) -> BlockMods | None:
    """The modifiers of the whole sequence (0 .. length - 1), the causal band and-ed into the mask modifier."""
    if score_mod is None and mask_mod is None:
        return None
    band = causal_band() if causal else None
    visibility = mask_mod if band is None else band if mask_mod is None else and_masks(band, mask_mod)
    return block_mods(score_mod, visibility, batch=q.shape[0], num_heads=q.shape[1], q_positions=range(length),
                      kv_positions=range(length), device=q.device)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_mask: Tensor | None = None,
                   scale: float | None = None, layout: str = "zigzag", group: dist.ProcessGroup | None = None,
                   score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None, sinks: Tensor | None = None
                   ) -> Tensor:
    """Exact attention over a sequence sharded across the ranks of ``group``: this rank's output shard.

    Args:
        q: this rank's queries (B, H, n, D), n = T / P positions in ``layout``.
        k, v: this rank's keys (B, G, n, D) and values (B, G, n, Dv); H a
            multiple of G (grouped-query heads, sent unexpanded).
        causal: query at global position i sees keys at positions <= i.
        key_mask: bool (B, n), True = a real token (False = padding), for this
            rank's keys; every rank passes one or none does.
        scale: multiplies the scores; None means 1 / sqrt(D). Every rank
            passes the same.
        layout: "zigzag" (balanced under causal) or "contiguous"; how the
            sequence was split (see :func:`attnkit.distributed.shard`).
        group: the process group (default: the world).
        score_mod, mask_mod: modifiers in FlexAttention's form, as
            :func:`attnkit.attention` takes them, of the *whole* sequence:
            q_idx and kv_idx are global positions 0 .. T - 1 (what a document
            mask's ids or a prefix length label), whichever rank holds them.
            mask_mod is and-ed with ``causal`` and ``key_mask``; a built-in's
            block rule skips the pairs it hides. Every rank passes the same.
        sinks: (H,) learned sink logits, one per query head, or None, as
            :func:`attnkit.attention` takes them. Every rank passes the same.

    Returns:
        out (B, H, n, Dv): this rank's rows of softmax(q k^T * scale) v over
        the whole sequence; a query that sees no key gets 0. Differentiable
        (once) in q, k and v, and in ``sinks`` and the tensors ``score_mod``
        closes over (learned slopes, a learned cap): these get this rank's
        share, from its own queries, so that their gradients summed over
        ranks (an all-reduce, as for any replicated parameter) are the
        single-process gradients.

    Memory: besides its own tensors, a rank holds two travelling pieces of
    keys and values (1/8 of a shard each, at least 128 positions of each
    chunk) in the forward pass, three with their gradients in the backward
    pass: what one rank holds falls close to 1/P of a single process.

    Raises:
        ValueError, on every rank, when the ranks disagree on shapes, dtype,
        device type, layout, causal, scale, the presence of a key mask or
        sinks, the modifiers (by name) or whether gradients are needed (one
        small all-gather before the ring), when one rank's arguments are
        invalid (a modifier is checked at the whole sequence's positions and
        evaluated once at (0, 0)), or when no process group is initialised.
    """
    rank, world = rank_and_world(group)
    meta = check_agreement(describe(q, k, v, causal=causal, key_mask=key_mask, scale=scale, layout=layout,
                                    world=world, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks),
                           rank=rank, world=world, group=group)
    scale = q.shape[-1] ** -0.5 if meta["scale"] is None else meta["scale"]
    length = meta["shard length n"] * world  # T
    mods = _modifiers(q, causal, score_mod, mask_mod, length)
    spec = RingSpec(causal, scale, layout, rank, world, group, length, mods)
    captured = captured_by(score_mod, q, length) if meta["gradients needed"] else ()
    mask = None if key_mask is None else key_mask.to(torch.uint8)  # bytes travel on every backend
    return _RingFunction.apply(q, k, v, mask, spec, sinks, *captured)
