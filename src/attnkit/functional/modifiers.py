"""Score and mask modifiers in FlexAttention's form, and attnkit's built-in ones.

A score modifier changes the scaled scores before the softmax; a mask
modifier says which keys each query may see (True = may attend, the one
convention in attnkit)::

    score_mod(score, b, h, q_idx, kv_idx) -> score
    mask_mod(b, h, q_idx, kv_idx) -> bool

The indices are long tensors that broadcast against the scores (B, H, T, S)
(or a block of them): b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, T, 1),
kv_idx (1, 1, 1, S). Positions are global: keys are at 0 .. S - 1 and the T
queries are the last T positions, S - T .. S - 1 (the bottom-right alignment
of ``causal``). A function written for ``torch.nn.attention.flex_attention``
works as it is; the built-ins below are small objects that also tell the
kernels more about themselves:

- a :class:`MaskModifier` may give a *block rule*: whether a block of
  (query positions x key positions) is wholly hidden, wholly visible or
  partly visible, found by interval arithmetic on the block's ends, so the
  chunked kernel skips hidden blocks without evaluating the mask there;
- a :class:`ScoreModifier` that only adds a bias (``alibi``) says so with
  :meth:`ScoreModifier.bias`, so SDPA can serve it as an additive mask;
- a :class:`ScoreModifier` may name the tensors it reads
  (:meth:`ScoreModifier.tensors`: alibi's slopes, softcap's cap), so the
  chunked kernel need not run it once to find those that need gradients;
- both may ``check`` a call (head counts, document id lengths) before it runs.

A subclass that overrides ``__call__`` alone keeps none of the rule, bias,
in-place form or tensors it inherits: they describe its parent's call
(:func:`declares`).

Documents: :func:`document_mask` keeps each query inside its own document.
Modifiers that depend only on the distance kv_idx - q_idx (causal, sliding
windows, ALiBi) are the same at global and at per-document positions, so
``and_masks(causal(), document_mask(ids))`` is per-document causal attention;
one that depends on absolute positions goes inside the document mask
(``document_mask(ids, prefix_lm(4))``), which hands it positions that restart
at 0 in each document (:func:`document_positions`, also the positions to give
rotary embedding for packed sequences).

Learned per-head sinks (a logit per head in the softmax denominator) are not a
modifier: they are ``attnkit.attention(..., sinks=)``.

Legend: B batch, H query heads, T queries, S keys, Tb / Sb a block of them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import Tensor

from .masks import Visibility, block_visibility

# (query positions, key positions) of a block -> NONE (nothing visible), ALL (everything visible), SOME
# (something visible, maybe all) or None (unknown: evaluate the mask to know).
BlockRule = Callable[[range, range], "Visibility | None"]
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class ScoreModifier:
    """Base of the built-in score modifiers (any callable with the signature works as well)."""

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor | None:
        """The additive bias when this modifier is ``score + bias``; None if it is not additive."""
        return None

    def modify_(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """The modified scores, written into ``score`` where the modifier can (a kernel's block that nothing
        differentiates through); by default, the call itself."""
        return self(score, b, h, q_idx, kv_idx)

    def tensors(self) -> tuple[Tensor, ...] | None:
        """Every tensor the call reads besides its arguments (learned slopes, caps), so that a kernel knows
        which may need gradients without running it; None (the default): unknown, the kernel runs it once to
        find them."""
        return None

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        """Raise ValueError if this modifier cannot serve a call of this geometry."""


class MaskModifier:
    """Base of the built-in mask modifiers (any callable with the signature works as well)."""

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def block_rule(self, batch: int, q_positions: range, kv_positions: range) -> BlockRule | None:
        """A rule for the blocks of one call, or None (each block's mask is then evaluated)."""
        return None

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        """Raise ValueError if this modifier cannot serve a call of this geometry."""


def modifier_name(fn: object) -> str:
    """How error messages name a modifier: a built-in's repr, a function's qualified name."""
    if isinstance(fn, (ScoreModifier, MaskModifier)):
        return repr(fn)
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def declares(fn: object, method: str) -> bool:
    """Whether ``fn``'s ``method`` (``block_rule``, ``bias``, ``modify_``, ``tensors``) is its own and speaks for
    its ``__call__``: defined by the class that defines ``__call__`` or by a subclass of it, and not the
    base's default.

    A subclass that overrides ``__call__`` alone inherits a method that no
    longer describes it: then False, and kernels treat the modifier as any
    function (they call it, and skip no block on its parent's word).
    """
    mro = type(fn).__mro__
    defines_call = next((c for c in mro if "__call__" in vars(c)), None)
    defines_method = next((c for c in mro if method in vars(c)), None)
    if defines_call is None or defines_method is None or defines_method in (ScoreModifier, MaskModifier):
        return False
    return issubclass(defines_method, defines_call)


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {name}={value!r}")
    return int(value)


# ----------------------------------------------------------------------------- score modifiers


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's fixed slopes (H,): 2^(-8/n), 2^(-16/n), ... for the nearest power of two n <= H, then
    every other slope of 2n for the remaining heads (Press et al.; BLOOM and MPT use the same)."""
    num_heads = _positive_int("num_heads", num_heads)

    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


class Alibi(ScoreModifier):
    """score + slopes[h] * (kv_idx - q_idx): a linear penalty on distance, per head."""

    def __init__(self, slopes: Tensor) -> None:
        if not isinstance(slopes, Tensor) or slopes.dim() != 1 or not slopes.is_floating_point():
            got = f"{slopes.dtype} {tuple(slopes.shape)}" if isinstance(slopes, Tensor) else type(slopes).__name__
            raise ValueError(f"alibi slopes must be a floating-point (H,) tensor, one slope per head; got {got}")
        self.slopes = slopes

    def __repr__(self) -> str:
        return f"alibi({self.slopes.numel()} heads)"

    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.slopes.to(h.device)[h] * (kv_idx - q_idx)  # (1, H, 1, 1) * (1, 1, T, S) -> (1, H, T, S)

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + self.bias(b, h, q_idx, kv_idx)

    def modify_(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score.add_(self.bias(b, h, q_idx, kv_idx).to(score.dtype))

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.slopes,)

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        if self.slopes.numel() != num_heads:
            raise ValueError(f"{self!r} has {self.slopes.numel()} slopes (one per head) but q has H={num_heads} heads")


def alibi(num_heads: int | None = None, *, slopes: Tensor | None = None) -> Alibi:
    """ALiBi: ``alibi(H)`` with the paper's fixed slopes, or ``alibi(slopes=...)`` (H,), e.g. learned.

    Slopes that require grad receive gradients on every backend. The bias is
    slope * (kv_idx - q_idx) (FlexAttention's example; 0 on the diagonal,
    negative for past keys).
    """
    if (num_heads is None) == (slopes is None):
        raise ValueError("alibi takes either num_heads (the paper's slopes) or slopes=, not both and not neither; "
                         f"got num_heads={num_heads!r}, slopes={'given' if slopes is not None else None}")
    return Alibi(alibi_slopes(num_heads) if slopes is None else slopes)  # type: ignore[arg-type]


class Softcap(ScoreModifier):
    """cap * tanh(score / cap): scores squashed into (-cap, cap), as Gemma 2 and Grok do."""

    def __init__(self, cap: float | Tensor) -> None:
        if isinstance(cap, Tensor):
            if not cap.is_floating_point() or cap.dim() > 1:
                raise ValueError(f"softcap's cap must be a positive number, a 0-d tensor or one per head (H,); "
                                 f"got a {cap.dtype} tensor of shape {tuple(cap.shape)}")
            if cap.device.type != "meta" and not bool((cap.detach() > 0).all() & cap.detach().isfinite().all()):
                raise ValueError(f"softcap's cap must be positive and finite, got {cap.detach().tolist()}")
        elif isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not (0 < float(cap) < math.inf):
            raise ValueError(f"softcap's cap must be a positive finite number, got cap={cap!r}")
        self.cap = cap if isinstance(cap, Tensor) else float(cap)

    def __repr__(self) -> str:
        cap = self.cap
        return f"softcap({cap if isinstance(cap, float) else 'tensor ' + str(tuple(cap.shape))})"

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        per_head = isinstance(self.cap, Tensor) and self.cap.dim() == 1
        cap = self.cap.to(h.device)[h] if per_head else self.cap  # (H,) -> (1, H, 1, 1)
        return torch.tanh(score / cap) * cap

    def modify_(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if isinstance(self.cap, Tensor):
            return self(score, b, h, q_idx, kv_idx)
        # tanh(x) = 2 sigmoid(2x) - 1: PyTorch's CPU sigmoid is much faster than its tanh, and so is a
        # softcap call this way (BENCHMARKS.md, "The in-place softcap"). The price: an absolute error of
        # about cap * eps near 0 (1e-4 at cap 1000, 1e-5 at 50), where the call is relative; the backward
        # recomputes through the call, off from this forward by as much.
        return score.mul_(2 / self.cap).sigmoid_().mul_(2 * self.cap).sub_(self.cap)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.cap,) if isinstance(self.cap, Tensor) else ()

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        if isinstance(self.cap, Tensor) and self.cap.dim() == 1 and self.cap.numel() != num_heads:
            raise ValueError(f"{self!r} has {self.cap.numel()} caps (one per head) but q has H={num_heads} heads")


def softcap(cap: float | Tensor) -> Softcap:
    """Logit soft-capping: cap * tanh(score / cap); ``cap`` a number or a tensor (0-d or (H,)), e.g. learned."""
    return Softcap(cap)


# ----------------------------------------------------------------------------- mask modifiers


class Band(MaskModifier):
    """Causal attention, optionally within a sliding window: kv_idx <= q_idx (and kv_idx > q_idx - window).

    The same band as ``attention(causal=True, window=...)``, whose flags become this
    modifier whenever a call has modifiers; its block rule is
    :func:`attnkit.functional.block_visibility`, the one the plain kernels use.
    """

    def __init__(self, window: int | None = None) -> None:
        self.window = None if window is None else _positive_int("window", window)

    def __repr__(self) -> str:
        return "causal()" if self.window is None else f"sliding_window({self.window})"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        visible = kv_idx <= q_idx  # (1, 1, T, 1) vs (1, 1, 1, S) -> (1, 1, T, S)
        return visible if self.window is None else visible & (kv_idx > q_idx - self.window)

    def block_rule(self, batch: int, q_positions: range, kv_positions: range) -> BlockRule:
        def rule(qs: range, ks: range) -> Visibility:
            return block_visibility(qs, ks, offset=0, causal=True, window=self.window)
        return rule


def causal() -> Band:
    """Each query sees the keys at its own position and before."""
    return Band()


def sliding_window(window: int) -> Band:
    """Causal within a window: each query sees its ``window`` most recent keys, itself included
    (q_idx - window < kv_idx <= q_idx), as ``attention(causal=True, window=window)``."""
    return Band(window)


class KeysBefore(MaskModifier):
    """Every query sees the keys at positions < ``length`` (an int, or (B,) per sequence)."""

    def __init__(self, length: int | Tensor, name: str) -> None:
        self.name = name
        if isinstance(length, Tensor):
            if length.dim() != 1 or length.is_floating_point() or length.dtype == torch.bool:
                raise ValueError(f"{name} must be an int or an integer (B,) tensor, got a {length.dtype} tensor "
                                 f"of shape {tuple(length.shape)}")
            self.length: int | Tensor = length
        else:
            self.length = _positive_int(name, length, minimum=0)

    def __repr__(self) -> str:
        return f"{self.name}={self.length if isinstance(self.length, int) else 'tensor'}"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        length = self.length[b] if isinstance(self.length, Tensor) else self.length  # (B, 1, 1, 1)
        return kv_idx < length  # (1, 1, 1, S) -> (B?, 1, 1, S)

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        if isinstance(self.length, Tensor) and self.length.numel() != batch:
            raise ValueError(f"{self.name} has {self.length.numel()} lengths (one per sequence) but the batch has "
                             f"B={batch}")

    def block_rule(self, batch: int, q_positions: range, kv_positions: range) -> BlockRule | None:
        if isinstance(self.length, Tensor) and torch.compiler.is_compiling():
            return None  # reading the lengths would be a data-dependent branch
        lengths = [self.length] if isinstance(self.length, int) else self.length.tolist()
        low, high = min(lengths), max(lengths)  # one host read per call

        def rule(qs: range, ks: range) -> Visibility:
            if ks.stop - 1 < low:
                return Visibility.ALL
            return Visibility.NONE if ks.start >= high else Visibility.SOME
        return rule


def prefix_lm(prefix_length: int | Tensor) -> MaskModifier:
    """Prefix-LM: the first ``prefix_length`` positions (an int, or (B,) per sequence) are seen by
    every query, bidirectionally; after them attention is causal."""
    return or_masks(causal(), KeysBefore(prefix_length, "prefix_length"))


def sink_window(sinks: int, window: int) -> MaskModifier:
    """StreamingLLM: each query sees the first ``sinks`` positions (attention sinks) and its ``window``
    most recent keys, never a later one."""
    sinks = _positive_int("sinks", sinks)
    return or_masks(sliding_window(window), and_masks(causal(), KeysBefore(sinks, "sinks")))


def _run_starts(doc_ids: Tensor) -> Tensor:
    """True where a run of equal ids begins, (S,) or (B, S) like ``doc_ids``: at 0 and where the id changes."""
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    return starts


def document_positions(doc_ids: Tensor) -> Tensor:
    """Positions that restart at 0 in each document: (S,) or (B, S) long, like ``doc_ids``.

    A document is a run of equal ids (packed sequences). These are the
    positions for rotary embedding of a packed batch, and what
    :func:`document_mask` gives a modifier nested in it.
    """
    index = torch.arange(doc_ids.shape[-1], device=doc_ids.device).expand_as(doc_ids)  # (S,) or (B, S)
    first = torch.where(_run_starts(doc_ids), index, 0).cummax(dim=-1).values  # where each token's run began
    return index - first


def _documents(doc_ids: Tensor) -> Tensor:
    """Each position's document, counted 1, 2, ... along each sequence, one per run of equal ids: sorted,
    and equal only within a run ([7, 7, 3, 7] -> [1, 1, 2, 3])."""
    return _run_starts(doc_ids).cumsum(dim=-1)  # (S,) or (B, S) long


class DocumentMask(MaskModifier):
    """Queries see only keys of their own document, the run of equal ids they are in (and ``inner`` at the
    positions within the document, when given): an id that comes back later starts another document."""

    def __init__(self, doc_ids: Tensor, inner: MaskMod | None = None) -> None:
        if (not isinstance(doc_ids, Tensor) or doc_ids.dim() not in (1, 2) or doc_ids.is_floating_point()
                or doc_ids.dtype in (torch.bool, torch.complex64, torch.complex128)):
            got = f"{doc_ids.dtype} {tuple(doc_ids.shape)}" if isinstance(doc_ids, Tensor) else type(doc_ids).__name__
            raise ValueError(f"document_mask's doc_ids must be an integer tensor (S,) or (B, S), one document id "
                             f"per position; got {got}")
        if inner is not None and not callable(inner):
            raise TypeError(f"document_mask's mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool or None, "
                            f"got {type(inner).__name__}")
        self.doc_ids, self.inner = doc_ids, inner
        self.documents = _documents(doc_ids)
        self.positions = None if inner is None else document_positions(doc_ids)

    def __repr__(self) -> str:
        inner = "" if self.inner is None else f", {modifier_name(self.inner)}"
        return f"document_mask(doc_ids {tuple(self.doc_ids.shape)}{inner})"

    def _at(self, table: Tensor, b: Tensor, idx: Tensor) -> Tensor:
        return table[idx] if table.dim() == 1 else table[b, idx]  # (B?, 1, T, 1) or (B?, 1, 1, S)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = self._at(self.documents, b, q_idx) == self._at(self.documents, b, kv_idx)  # (B?, 1, T, S)
        if self.inner is None or self.positions is None:
            return same
        local_q, local_kv = self._at(self.positions, b, q_idx), self._at(self.positions, b, kv_idx)
        return same & mask_result(self.inner, self.inner(b, h, local_q, local_kv))

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        if q_positions.start < 0:
            raise ValueError(f"{self!r}: the queries start at position {q_positions.start} (more queries than keys), "
                             "outside every document; give at least as many keys as queries")
        needed = max(q_positions.stop, kv_positions.stop)
        rows_ok = self.doc_ids.dim() == 1 or self.doc_ids.shape[0] == batch
        if self.doc_ids.shape[-1] < needed or not rows_ok:
            raise ValueError(f"{self!r}: doc_ids must label positions 0 .. {needed - 1} of each sequence, as (S,) "
                             f"= ({needed},) or (B, S) = ({batch}, {needed}); got shape {tuple(self.doc_ids.shape)}")
        if isinstance(self.inner, (MaskModifier, ScoreModifier)):
            self.inner.check(batch, num_heads, q_positions, kv_positions)

    def block_rule(self, batch: int, q_positions: range, kv_positions: range) -> BlockRule | None:
        """Exact (the documents are numbered in order along each sequence); None while compiling (reading them
        would be a data-dependent branch)."""
        if torch.compiler.is_compiling():
            return None
        docs = self.documents
        rows = docs.tolist() if docs.dim() == 2 else [docs.tolist()]  # one host read
        nested = self.inner is not None

        def rule(qs: range, ks: range) -> Visibility | None:
            overlap, single = False, True
            for row in rows:
                qa, qb, ka, kb = row[qs.start], row[qs.stop - 1], row[ks.start], row[ks.stop - 1]
                if qb >= ka and kb >= qa:  # numbered in order: the blocks share a document
                    overlap = True
                    single = single and qa == qb == ka == kb
                else:
                    single = False
            if not overlap:
                return Visibility.NONE
            return None if nested else Visibility.ALL if single else Visibility.SOME
        return rule


def document_mask(doc_ids: Tensor, mask_mod: MaskMod | None = None) -> DocumentMask:
    """Packed sequences: each query sees only keys of its own document.

    ``doc_ids`` (S,) or (B, S), integer: the document of each position; a
    document is a run of equal ids, so an id may come back later as another
    document ([0, 0, 1, 1, 0, 0] is three; the chunked kernel skips blocks
    between documents without evaluating them). ``mask_mod``, if given,
    applies within each document at positions that restart at 0 there
    (:func:`document_positions`).
    """
    return DocumentMask(doc_ids, mask_mod)


# ----------------------------------------------------------------------------- combinators


def mask_result(fn: object, out: object) -> Tensor:
    """``out`` if it is what a mask modifier must return (a bool tensor); else TypeError naming ``fn``."""
    if not isinstance(out, Tensor) or out.dtype != torch.bool:
        got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else f"{type(out).__name__} {out!r:.40}"
        raise TypeError(f"mask_mod {modifier_name(fn)} returned {got}; expected a bool tensor (True = may attend) "
                        "that broadcasts to the scores (B, H, T, S)")
    return out


def block_rule_of(fn: object, batch: int, q_positions: range, kv_positions: range) -> BlockRule | None:
    """``fn``'s block rule for a call at these positions; None for a plain function, and for a subclass that
    overrides ``__call__`` but not the rule it inherits (which no longer describes it: see :func:`declares`)."""
    if not isinstance(fn, MaskModifier) or not declares(fn, "block_rule"):
        return None
    return fn.block_rule(batch, q_positions, kv_positions)


class _Combined(MaskModifier):
    """Shared by :func:`and_masks` and :func:`or_masks`."""

    name = ""

    def __init__(self, mods: tuple[MaskMod, ...]) -> None:
        for i, mod in enumerate(mods):
            if not callable(mod):
                raise TypeError(f"{self.name} takes mask modifiers, callables (b, h, q_idx, kv_idx) -> bool; "
                                f"argument {i} is {type(mod).__name__}")
        if not mods:
            raise ValueError(f"{self.name} needs at least one mask modifier")
        self.mods = mods

    def __repr__(self) -> str:
        return f"{self.name}({', '.join(modifier_name(m) for m in self.mods)})"

    def check(self, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
        for mod in self.mods:
            if isinstance(mod, MaskModifier):
                mod.check(batch, num_heads, q_positions, kv_positions)

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        result = mask_result(self.mods[0], self.mods[0](b, h, q_idx, kv_idx))
        for mod in self.mods[1:]:
            result = self.merge(result, mask_result(mod, mod(b, h, q_idx, kv_idx)))  # broadcasts
        return result

    def merge(self, seen: Tensor, more: Tensor) -> Tensor:
        """The mask of the members so far and the next member's as one."""
        raise NotImplementedError

    def combine(self, states: list[Visibility | None]) -> Visibility | None:
        """The members' verdicts on one block as one."""
        raise NotImplementedError

    def block_rule(self, batch: int, q_positions: range, kv_positions: range) -> BlockRule | None:
        rules = [block_rule_of(mod, batch, q_positions, kv_positions) for mod in self.mods]
        if all(rule is None for rule in rules):
            return None
        return lambda qs, ks: self.combine([None if rule is None else rule(qs, ks) for rule in rules])


class AndMasks(_Combined):
    name = "and_masks"

    def merge(self, seen: Tensor, more: Tensor) -> Tensor:
        return seen & more

    def combine(self, states: list[Visibility | None]) -> Visibility | None:
        if Visibility.NONE in states:
            return Visibility.NONE
        partial = [s for s in states if s is not Visibility.ALL]
        if not partial:
            return Visibility.ALL
        return Visibility.SOME if partial == [Visibility.SOME] else None  # two partial masks may not overlap


class OrMasks(_Combined):
    name = "or_masks"

    def merge(self, seen: Tensor, more: Tensor) -> Tensor:
        return seen | more

    def combine(self, states: list[Visibility | None]) -> Visibility | None:
        if Visibility.ALL in states:
            return Visibility.ALL
        if all(s is Visibility.NONE for s in states):
            return Visibility.NONE
        return Visibility.SOME if Visibility.SOME in states else None


def and_masks(*mask_mods: MaskMod) -> AndMasks:
    """A key is visible if every one of ``mask_mods`` lets the query see it (their intersection)."""
    return AndMasks(mask_mods)


def or_masks(*mask_mods: MaskMod) -> OrMasks:
    """A key is visible if any one of ``mask_mods`` lets the query see it (their union)."""
    return OrMasks(mask_mods)
