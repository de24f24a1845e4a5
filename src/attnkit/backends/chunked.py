"""Memory-efficient attention in pure PyTorch: online softmax over key blocks.

For each block of queries, the keys are visited one block at a time. Each
block's probabilities come from one fused ``torch.softmax`` (a faster
exponential than ``exp_``), and its log-sum-exp from two cheap maxima: the
largest probability is exp(m - lse) at the row maximum m, so
lse = m - log(max p). Blocks merge by their log-sum-exps (the online
softmax): only (B, H, Tb, Sb) scores exist at once, never (T, S). Blocks the
causal band or window hides are skipped; fully visible blocks skip the mask.

The backward pass (a custom autograd Function) saves only q, k, v, the output
and one log-sum-exp per query, and recomputes each block's probabilities.

Grouped-query heads are handled without copying keys or values: the R = H // G
query heads that share a key/value head are stacked along the query axis.

Legend: B batch, H query heads, G key/value heads, R = H // G, T queries,
S keys, D head dim, Dv value head dim, Tb / Sb block sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.functional import block_has_empty_rows, block_visibility, visible_band

from .call import AttentionCall
from .registry import Backend, register

_SCORE_BUDGET = 1 << 20  # elements of one block of scores (4 MiB in float32)
_BLOCK_K = 256  # keys per block


@dataclass(frozen=True)
class _Plan:
    """Static facts of one call, shared by the forward and backward loops."""

    causal: bool
    window: int | None
    scale: float
    offset: int  # S - T
    block_q: int
    block_k: int
    compute: torch.dtype

    def blocks(self, length: int, size: int) -> list[range]:
        return [range(i, min(i + size, length)) for i in range(0, length, size)]


def _block_sizes(b: int, h: int, t: int, s: int) -> tuple[int, int]:
    """(queries, keys) per block: B * H * Tb * Sb stays near _SCORE_BUDGET.

    256 x 256 for B * H = 12 measured best on a 2-core CPU (larger blocks leave
    the cache; smaller ones pay more per-operation overhead); more batch or
    heads shrink the query block.
    """
    block_k = min(s, _BLOCK_K)
    block_q = max(16, _SCORE_BUDGET // max(1, b * h * block_k))
    return min(t, 1 << (block_q.bit_length() - 1)), block_k  # a power of two, at most T


def _mask5(mask: Tensor | None, g: int) -> Tensor | None:
    """(B?, H?, T?, S?) -> (B?, G?, R?, T?, S?) to match grouped scores."""
    if mask is None:
        return None
    if mask.shape[1] == 1:
        return mask.unsqueeze(2)  # (B?, 1, T?, S?) -> (B?, 1, 1, T?, S?)
    return mask.unflatten(1, (g, mask.shape[1] // g))  # (B?, H, T?, S?) -> (B?, G, R, T?, S?)


def _slice(mask: Tensor, rows: range, cols: range) -> Tensor:
    r = slice(rows.start, rows.stop) if mask.shape[-2] > 1 else slice(None)
    c = slice(cols.start, cols.stop) if mask.shape[-1] > 1 else slice(None)
    return mask[..., r, c]


def _scores(plan: _Plan, qb: Tensor, kb: Tensor, mask5: Tensor | None, rows: range, cols: range,
            visibility: str) -> Tensor:
    """Masked scores of one block, (B, G, R*Tb, Sb); ``qb`` is already scaled."""
    b, g, rt, _ = qb.shape
    s = torch.matmul(qb, kb.transpose(-2, -1))  # (B, G, R*Tb, D) @ (B, G, D, Sb) -> (B, G, R*Tb, Sb)
    if visibility == "all" and mask5 is None:
        return s
    s5 = s.view(b, g, rt // len(rows), len(rows), len(cols))  # (B, G, R*Tb, Sb) -> (B, G, R, Tb, Sb)
    if visibility == "some":
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


def _visible_blocks(plan: _Plan, rows: range, num_keys: int, masked: bool) -> list[tuple[range, str, bool]]:
    """(cols, visibility, whether some row may see nothing) of each key block not wholly hidden."""
    out = []
    for cols in plan.blocks(num_keys, plan.block_k):
        visibility = block_visibility(rows, cols, offset=plan.offset, causal=plan.causal, window=plan.window)
        if visibility == "none":
            continue
        empty = masked or (visibility == "some" and block_has_empty_rows(
            rows, cols, offset=plan.offset, causal=plan.causal, window=plan.window))
        out.append((cols, visibility, empty))
    return out


def _group(x: Tensor, g: int, rows: range, compute: torch.dtype) -> Tensor:
    """Rows of (B, H, T, E) for one query block, grouped: (B, G, R*Tb, E). May be a view of x."""
    b, h, _, e = x.shape
    block = x[:, :, rows.start:rows.stop].to(compute)  # (B, H, Tb, E)
    return block.reshape(b, g, (h // g) * len(rows), e)  # (B, G, R, Tb, E) -> (B, G, R*Tb, E)


def _ungroup(x: Tensor, h: int, rows: range) -> Tensor:
    b, _, _, e = x.shape
    return x.reshape(b, h, len(rows), e)  # (B, G, R*Tb, E) -> (B, H, Tb, E)


def _forward(plan: _Plan, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """(out (B, H, T, Dv) in q's dtype, lse (B, H, T) in the compute dtype, +inf where a query sees no key)."""
    b, h, t, _ = q.shape
    g, s_len = k.shape[1], k.shape[2]
    kc, vc, mask5 = k.to(plan.compute), v.to(plan.compute), _mask5(mask, g)
    out = q.new_empty(b, h, t, v.shape[-1])
    lse_out = torch.empty(b, h, t, dtype=plan.compute, device=q.device)
    for rows in plan.blocks(t, plan.block_q):
        qb = _group(q, g, rows, plan.compute) * plan.scale  # (B, G, R*Tb, D); a new tensor, q untouched
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=plan.compute, device=q.device)  # normalised
        lse = torch.full((*qb.shape[:-1], 1), -torch.inf, dtype=plan.compute, device=q.device)
        for cols, visibility, empty in _visible_blocks(plan, rows, s_len, mask5 is not None):
            s = _scores(plan, qb, kc[:, :, cols.start:cols.stop], mask5, rows, cols, visibility)
            p, lse_b = _block_softmax(s, masked=empty)
            old, new, lse = _merge_weights(lse, lse_b)
            acc = acc.mul_(old).add_(torch.matmul(p, vc[:, :, cols.start:cols.stop]).mul_(new))
        out[:, :, rows.start:rows.stop] = _ungroup(acc, h, rows).to(q.dtype)
        lse = lse.masked_fill(lse == -torch.inf, torch.inf)  # backward: weights exp(s - inf) = 0
        lse_out[:, :, rows.start:rows.stop] = lse.reshape(b, h, len(rows))
    return out, lse_out


