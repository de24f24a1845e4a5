"""The notebooks' step-by-step walkthrough of multi-head attention, as data.

:func:`walkthrough` runs a textbook :class:`~attnkit.textbook.MultiHeadAttention`
on one sequence one step at a time and returns every intermediate as a
:class:`Step`: what it is, its tensors, their axes. ``attnkit explain``
renders the steps; ``--json`` writes them for other tools.

Legend: T tokens, H heads, hd head dim, d_in input size, d_out = H * hd.
Tensors hold one sequence: no batch axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit import textbook as tb

from .trace import AttentionRecord, HeadSteps, heads_steps

# The steps in order, with their titles; `--steps` picks among these keys.
STEPS: dict[str, str] = {
    "inputs": "Input embeddings",
    "weights": "W_query, W_key, W_value",
    "qkv": "Queries, keys, values",
    "split": "Head split",
    "scores": "Attention scores",
    "mask": "Causal mask",
    "scaled": "Masked, scaled scores",
    "softmax": "Attention weights",
    "dropout": "Dropout",
    "context": "Context vectors",
    "merge": "Head merge",
    "output": "Output",
}


@dataclass(frozen=True)
class Step:
    """One intermediate of the walkthrough.

    ``tensors`` maps a name to a tensor; ``axes`` gives each tensor's axis
    names ("token", "query" and "key" index tokens; "head" a head; other
    names a feature). ``note`` is one line on what the step is and why.
    """

    key: str
    title: str
    note: str
    tensors: dict[str, Tensor]
    axes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)


@dataclass(frozen=True)
class Example:
    """A sequence to walk through: its tokens, embeddings and where they came from."""

    tokens: tuple[str, ...]
    embeddings: Tensor  # (T, d_in)
    source: str


def book_example() -> Example:
    """The notebooks' sentence and its six hand-written 3-d embeddings."""
    return Example(tb.WORDS, tb.book_inputs(), "the notebooks' 3-d embeddings (hand-written, not learned)")


def text_example(text: str, *, seed: int, d_in: int = 3) -> Example:
    """Whitespace tokens of ``text`` with embeddings drawn from ``torch.randn``.

    The generator is seeded with ``seed``; the embeddings carry no meaning.
    """
    tokens = tuple(text.split())
    if not tokens:
        raise ValueError(f"text {text!r} is empty: give at least one word")
    generator = torch.Generator().manual_seed(seed)
    embeddings = torch.randn(len(tokens), d_in, generator=generator)  # (T, d_in)
    source = f"random {d_in}-d embeddings from torch.randn with seed {seed}: they carry no meaning"
    return Example(tokens, embeddings, source)


