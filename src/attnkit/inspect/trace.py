"""Recording every intermediate of the attention layers inside any module.

    with attnkit.trace(model) as t:
        model(inputs)
    t.records[0].weights        # (B, H, T, S) of the first attention call

Every call of :func:`attnkit.attention` made inside ``model`` (by
:class:`attnkit.MultiHeadAttention`, a decoder, or a Hugging Face model
running on attnkit) and every attention class of :mod:`attnkit.textbook` is
recorded; nothing's signature changes and nothing is stored on a module.
While tracing, attention() computes with the explicit math backend (it is the
one with weights to record). Outside the block nothing is recorded and
nothing is slower.

Legend: B batch, H heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from attnkit import textbook as tb
from attnkit.backends import AttentionCall, Intermediates, observe
from attnkit.functional import expand_kv


@dataclass(frozen=True)
class AttentionRecord:
    """One attention call: its name in the model and each named step, per head.

    ``keys`` and ``values`` are repeated to the H query heads (grouped-query
    layers store fewer). ``scores`` are what softmax received: scaled, with
    -inf where a key was blocked; a layer with sinks (gpt-oss) adds a sink
    logit per head to every softmax denominator, which the scores leave out,
    so its rows of ``weights`` sum to less than 1. A query that sees no key
    (left padding) has weights and context 0. ``weights`` are taken before dropout;
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


@dataclass(frozen=True)
class HeadSteps:
    """The textbook's attention step, every intermediate kept (q, k, v (B, H, T, d))."""

    scores: Tensor  # (B, H, T, T): q @ k^T
    may_attend: Tensor  # (T, T), True = may attend
    scaled: Tensor  # (B, H, T, T): -inf where blocked, / sqrt(d)
    weights: Tensor  # (B, H, T, T): softmax
    dropped: Tensor  # (B, H, T, T): after dropout
    context: Tensor  # (B, H, T, d)


def heads_steps(q: Tensor, k: Tensor, v: Tensor, causal: bool, dropout: nn.Module | None) -> HeadSteps:
    """The textbook's step: scores, -inf above the diagonal, scale, softmax, dropout, @ values.

    The dropout module is called once, as the textbook classes call it. The
    walkthrough and the textbook layers' trace adapters both use this.
    """
    scores = q @ k.transpose(-2, -1)  # (B, H, T, d) @ (B, H, d, T) -> (B, H, T, T)
    t = scores.shape[-1]
    may_attend = torch.ones(t, t, dtype=torch.bool, device=q.device)  # (T, T)
    if causal:
        may_attend = may_attend.tril()
    scaled = scores.masked_fill(~may_attend, -torch.inf) / k.shape[-1] ** 0.5
    weights = torch.softmax(scaled, dim=-1)
    dropped = dropout(weights) if dropout is not None else weights
    context = dropped @ v  # (B, H, T, T) @ (B, H, T, d) -> (B, H, T, d)
    return HeadSteps(scores, may_attend, scaled, weights, dropped, context)


