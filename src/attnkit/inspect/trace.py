"""Recording every intermediate of the attention layers inside any module.

    with attnkit.trace(model) as t:
        model(inputs)
    t.records[0].weights        # (B, H, T, S) of the first attention call

Every :class:`attnkit.MultiHeadAttention` and every attention class of
:mod:`attnkit.textbook` inside ``model`` is traced; nothing's signature
changes. While traced, attnkit layers compute with the explicit math backend
(it is the one with weights to record); textbook layers compute as always,
step by step. On leaving the block every layer is restored: outside it nothing
is recorded and nothing is slower.

Legend: B batch, H heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit import textbook as tb
from attnkit.backends.call import make_call
from attnkit.backends.math import masked_scores, softmax_rows
from attnkit.functional import expand_kv
from attnkit.modules import MultiHeadAttention
from attnkit.textbook._checks import check_input


@dataclass(frozen=True)
class AttentionRecord:
    """One attention call: its name in the model and each named step, per head.

    ``keys`` and ``values`` are repeated to the H query heads (grouped-query
    layers store fewer). ``scores`` are what softmax received: scaled, with
    -inf where a key was blocked. ``weights`` are taken before dropout;
    ``context`` is (dropped-out) weights @ values, before heads are merged;
    ``output`` is the layer's output. All are detached copies.
    """

    name: str
    queries: Tensor  # (B, H, T, D)
    keys: Tensor  # (B, H, S, D)
    values: Tensor  # (B, H, S, Dv)
    scores: Tensor  # (B, H, T, S)
    weights: Tensor  # (B, H, T, S)
    context: Tensor  # (B, H, T, Dv)
    output: Tensor

    @property
    def num_heads(self) -> int:
        return self.weights.shape[1]


@dataclass
class Trace:
    """What :func:`trace` recorded: one :class:`AttentionRecord` per call, in call order."""

    records: list[AttentionRecord] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def named(self, name: str) -> list[AttentionRecord]:
        """The records of the layer called ``name`` (in call order)."""
        return [r for r in self.records if r.name == name]


def _record(name: str, steps: list[Tensor], output: Tensor) -> AttentionRecord:
    """steps: queries, keys, values, scores, weights, context (keys and values may have G heads)."""
    q, k, v, scores, weights, context = steps
    h = q.shape[1]
    parts = [q, expand_kv(k, h), expand_kv(v, h), scores, weights, context, output]
    return AttentionRecord(name, *(t.detach().clone() for t in parts))


def _heads_step(q: Tensor, k: Tensor, v: Tensor, causal: bool, dropout: nn.Module | None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The textbook's step: scores, -inf above the diagonal, scale, softmax, dropout, @ values.

    q, k, v (B, H, T, d). Returns (scores, weights, context); the dropout
    module is called once, as the textbook classes call it.
    """
    scores = q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5  # (B, H, T, d) @ (B, H, d, T) -> (B, H, T, T)
    if causal:
        t = scores.shape[-1]
        future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -torch.inf)
    weights = torch.softmax(scores, dim=-1)
    dropped = dropout(weights) if dropout is not None else weights
    return scores, weights, dropped @ v  # (B, H, T, T) @ (B, H, T, d) -> (B, H, T, d)


def _single_head(module: nn.Module, x: Tensor, causal: bool, dropout: nn.Module | None,
                 project: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, list[Tensor]]:
    q, k, v = (t.unsqueeze(1) for t in project(x))  # (B, T, d) -> (B, 1, T, d)
    scores, weights, context = _heads_step(q, k, v, causal, dropout)
    return context.squeeze(1), [q, k, v, scores, weights, context]


