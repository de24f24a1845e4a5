"""Memory-efficient attention in pure PyTorch: online softmax over key blocks.

For each block of queries, the keys are visited one block at a time. Each
block's probabilities come from one fused ``torch.softmax`` (a faster
exponential than ``exp_``), and its log-sum-exp from two cheap maxima: the
largest probability is exp(m - lse) at the row maximum m, so
lse = m - log(max p). Blocks merge by their log-sum-exps (the online
softmax): only (B, H, Tb, Sb) scores exist at once, never (T, S). Blocks the
causal band or window hides are skipped; fully visible blocks skip the mask.

The block kernel is a small public API, shared by this backend and the ring
of :mod:`attnkit.distributed` (one copy of the math):

- :class:`BlockPlan` / :func:`block_plan`: the static facts of one (queries,
  keys) pair: causal band and its offset, scale, tile sizes;
- :func:`block_forward`: (out, lse) of the queries against these keys alone;
- :func:`merge_into`: a partial result over other keys merged into a running one;
- :func:`softmax_delta` and :func:`block_backward`: the gradients of one
  (queries, keys) pair given the global log-sum-exp and delta = rowsum(dO * O).

The backward pass of the backend (a custom autograd Function) saves only q,
k, v, the output and one log-sum-exp per query, and recomputes each block's
probabilities. Double backward (``create_graph=True``, ``torch.func.grad``)
recomputes the math backend's dense differentiable forward (the one dense
reference): exact, but O(T * S) memory.

Grouped-query heads are handled without copying keys or values: the R = H // G
query heads that share a key/value head are stacked along the query axis.

Modifiers (a plan with ``mods``, see :mod:`.blockmods`): the causal / window
band becomes a mask modifier; each key block is classified by the mask
modifier's block rule before anything is computed (hidden blocks skipped),
the mask modifier is evaluated on a block only where needed, never on (T, S),
and the score modifier runs on each computed block, after the scores and
before the masks; the backward differentiates through it per block by
autograd, for the tensors it closes over too. Learned sinks join each row's
log-sum-exp once, after all key blocks (:func:`.modifiers.add_sinks`).

Legend: B batch, H query heads, G key/value heads, R = H // G, T queries,
S keys, D head dim, Dv value head dim, Tb / Sb block sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnkit.functional import (
    Visibility,
    block_has_empty_rows,
    block_visibility,
    visible_band,
)

from .blockmods import Block, BlockMods, block_mods, captured_tensors
from .call import AttentionCall, compute_dtype
from .math import math_intermediates
from .modifiers import add_sinks, can_branch_on_data, sink_grad
from .registry import Backend, register

_SCORE_BUDGET = 1 << 20  # elements of one block of scores (4 MiB in float32)
_BLOCK_K = 256  # keys per block


@dataclass(frozen=True)
class BlockPlan:
    """Static facts of one (queries, keys) pair, shared by the forward and backward loops.

    ``offset``: query i is aligned with key i + offset (S - T for one
    bottom-right aligned call; the difference of the first global positions
    of a query block and a key block in a ring). ``compute`` is the dtype of
    the arithmetic (float32 for half-precision inputs). ``mods``: score and
    mask modifiers (then ``causal`` and ``window`` are off: the band is in
    the mask modifier).
    """

    causal: bool
    window: int | None
    scale: float
    offset: int
    block_q: int
    block_k: int
    compute: torch.dtype
    mods: BlockMods | None = None

    def blocks(self, length: int, size: int) -> list[range]:
        return [range(i, min(i + size, length)) for i in range(0, length, size)]


def _block_sizes(b: int, h: int, t: int, s: int) -> tuple[int, int]:
    """(queries, keys) per block: B * H * Tb * Sb stays near _SCORE_BUDGET.

    256 x 256 at B * H = 12, the block size measured best (BENCHMARKS.md,
    "Figures moved from docstrings"): larger blocks leave the cache, smaller
    ones pay more per-operation overhead; more batch or heads shrink the
    query block.
    """
    block_k = min(s, _BLOCK_K)
    block_q = max(16, _SCORE_BUDGET // max(1, b * h * block_k))
    return min(t, 1 << (block_q.bit_length() - 1)), block_k  # a power of two, at most T


def block_plan(q: Tensor, num_keys: int, *, causal: bool, scale: float, offset: int,
               window: int | None = None, mods: BlockMods | None = None) -> BlockPlan:
    """The plan for queries q (B, H, T, D) against ``num_keys`` keys."""
    b, h, t, _ = q.shape
    block_q, block_k = _block_sizes(b, h, t, num_keys)
    if mods is not None and (causal or window is not None):
        raise ValueError("a plan with modifiers takes its causal / window band as a mask modifier, not as flags")
    return BlockPlan(causal, window, scale, offset, block_q, block_k, compute_dtype(q.dtype), mods)


def _mask5(mask: Tensor | None, g: int) -> Tensor | None:
    """(B?, H?, T?, S?) -> (B?, G?, R?, T?, S?) to match grouped scores."""
    if mask is None:
        return None
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)  # (B?, 1, T?, S?) -> (B?, 1, 1, T?, S?)
    return mask.unflatten(1, (g, mask.shape[1] // g))  # (B?, H, T?, S?) -> (B?, G, R, T?, S?)


def _block_mask(plan: BlockPlan, mask: Tensor | None, g: int) -> Tensor | None:
    """The mask as the block loops read it: grouped (B?, G?, R?, T?, S?), or 4-d with modifiers."""
    if plan.mods is None or mask is None:
        return _mask5(mask, g)
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # -> (B?, H?, T?, S?)


def _slice(mask: Tensor, rows: range, cols: range) -> Tensor:
    r = slice(rows.start, rows.stop) if mask.shape[-2] > 1 else slice(None)
    c = slice(cols.start, cols.stop) if mask.shape[-1] > 1 else slice(None)
    return mask[..., r, c]


def _scores(plan: BlockPlan, qb: Tensor, kb: Tensor, mask5: Tensor | None, rows: range, cols: range,
            visibility: Visibility) -> Tensor:
    """Masked scores of one block, (B, G, R*Tb, Sb); ``qb`` is already scaled."""
    b, g, rt, _ = qb.shape
    s = torch.matmul(qb, kb.transpose(-2, -1))  # (B, G, R*Tb, D) @ (B, G, D, Sb) -> (B, G, R*Tb, Sb)
    if visibility is Visibility.ALL and mask5 is None:
        return s
    s5 = s.view(b, g, rt // len(rows), len(rows), len(cols))  # (B, G, R*Tb, Sb) -> (B, G, R, Tb, Sb)
    if visibility is Visibility.SOME:
        band = visible_band(rows, cols, offset=plan.offset, causal=plan.causal, window=plan.window,
                            device=s.device)
        if band is not None:
            s5.masked_fill_(~band, -torch.inf)
    if mask5 is not None:
        mb = _slice(mask5, rows, cols)
        if mb.dtype == torch.bool:
            s5.masked_fill_(~mb, -torch.inf)
        else:
            s5.add_(mb.to(s5.dtype))
    return s


def _block_softmax(s: Tensor, masked: bool) -> tuple[Tensor, Tensor]:
    """(softmax(s), logsumexp(s)) over the last dim; a row of all -inf gives lse = -inf. Overwrites s.

    ``masked`` says a row may be all -inf; without it that step is skipped.

    lse comes from the row maximum m and the largest probability exp(m - lse),
    both cheap reductions, instead of a second pass of exponentials.
    """
    m = s.amax(dim=-1, keepdim=True)  # (..., 1)
    empty = m == -torch.inf
    if masked:
        s.masked_fill_(empty, 0.0)  # a finite softmax for rows this block hides entirely (s is ours)
    p = torch.softmax(s, dim=-1)
    lse = (m - p.amax(dim=-1, keepdim=True).log()).masked_fill(empty, -torch.inf)
    return p, lse


def _merge_weights(lse: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Running and block weights exp(lse - new), exp(lse_b - new), and the new lse."""
    new = torch.logaddexp(lse, lse_b)
    safe = new.masked_fill(new == -torch.inf, 0.0)  # nothing seen yet: both weights are 0
    return torch.exp(lse - safe), torch.exp(lse_b - safe), new