def _heads_step(q: Tensor, k: Tensor, v: Tensor, causal: bool, dropout: nn.Module | None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(scaled scores, weights, context) of :func:`heads_steps`: what a record keeps."""
    steps = heads_steps(q, k, v, causal, dropout)
    return steps.scaled, steps.weights, steps.context


def _single_head(x: Tensor, causal: bool, dropout: nn.Module | None,
                 project: Callable[[Tensor], tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, list[Tensor]]:
    q, k, v = (t.unsqueeze(1) for t in project(x))  # (B, T, d) -> (B, 1, T, d)
    scores, weights, context = _heads_step(q, k, v, causal, dropout)
    return context.squeeze(1), [q, k, v, scores, weights, context]


def _trace_v1(m: tb.SelfAttention_v1, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(x, False, None, lambda x: (x @ m.W_query, x @ m.W_key, x @ m.W_value))


def _trace_v2(m: tb.SelfAttention_v2, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(x, False, None, lambda x: (m.W_query(x), m.W_key(x), m.W_value(x)))


def _trace_causal(m: tb.CausalAttention, x: Tensor) -> tuple[Tensor, list[Tensor]]:
    return _single_head(x, True, m.dropout, lambda x: (m.W_query(x), m.W_key(x), m.W_value(x)))


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


def textbook_adapter(module: nn.Module) -> Callable[..., tuple[Tensor, list[Tensor]]] | None:
    """The step-by-step adapter for a textbook attention class or a subclass that keeps its forward, else None.

    A subclass that overrides ``forward`` computes something the adapter does not know: it is not
    recorded step by step (its attention() calls, if any, still are).
    """
    for cls in type(module).__mro__:
        if cls in _TEXTBOOK:
            kept = getattr(type(module), "forward", None) is getattr(cls, "forward", None)
            return _TEXTBOOK[cls] if kept else None
    return None


@dataclass
class _Frame:
    """One call of a module of the traced model, with the attention calls made inside it."""

    module: nn.Module
    name: str | None  # None: not a module of the traced model
    pending: list[list[Tensor]] = field(default_factory=list)
    rng: tuple[Tensor, ...] = ()


class _Tracer:
    """Observes attention() calls and textbook layers while one trace() block runs.

    Global module hooks (``torch.nn.modules.module.register_module_forward_*``)
    keep a stack of the modules being called, so nothing is stored on any
    module: copies and pickles of a traced model are plain, and nested
    traces each record everything.
    """

    def __init__(self, model: nn.Module | None, out: Trace) -> None:
        self.out = out
        self.names = {} if model is None else {id(m): n or type(m).__name__ for n, m in model.named_modules()}
        self.everything = model is None
        self.stack: list[_Frame] = []
        self.thread = threading.get_ident()  # module calls of other threads are not this trace's

    def _owner(self) -> _Frame | None:
        """The innermost frame of a module of the traced model, if any."""
        return next((f for f in reversed(self.stack) if f.name is not None), None)

    def _in_textbook(self) -> bool:
        return any(f.name is not None and textbook_adapter(f.module) is not None for f in self.stack)

    def observe(self, call: AttentionCall, steps: Intermediates) -> None:
        fields = [call.q, call.k, call.v, steps.scores, steps.weights, steps.out]
        owner = self._owner()
        if owner is not None:
            owner.pending.append(fields)
        elif self.everything:
            self.out.records.append(_record("attention", fields, steps.out))

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if threading.get_ident() != self.thread:
            return
        name = self.names.get(id(module))
        if name is not None and textbook_adapter(module) is not None and self._in_textbook():
            name = None  # a textbook head inside a traced textbook layer: part of the outer record
        frame = _Frame(module, name)
        if name is not None and textbook_adapter(module) is not None:
            frame.rng = _rng_state(module)
        self.stack.append(frame)

    def post_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if threading.get_ident() != self.thread or not self.stack or self.stack[-1].module is not module:
            return  # another thread's call, or one that started before the block
        frame = self.stack.pop()
        if frame.name is None:
            return
        adapter = textbook_adapter(module)
        x = args[0] if args else next(iter(kwargs.values()), None)
        if adapter is not None and isinstance(x, Tensor):
            self.out.records.append(_textbook_record(module, adapter, frame, x))
        result = output[0] if isinstance(output, tuple) else output
        for fields in frame.pending:  # a module that returns no tensor: its record keeps attention's output
            self.out.records.append(_record(frame.name, fields, result if isinstance(result, Tensor) else fields[5]))


def _rng_state(module: nn.Module) -> tuple[Tensor, ...]:
    """The generators' states before a textbook layer runs, to replay its dropout in the adapter."""
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def _textbook_record(module: nn.Module, adapter: Callable[..., tuple[Tensor, list[Tensor]]], frame: _Frame,
                     x: Tensor) -> AttentionRecord:
    """Re-run a textbook layer's steps on its input x with the generator as the layer found it (same dropout)."""
    batch = x if x.dim() == 3 else x.unsqueeze(0)  # (T, d_in) -> (1, T, d_in)
    cuda = [x.device] if len(frame.rng) == 2 else []
    with torch.random.fork_rng(devices=cuda), torch.no_grad():
        torch.set_rng_state(frame.rng[0])
        if cuda:
            torch.cuda.set_rng_state(frame.rng[1], x.device)
        output, fields = adapter(module, batch)
    assert frame.name is not None
    return _record(frame.name, fields, output)


@contextmanager
def trace(model: nn.Module | None = None) -> Iterator[Trace]:
    """Record every attention call inside ``model`` while the block runs.

    Every call of :func:`attnkit.attention` made while a module of ``model``
    runs is recorded (with the math backend, whose intermediates it keeps),
    named by the path of the innermost such module: an attnkit layer, a
    Hugging Face attention module running on attnkit, any caller. Textbook
    attention layers (and their subclasses) are recorded step by step; a
    textbook layer inside another (the heads of a MultiHeadAttentionWrapper)
    is part of the outer record. With ``model=None``, every attention() call
    in the block is recorded, named "attention".

    Nothing is stored on the model: copies and pickles made inside the block
    are not traced, and traces nest (each records every call).
    """
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"trace() expects an nn.Module, got {type(model).__name__}")
    out = Trace()
    tracer = _Tracer(model, out)
    pre = register_module_forward_pre_hook(tracer.pre_hook)
    post = register_module_forward_hook(tracer.post_hook, with_kwargs=True, always_call=True)
    try:
        with observe(tracer.observe):
            yield out
    finally:
        pre.remove()
        post.remove()