def _backward(plan: _Plan, saved: tuple[Tensor, ...], mask: Tensor | None, dout: Tensor
              ) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v, out, lse = saved
    b, h, t, _ = q.shape
    g, s_len = k.shape[1], k.shape[2]
    kc, vc, mask5 = k.to(plan.compute), v.to(plan.compute), _mask5(mask, g)
    delta = (dout.to(plan.compute) * out.to(plan.compute)).sum(dim=-1)  # (B, H, T): rowsum(dO * O)
    dq = torch.empty(q.shape, dtype=plan.compute, device=q.device)
    dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
    for rows in plan.blocks(t, plan.block_q):
        qb = _group(q, g, rows, plan.compute) * plan.scale  # (B, G, R*Tb, D), scaled
        dob = _group(dout, g, rows, plan.compute)  # (B, G, R*Tb, Dv)
        lse_b = lse[:, :, rows.start:rows.stop].reshape(b, g, -1, 1)  # (B, G, R*Tb, 1)
        delta_b = delta[:, :, rows.start:rows.stop].reshape(b, g, -1, 1)
        dqb = torch.zeros_like(qb)
        for cols, visibility, empty in _visible_blocks(plan, rows, s_len, mask5 is not None):
            kb, vb = kc[:, :, cols.start:cols.stop], vc[:, :, cols.start:cols.stop]
            s = _scores(plan, qb, kb, mask5, rows, cols, visibility)
            p, block_lse = _block_softmax(s, masked=empty)
            p = p.mul_(torch.exp(block_lse - lse_b))  # the weights exp(s - lse) of the whole row
            dv[:, :, cols.start:cols.stop] += torch.matmul(p.transpose(-2, -1), dob)  # (B, G, Sb, Dv)
            ds = torch.matmul(dob, vb.transpose(-2, -1)).sub_(delta_b).mul_(p)  # dscore, (B, G, R*Tb, Sb)
            dqb.add_(torch.matmul(ds, kb))
            dk[:, :, cols.start:cols.stop] += torch.matmul(ds.transpose(-2, -1), qb)  # qb carries the scale
        dq[:, :, rows.start:rows.stop] = _ungroup(dqb.mul_(plan.scale), h, rows)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _ChunkedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, plan: _Plan) -> Tensor:
        out, lse = _forward(plan, q, k, v, mask)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.plan = plan
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        *saved, mask = ctx.saved_tensors
        dq, dk, dv = _backward(ctx.plan, tuple(saved), mask, dout.contiguous())
        return dq, dk, dv, None, None


def _plan(call: AttentionCall) -> _Plan:
    b, h, t, _ = call.q.shape
    block_q, block_k = _block_sizes(b, h, t, call.num_keys)
    compute = torch.float32 if call.q.dtype in (torch.float16, torch.bfloat16) else call.q.dtype
    return _Plan(call.causal, call.window, call.scale, call.offset, block_q, block_k, compute)


def chunked_attention(call: AttentionCall) -> Tensor:
    plan = _plan(call)
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (call.q, call.k, call.v))
    if not needs_grad:
        return _forward(plan, call.q, call.k, call.v, call.mask)[0]
    return _ChunkedFunction.apply(call.q, call.k, call.v, call.mask, plan)


def _why_not(call: AttentionCall) -> str | None:
    if call.dropout_p > 0:
        return f"it has no dropout (dropout_p={call.dropout_p}); use 'sdpa' or 'math'"
    if call.mask is not None and call.mask.requires_grad:
        return "it does not differentiate through a float mask; use 'sdpa' or 'math'"
    return None


CHUNKED = register(Backend(
    name="chunked",
    run=chunked_attention,
    why_not=_why_not,
))