def build_layer(d_in: int, d_out: int, num_heads: int, context_length: int, *, seed: int,
                dropout: float = 0.0) -> tb.MultiHeadAttention:
    """A textbook MultiHeadAttention whose weights come from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return tb.MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads)


def _check_example(mha: tb.MultiHeadAttention, x: Tensor, tokens: Sequence[str]) -> None:
    if x.dim() != 2 or x.shape[1] != mha.d_in:
        raise ValueError(f"embeddings must have shape (T, d_in={mha.d_in}), got {tuple(x.shape)}")
    if len(tokens) != x.shape[0]:
        raise ValueError(f"{len(tokens)} tokens but {x.shape[0]} embeddings: they must match")
    if not torch.isfinite(x).all():
        raise ValueError("embeddings contain non-finite values (nan or inf)")


@torch.no_grad()
def walkthrough(mha: tb.MultiHeadAttention, example: Example, *, causal: bool = True) -> list[Step]:
    """Every step of ``mha`` on one sequence, in order (see :data:`STEPS`).

    Dropout is applied to the weights when ``mha`` is in training mode with
    p > 0, drawing from the global generator exactly as ``mha(x)`` does, so
    with ``causal=True`` the last step equals ``mha(x)`` under the same seed.
    """
    x, tokens = example.embeddings, example.tokens
    _check_example(mha, x, tokens)
    hd = mha.head_dim
    steps = [Step("inputs", STEPS["inputs"], f"One row per token: {example.source}.",
                  {"inputs": x}, {"inputs": ("token", "d_in")})]
    w = {f"W_{n}": getattr(mha, f"W_{n}").weight.T for n in ("query", "key", "value")}  # (d_in, d_out)
    steps.append(Step("weights", STEPS["weights"],
                      "Trainable projections: queries = inputs @ W_query, and likewise for keys and values.",
                      w, dict.fromkeys(w, ("d_in", "d_out"))))
    qkv = {"queries": mha.W_query(x), "keys": mha.W_key(x), "values": mha.W_value(x)}  # (T, d_out)
    steps.append(Step("qkv", STEPS["qkv"],
                      "What each token looks for (query), offers (key) and passes on (value).",
                      qkv, dict.fromkeys(qkv, ("token", "d_out"))))
    heads = {n: mha.split_heads(t.unsqueeze(0))[0] for n, t in qkv.items()}  # (T, d_out) -> (H, T, hd)
    steps.append(Step("split", STEPS["split"],
                      f"d_out={mha.d_out} splits into {mha.num_heads} heads of head_dim={hd}: "
                      "view (T, H, hd), then transpose to (H, T, hd).",
                      heads, dict.fromkeys(heads, ("head", "token", "hd"))))
    found = heads_steps(heads["queries"], heads["keys"], heads["values"], causal,
                        mha.dropout if mha.training and mha.dropout.p > 0 else None)
    return steps + _score_steps(mha, found, causal) + _context_steps(mha, found)


def _score_steps(mha: tb.MultiHeadAttention, found: HeadSteps, causal: bool) -> list[Step]:
    qk = ("head", "query", "key")
    mask_note = ("True = may attend: token i sees tokens 0..i, never a later one."
                 if causal else "No mask (--no-causal): every token sees every token.")
    return [
        Step("scores", STEPS["scores"], "Query-key dot products per head: how well each key matches.",
             {"scores": found.scores}, {"scores": qk}),
        Step("mask", STEPS["mask"], mask_note, {"mask": found.may_attend}, {"mask": ("query", "key")}),
        Step("scaled", STEPS["scaled"],
             f"Blocked scores become -inf; all are divided by sqrt(head_dim)={mha.head_dim**0.5:.4g} "
             "so softmax does not saturate.", {"scaled": found.scaled}, {"scaled": qk}),
        Step("softmax", STEPS["softmax"], "Softmax of each row: non-negative weights that sum to one.",
             {"weights": found.weights}, {"weights": qk}),
    ]


def _context_steps(mha: tb.MultiHeadAttention, found: HeadSteps) -> list[Step]:
    qk = ("head", "query", "key")
    p = mha.dropout.p
    if mha.training and p > 0:
        note = (f"Training mode: each weight is zeroed with p={p} and survivors scaled by 1/(1-p), "
                "so rows no longer sum to one.")
    else:
        note = f"Off (p={p}{', eval mode' if not mha.training else ''}): the weights pass unchanged."
    merged = mha.merge_heads(found.context.unsqueeze(0))[0]  # (H, T, hd) -> (T, d_out)
    out = mha.out_proj(merged)  # (T, d_out)
    return [
        Step("dropout", STEPS["dropout"], note, {"weights": found.dropped}, {"weights": qk}),
        Step("context", STEPS["context"], "Each token's weighted sum of the values, per head.",
             {"context": found.context}, {"context": ("head", "token", "hd")}),
        Step("merge", STEPS["merge"], "Transpose back to (T, H, hd), then join the heads: (T, d_out).",
             {"merged": merged}, {"merged": ("token", "d_out")}),
        Step("output", STEPS["output"], "out_proj mixes the heads' results: the layer's output.",
             {"output": out}, {"output": ("token", "d_out")}),
    ]


def select(steps: list[Step], keys: Sequence[str] | None) -> list[Step]:
    """The steps named in ``keys`` (in walkthrough order); all of them for None."""
    if keys is None:
        return steps
    unknown = [k for k in keys if k not in STEPS]
    if unknown:
        raise ValueError(f"unknown step(s) {', '.join(unknown)}; choose from: {', '.join(STEPS)}")
    return [s for s in steps if s.key in set(keys)]


RECORD_STEPS = ("qkv", "scaled", "softmax", "context", "output")  # what a traced layer's record shows


def record_steps(record: AttentionRecord, head: int, batch_index: int = 0) -> list[Step]:
    """The walkthrough of one head of a traced layer (see :func:`attnkit.trace`): the :data:`RECORD_STEPS`."""
    heads = record.num_heads
    if not 0 <= head < heads:
        raise ValueError(f"head {head} is out of range: {record.name} has heads 0 to {heads - 1}")
    d = record.queries.shape[-1]
    pick = {n: getattr(record, n)[batch_index, head] for n in ("queries", "keys", "values", "scores",
                                                                  "weights", "context")}
    qk = ("query", "key")
    return [
        Step("qkv", STEPS["qkv"], f"Head {head}'s queries, keys and values as {record.name}'s attention received "
             "them (after rotary embeddings and QK-norm where the layer has them): what each token looks for, "
             "offers and passes on.",
             {n: pick[n] for n in ("queries", "keys", "values")},
             {"queries": ("token", "hd"), "keys": ("token", "hd"), "values": ("token", "hd")}),
        Step("scaled", STEPS["scaled"], f"Query-key dot products as the layer scaled them (by default divided "
             f"by sqrt(head_dim)={d**0.5:.4g}) and modified them (soft-capping, ALiBi) if it does; -inf where a "
             "key is blocked (padding, or a later token in a causal layer).",
             {"scaled": pick["scores"]}, {"scaled": qk}),
        Step("softmax", STEPS["softmax"], "Softmax of each row: how much each token takes from each other.",
             {"weights": pick["weights"]}, {"weights": qk}),
        Step("context", STEPS["context"], f"Head {head}'s weighted sums of the values.",
             {"context": pick["context"]}, {"context": ("token", "hd")}),
        Step("output", STEPS["output"], "The layer's output: all heads merged and projected by out_proj.",
             {"output": record.output[batch_index]}, {"output": ("token", "d_out")}),
    ]