def _trace_v1(m: tb.SelfAttention_v1, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(m, x, False, None, lambda x: (x @ m.W_query, x @ m.W_key, x @ m.W_value))


def _trace_v2(m: tb.SelfAttention_v2, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(m, x, False, None, lambda x: (m.W_query(x), m.W_key(x), m.W_value(x)))


def _trace_causal(m: tb.CausalAttention, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(m, x, True, m.dropout, lambda x: (m.W_query(x), m.W_key(x), m.W_value(x)))


def _trace_wrapper(m: tb.MultiHeadAttentionWrapper, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    heads = [_trace_causal(head, x) for head in m.heads]  # type: ignore[arg-type]
    parts = [torch.cat([fields[i] for _, fields in heads], dim=1) for i in range(6)]  # H x (B, 1, ...)
    return torch.cat([out for out, _ in heads], dim=-1), parts  # H x (B, T, d) -> (B, T, H*d)


def _trace_multihead(m: tb.MultiHeadAttention, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    q, k, v = (m.split_heads(w(x)) for w in (m.W_query, m.W_key, m.W_value))  # (B, T, d_out) -> (B, H, T, hd)
    scores, weights, context = _heads_step(q, k, v, True, m.dropout)
    return m.out_proj(m.merge_heads(context)), [q, k, v, scores, weights, context]


def _trace_per_head(m: tb.PerHeadAttention, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    def stack(projections: nn.ParameterList) -> Tensor:
        return torch.stack([x @ p.T for p in projections], dim=1)  # H x (B, T, hs) -> (B, H, T, hs)

    q, k, v = stack(m.q_proj), stack(m.k_proj), stack(m.v_proj)
    scores, weights, context = _heads_step(q, k, v, True, None)
    concat = context.transpose(1, 2).flatten(2)  # (B, H, T, hs) -> (B, T, H*hs)
    return concat @ m.multi_head_proj.T, [q, k, v, scores, weights, context]


_TEXTBOOK: dict[type, Callable[..., tuple[Tensor, list[Tensor]]]] = {
    tb.SelfAttention_v1: _trace_v1,
    tb.SelfAttention_v2: _trace_v2,
    tb.CausalAttention: _trace_causal,
    tb.MultiHeadAttentionWrapper: _trace_wrapper,
    tb.MultiHeadAttention: _trace_multihead,
    tb.PerHeadAttention: _trace_per_head,
}


def _textbook_forward(module: nn.Module, name: str, out: Trace) -> Callable[[Tensor], Tensor]:
    step = _TEXTBOOK[type(module)]
    sizes: Any = module.heads[0] if isinstance(module, tb.MultiHeadAttentionWrapper) else module
    d_in, context_length = sizes.d_in, getattr(sizes, "context_length", None)

    def forward(x: Tensor) -> Tensor:
        batch = check_input(x, d_in, context_length)  # the textbook's own checks; (B, T, d_in)
        output, fields = step(module, batch)
        out.records.append(_record(name, fields, output))
        return output if x.dim() == 3 else output.squeeze(0)  # (B, T, d) -> (T, d)

    return forward


def _observer(name: str, pending: list[list[Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
    """Stands in for attention() inside a traced attnkit layer: the math backend, every step kept."""

    def observe(layer: MultiHeadAttention, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                dropout_p: float) -> tuple[Tensor, Tensor]:
        call = make_call(q, k, v, mask=mask, causal=layer.causal, window=layer.window, dropout_p=dropout_p)
        scores = masked_scores(call)
        weights = softmax_rows(scores)
        dropped = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
        context = dropped @ expand_kv(v, q.shape[1]).to(weights.dtype)  # (B, H, T, S) @ (B, H, S, Dv)
        pending.append([q, k, v, scores, weights, context])
        return context.to(q.dtype), weights.to(q.dtype)

    return observe


def _attach(module: nn.Module, name: str, out: Trace) -> Callable[[], None]:
    """Start tracing one layer; return the function that restores it."""
    if isinstance(module, MultiHeadAttention):
        pending: list[list[Tensor]] = []
        module._observer = _observer(name, pending)

        def finish(_: nn.Module, args: object, output: Tensor | tuple[Tensor, Tensor]) -> None:
            result = output[0] if isinstance(output, tuple) else output
            out.records.append(_record(name, pending.pop(), result))

        handle = module.register_forward_hook(finish)

        def restore() -> None:
            module._observer = None
            handle.remove()

        return restore
    module.forward = _textbook_forward(module, name, out)
    return lambda: module.__dict__.pop("forward", None)


@contextmanager
def trace(model: nn.Module) -> Iterator[Trace]:
    """Record every attention call inside ``model`` while the block runs.

    Layers are named by their path in ``model`` (``model`` itself, if it is
    an attention layer, by its class name). A textbook layer inside another
    traced one (the heads of a MultiHeadAttentionWrapper) is recorded as part
    of the outer layer. Layers are restored on leaving, even after an error.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"trace() expects an nn.Module, got {type(model).__name__}")
    out = Trace()
    restores: list[Callable[[], None]] = []
    traced_prefixes: list[str] = []
    try:
        for name, module in model.named_modules():
            if any(name.startswith(p) for p in traced_prefixes):
                continue
            if isinstance(module, MultiHeadAttention) or type(module) in _TEXTBOOK:
                restores.append(_attach(module, name or type(module).__name__, out))
                traced_prefixes.append(f"{name}." if name else "")
        yield out
    finally:
        for restore in restores:
            restore()