def merge_into(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> None:
    """Merge a partial result of the same queries over other keys into (out, lse), in place.

    ``out`` (..., T, Dv) are softmax-normalised over their own keys and ``lse``
    (..., T) their log-sum-exps, -inf where a query saw no key (its out is 0);
    afterwards they cover the union of the keys; ``out_b`` and ``lse_b`` are
    not modified. In place (views included), so merging many small key
    blocks allocates nothing of size T * Dv.
    """
    if out.shape != out_b.shape or lse.shape != lse_b.shape or lse.shape != out.shape[:-1]:
        raise ValueError(f"merge_into needs out, out_b (..., T, Dv) and lse, lse_b (..., T) of one shape; got out "
                         f"{tuple(out.shape)}, lse {tuple(lse.shape)}, out_b {tuple(out_b.shape)}, "
                         f"lse_b {tuple(lse_b.shape)}")
    w, w_b, new = _merge_weights(lse.unsqueeze(-1), lse_b.unsqueeze(-1))  # (..., T, 1) each
    out.mul_(w).addcmul_(out_b, w_b)
    lse.copy_(new.squeeze(-1))


def _visible_blocks(plan: BlockPlan, rows: range, num_keys: int, masked: bool) -> list[Block] | Iterator[Block]:
    """(cols, visibility, whether some row may see nothing, the mask modifier on the block or None) of each
    key block not wholly hidden."""
    if plan.mods is not None:
        return plan.mods.blocks(rows, plan.blocks(num_keys, plan.block_k), plan.offset, masked)
    out: list[Block] = []
    for cols in plan.blocks(num_keys, plan.block_k):
        visibility = block_visibility(rows, cols, offset=plan.offset, causal=plan.causal, window=plan.window)
        if visibility is Visibility.NONE:
            continue
        empty = masked or (visibility is Visibility.SOME and block_has_empty_rows(
            rows, cols, offset=plan.offset, causal=plan.causal, window=plan.window))
        out.append((cols, visibility, empty, None))
    return out


def _block_scores(plan: BlockPlan, qb: Tensor, kb: Tensor, mask: Tensor | None, rows: range, cols: range,
                  visibility: Visibility, keep: Tensor | None) -> Tensor:
    """Masked (and modified) scores of one block, (B, G, R*Tb, Sb), that the caller may overwrite."""
    if plan.mods is None:
        return _scores(plan, qb, kb, mask, rows, cols, visibility)
    s = torch.matmul(qb, kb.transpose(-2, -1))  # (B, G, R*Tb, D) @ (B, G, D, Sb) -> (B, G, R*Tb, Sb)
    mb = None if mask is None else _slice(mask, rows, cols)  # (B?, H?, Tb?, Sb?)
    return plan.mods.modify(s, mb, rows, cols, plan.offset, keep, inplace=True)


def _group(x: Tensor, g: int, rows: range, compute: torch.dtype) -> Tensor:
    """Rows of (B, H, T, E) for one query block, grouped: (B, G, R*Tb, E). May be a view of x."""
    b, h, _, e = x.shape
    block = x[:, :, rows.start:rows.stop].to(compute)  # (B, H, Tb, E)
    return block.reshape(b, g, (h // g) * len(rows), e)  # (B, G, R, Tb, E) -> (B, G, R*Tb, E)


def _ungroup(x: Tensor, h: int, rows: range) -> Tensor:
    b, _, _, e = x.shape
    return x.reshape(b, h, len(rows), e)  # (B, G, R*Tb, E) -> (B, H, Tb, E)


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def _forward_rows(plan: BlockPlan, qb: Tensor, kc: Tensor, vc: Tensor, mask5: Tensor | None,
                  rows: range) -> tuple[Tensor, Tensor]:
    """(acc (B, G, R*Tb, Dv), lse (B, G, R*Tb, 1)) of one query block over every visible key block.

    ``mask5`` is the grouped mask (B?, G?, R?, T?, S?), or the 4-d one in a plan with modifiers.
    """
    acc: Tensor | None = None
    lse = torch.full_like(qb[..., :1], -torch.inf)  # (B, G, R*Tb, 1): nothing seen yet
    for cols, visibility, empty, keep in _visible_blocks(plan, rows, kc.shape[2], mask5 is not None):
        s = _block_scores(plan, qb, kc[:, :, cols.start:cols.stop], mask5, rows, cols, visibility, keep)
        p, lse_b = _block_softmax(s, masked=empty)
        old, new, lse = _merge_weights(lse, lse_b)
        pv = torch.matmul(p, vc[:, :, cols.start:cols.stop])  # (B, G, R*Tb, Sb) @ (B, G, Sb, Dv)
        acc = pv.mul_(new) if acc is None else acc.mul_(old).add_(pv.mul_(new))
    if acc is None:  # every key block hidden (causal queries before the first key)
        acc = torch.zeros_like(qb[..., :1]).expand(*qb.shape[:-1], vc.shape[-1])  # (B, G, R*Tb, Dv)
    return acc, lse


def block_forward(plan: BlockPlan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
    """Attention of q (B, H, T, D) over these keys alone: (out, lse).

    k (B, G, S, D), v (B, G, S, Dv); ``mask`` bool (True = may attend) or
    float, broadcastable to (B, H, T, S); the causal band comes from ``plan``.
    Returns out (B, H, T, Dv) and lse (B, H, T), both in ``plan.compute``; a
    query that sees no key gets out 0 and lse -inf. Inputs are not modified
    (``torch.func.vmap`` works through it).
    """
    b, h, t, _ = q.shape
    g = k.shape[1]
    kc, vc, mask5 = k.to(plan.compute), v.to(plan.compute), _block_mask(plan, mask, g)
    outs, lses = [], []
    for rows in plan.blocks(t, plan.block_q):
        qb = _group(q, g, rows, plan.compute) * plan.scale  # (B, G, R*Tb, D); a new tensor, q untouched
        acc, lse = _forward_rows(plan, qb, kc, vc, mask5, rows)
        outs.append(_ungroup(acc, h, rows))  # (B, H, Tb, Dv)
        lses.append(lse.reshape(b, h, len(rows)))  # (B, G, R*Tb, 1) -> (B, H, Tb)
    return _cat(outs, 2), _cat(lses, 2)


def softmax_delta(dout: Tensor, out: Tensor, compute: torch.dtype) -> Tensor:
    """delta = rowsum(dO * O), (B, H, T): the softmax backward's correction, once per query."""
    return (dout.to(compute) * out.to(compute)).sum(dim=-1)  # (B, H, T, Dv) -> (B, H, T)


def block_backward(plan: BlockPlan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dout: Tensor,
                   lse: Tensor, delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients (dq, dk, dv) in ``plan.compute`` of one (queries, keys) pair.

    ``lse`` (B, H, T) is the log-sum-exp of each query over *all* its keys
    (-inf where it sees none) and ``delta`` (B, H, T) = :func:`softmax_delta`
    of the whole output: with them, the gradients of disjoint key sets add up.
    """
    dq, dk, dv, _ = block_gradients(plan, q, k, v, mask, dout, lse, delta)
    return dq, dk, dv


def block_gradients(plan: BlockPlan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dout: Tensor,
                    lse: Tensor, delta: Tensor, captured: tuple[Tensor, ...] = ()
                    ) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None]]:
    """:func:`block_backward`, and the gradients of the tensors ``captured`` by the plan's score modifier
    (None where a tensor received none)."""
    b, h, t, _ = q.shape
    g = k.shape[1]
    kc, vc, mask5 = k.to(plan.compute), v.to(plan.compute), _block_mask(plan, mask, g)
    lse = lse.masked_fill(lse == -torch.inf, torch.inf)  # a query that sees nothing: weights exp(s - inf) = 0
    dqs: list[Tensor] = []
    dks: list[Tensor | None] = [None] * len(plan.blocks(k.shape[2], plan.block_k))
    dvs: list[Tensor | None] = list(dks)
    dcaptured: list[Tensor | None] = [None] * len(captured)
    for rows in plan.blocks(t, plan.block_q):
        qb = _group(q, g, rows, plan.compute) * plan.scale  # (B, G, R*Tb, D), scaled
        dob = _group(dout, g, rows, plan.compute)  # (B, G, R*Tb, Dv)
        rt = (h // g) * len(rows)
        lse_b = lse[:, :, rows.start:rows.stop].reshape(b, g, rt, 1)  # (B, H, Tb) -> (B, G, R*Tb, 1)
        delta_b = delta[:, :, rows.start:rows.stop].reshape(b, g, rt, 1)
        dqb: Tensor | None = None
        for cols, visibility, empty, keep in _visible_blocks(plan, rows, k.shape[2], mask5 is not None):
            i = cols.start // plan.block_k
            kb, vb = kc[:, :, cols.start:cols.stop], vc[:, :, cols.start:cols.stop]
            through = None
            if plan.mods is None:
                s = _scores(plan, qb, kb, mask5, rows, cols, visibility)
                p, block_lse = _block_softmax(s, masked=empty)
                p = p.mul_(torch.exp(block_lse - lse_b))  # the weights exp(s - lse) of the whole row
            else:
                raw = torch.matmul(qb, kb.transpose(-2, -1))  # (B, G, R*Tb, D) @ (B, G, D, Sb) -> (B, G, R*Tb, Sb)
                mb = None if mask5 is None else _slice(mask5, rows, cols)  # (B?, H?, Tb?, Sb?)
                p, through = plan.mods.weights(raw, mb, rows, cols, plan.offset, keep, lse_b, captured, dcaptured)
            dv_b = torch.matmul(p.transpose(-2, -1), dob)  # (B, G, Sb, R*Tb) @ (B, G, R*Tb, Dv) -> (B, G, Sb, Dv)
            ds = torch.matmul(dob, vb.transpose(-2, -1)).sub_(delta_b).mul_(p)  # dscore, (B, G, R*Tb, Sb)
            if through is not None:
                ds = through(ds)  # d score_mod(s) -> d s
            dk_b = torch.matmul(ds.transpose(-2, -1), qb)  # (B, G, Sb, D); qb carries the scale
            dq_b = torch.matmul(ds, kb)  # (B, G, R*Tb, D)
            dvs[i] = dv_b if dvs[i] is None else dvs[i].add_(dv_b)  # type: ignore[union-attr]
            dks[i] = dk_b if dks[i] is None else dks[i].add_(dk_b)  # type: ignore[union-attr]
            dqb = dq_b if dqb is None else dqb.add_(dq_b)
        dqb = torch.zeros_like(qb) if dqb is None else dqb.mul_(plan.scale)
        dqs.append(_ungroup(dqb, h, rows))  # (B, H, Tb, D)
    cols_all = plan.blocks(k.shape[2], plan.block_k)
    dk = _cat([torch.zeros_like(kc[:, :, c.start:c.stop]) if x is None else x
               for x, c in zip(dks, cols_all, strict=True)], 2)  # (B, G, S, D); zeros where no query looked
    dv = _cat([torch.zeros_like(vc[:, :, c.start:c.stop]) if x is None else x
               for x, c in zip(dvs, cols_all, strict=True)], 2)  # (B, G, S, Dv)
    return _cat(dqs, 2), dk, dv, dcaptured


class _ChunkedFunction(torch.autograd.Function):
    """out = attention(q, k, v) by :func:`block_forward`; backward by :func:`block_gradients`.

    Inputs: q, k, v, mask, plan, sinks (H,) or None, then the tensors the
    plan's score modifier closes over, which receive gradients too. Written
    for ``torch.func`` (setup_context, a generated vmap rule, no in-place op
    on an input). Under ``create_graph=True`` (and ``torch.func.grad``) the
    backward recomputes a dense differentiable forward, so second-order
    gradients are exact (at O(T * S) memory).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, plan: BlockPlan, sinks: Tensor | None,
                *captured: Tensor) -> tuple[Tensor, Tensor]:
        out, lse = block_forward(plan, q, k, v, mask)
        if sinks is not None:
            out, lse = add_sinks(out, lse, sinks)
        return out.to(q.dtype), lse

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        q, k, v, mask, plan, sinks, *captured = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, mask, sinks, *captured)
        ctx.plan = plan

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, mask, sinks, *captured = ctx.saved_tensors
        plan: BlockPlan = ctx.plan
        needed = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: the gradient must itself be differentiable
            dq, dk, dv, dsinks, *dcaptured = _differentiable_grads(
                plan, (q, k, v, sinks, *captured), mask, dout, (*needed[:3], *needed[5:]))
            return dq, dk, dv, None, None, dsinks, *dcaptured
        delta = softmax_delta(dout, out, plan.compute)
        dq, dk, dv, dcaptured = block_gradients(plan, q, k, v, mask, dout, lse, delta, tuple(captured))
        dsinks = sink_grad(sinks, lse, delta) if sinks is not None and needed[5] else None
        dcaptured = [None if grad is None else grad.to(x.dtype) for grad, x in zip(dcaptured, captured, strict=True)]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, dsinks, *dcaptured


def _differentiable_grads(plan: BlockPlan, inputs: tuple[Tensor | None, ...], mask: Tensor | None,
                          dout: Tensor, needed: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """Gradients of (q, k, v, sinks, *captured) with a graph of their own, through the dense forward
    (None where not needed)."""
    wanted = [x for x, need in zip(inputs, needed, strict=True) if need and x is not None]
    q, k, v, sinks = inputs[:4]
    assert q is not None and k is not None and v is not None
    if plan.offset != k.shape[2] - q.shape[2] or (plan.mods is not None and plan.mods.key_start != 0):
        raise ValueError(f"the dense path aligns queries bottom-right (offset S - T = {k.shape[2] - q.shape[2]}), "
                         f"got a plan with offset={plan.offset}")
    mods = plan.mods
    explicit = (None, None) if mods is None or mods.q_pos is None or mods.k_pos is None else (
        mods.q_pos[:, 0, :, 0], mods.k_pos[:, 0, 0, :])  # (B, 1, T, 1) -> (B, T), (B, 1, 1, S) -> (B, S)
    call = AttentionCall(q, k, v, mask, plan.causal, plan.window, plan.scale, 0.0,
                         None if mods is None else mods.score_mod, None if mods is None else mods.mask_mod, sinks,
                         *explicit)
    with torch.enable_grad():
        out = math_intermediates(call).out  # the math backend, differentiable: one dense reference
        grads = iter(torch.autograd.grad(out, wanted, dout, create_graph=True, allow_unused=True))
    return tuple(next(grads) if need and x is not None else None for x, need in zip(inputs, needed, strict=True))


def _plan(call: AttentionCall) -> BlockPlan:
    if not call.modified:
        return block_plan(call.q, call.num_keys, causal=call.causal, scale=call.scale, offset=call.offset,
                          window=call.window)
    explicit = None if call.q_pos is None or call.k_pos is None else (call.q_pos, call.k_pos)
    batch = call.q.shape[0]
    mods = block_mods(call.score_mod, call.visibility_mod(), batch=batch, num_heads=call.num_heads,
                      q_positions=call.q_positions, kv_positions=call.kv_positions, device=call.q.device,
                      explicit=explicit, shape=(batch, call.num_heads, call.num_queries, call.num_keys))
    return block_plan(call.q, call.num_keys, causal=False, scale=call.scale, offset=call.offset, mods=mods)


def chunked_attention(call: AttentionCall) -> Tensor:
    """The backend: :func:`block_forward` without gradients, else the autograd Function.

    Under torch.compile and torch.func, a call with a score modifier that may
    need gradients takes the dense math path: they trace neither the search
    for the tensors the modifier closes over nor the backward's per-block autograd.
    """
    plan = _plan(call)
    captured: tuple[Tensor, ...] = ()
    if torch.is_grad_enabled() and plan.mods is not None and plan.mods.score_mod is not None:
        if not can_branch_on_data(call.q):  # dynamo and torch.func trace neither the recording mode nor the
            return math_intermediates(call).out  # per-block autograd.grad: the dense path, closures included
        probe = torch.zeros(call.q.shape[0], call.num_heads, 1, 1, dtype=plan.compute, device=call.q.device)
        captured = captured_tensors(plan.mods.score_mod, probe, plan.mods, plan.offset)
    inputs = (call.q, call.k, call.v, *captured, *(() if call.sinks is None else (call.sinks,)))
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in inputs)
    if not needs_grad:
        out, lse = block_forward(plan, call.q, call.k, call.v, call.mask)
        if call.sinks is not None:
            out, _ = add_sinks(out, lse, call.sinks)
        return out.to(call.q.dtype)
    return _ChunkedFunction.apply(call.q, call.k, call.v, call.mask, plan, call.sinks, *captured)[0]


def _why_not(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return f"it has no dropout (dropout_p={call.dropout_p}); use 'sdpa' or 'math'"
    if call.mask is not None and call.mask.requires_grad:
        return "it does not differentiate through a float mask; use 'sdpa' or 'math'"
    return None


register(Backend(
    name="chunked",
    run=chunked_attention,
    why_not=_why_not,
))
