"""Score and mask modifiers inside the kernels: checks, index tensors, block rules, learned sinks.

The built-ins and the modifier protocol are in :mod:`attnkit.functional.modifiers`;
this module applies them:

- :func:`check_modifier` / :func:`check_sinks`: the arguments of one call;
- :func:`index_grid`: the broadcasting (b, h, q_idx, kv_idx) of a block of
  positions; :func:`apply_score_mod` and :func:`apply_mask_mod` call a
  modifier there and check what it returned, naming it;
- :func:`additive_bias`: whether SDPA can take a score modifier as a mask;
- :func:`add_sinks` / :func:`sink_grad`: learned per-head sinks, a logit per
  head in every softmax denominator (as a key with that score and value 0).

The chunked kernel's side (block rules, per-block evaluation, the tensors a
score modifier closes over) is in :mod:`.blockmods`.

Legend: B batch, H query heads, T queries, S keys, Tb / Sb a block of them.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from attnkit.functional.modifiers import (
    MaskMod,
    MaskModifier,
    ScoreMod,
    ScoreModifier,
    declares,
    mask_result,
    modifier_name,
)

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")


def check_modifier(fn: object, name: str, args: tuple[str, ...]) -> None:
    """None, or a callable that takes ``args`` positionally; else TypeError naming what was expected."""
    if fn is None:
        return
    wanted = f"({', '.join(args)})"
    if not callable(fn):
        raise TypeError(f"{name} must be a callable {wanted} -> {'bool' if name == 'mask_mod' else 'score'}, "
                        f"as FlexAttention's, or None; got {type(fn).__name__}")
    if torch.compiler.is_compiling():
        return  # checked when the call runs eagerly; inspect is not traced
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: its first call will tell
        return
    try:
        signature.bind(*args)
    except TypeError:
        raise TypeError(f"{name} {modifier_name(fn)} must take {len(args)} positional arguments {wanted}, as "
                        f"FlexAttention's {name}; its signature is {signature}") from None


def check_geometry(fn: object, batch: int, num_heads: int, q_positions: range, kv_positions: range) -> None:
    """Let a built-in refuse a call it cannot serve (head counts, document lengths)."""
    if isinstance(fn, (ScoreModifier, MaskModifier)):
        fn.check(batch, num_heads, q_positions, kv_positions)


def check_sinks(sinks: object, q: Tensor) -> Tensor | None:
    """None, or a floating-point (H,) tensor on q's device: one sink logit per query head."""
    if sinks is None:
        return None
    h = q.shape[1]
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (h,):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating-point (H,) = ({h},) tensor, one logit per query head; got {got}")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
    return sinks


def index_grid(batch: int, num_heads: int, q_positions: range, kv_positions: range, device: torch.device
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, Tb, 1), kv_idx (1, 1, 1, Sb)), long, broadcasting."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(num_heads, device=device).view(1, -1, 1, 1)
    q_idx = torch.arange(q_positions.start, q_positions.stop, device=device).view(1, 1, -1, 1)
    kv_idx = torch.arange(kv_positions.start, kv_positions.stop, device=device).view(1, 1, 1, -1)
    return b, h, q_idx, kv_idx


def call_modifier(fn: object, name: str, args: tuple[str, ...], *inputs: Tensor) -> object:
    """``fn(*inputs)``; an error it raises keeps its type and traceback and gains a note naming the modifier."""
    try:
        return fn(*inputs)  # type: ignore[operator]
    except Exception as err:
        note = f"(raised by {name} {modifier_name(fn)}, called as FlexAttention's {name}({', '.join(args)}))"
        if hasattr(err, "add_note"):  # Python 3.11+; the error keeps its own type and traceback either way
            err.add_note(note)
        raise


def positions_grid(num_heads: int, q_positions: Tensor, kv_positions: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (B, 1, T, 1), kv_idx (B, 1, 1, S)) from explicit positions.

    ``q_positions`` (B, T) and ``kv_positions`` (B, S) are long, each row at
    its own positions (-1: padding, or an empty cache slot).
    """
    batch, device = q_positions.shape[0], q_positions.device
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(num_heads, device=device).view(1, -1, 1, 1)
    return b, h, q_positions[:, None, :, None], kv_positions[:, None, None, :]  # (B, T) -> (B, 1, T, 1) etc.


class PresentKeys(MaskModifier):
    """Hides keys at position -1 (empty cache slots, padding): what explicit positions add to a call's mask."""

    def __repr__(self) -> str:
        return "present_keys()"

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx >= 0  # (B, 1, 1, S)


def position_ranges(q_positions: Tensor, kv_positions: Tensor) -> tuple[range, range]:
    """The span of explicit positions as ranges, for the built-ins' checks (one host read)."""
    low = int(q_positions.clamp_min(0).min())
    return range(low, int(q_positions.max()) + 1), range(0, int(kv_positions.max()) + 1)


def _scores_shape(idx: tuple[Tensor, ...]) -> tuple[int, int, int, int]:
    b, h, q_idx, kv_idx = idx
    return b.shape[0], h.shape[1], q_idx.shape[2], kv_idx.shape[3]


def apply_score_mod(fn: ScoreMod, scores: Tensor, idx: tuple[Tensor, ...],
                    whole: tuple[int, ...] | None = None) -> Tensor:
    """fn(scores, *idx), checked: floating point, of the scores' shape (a smaller result broadcasts to it).

    ``whole``: the call's scores (B, H, T, S) when ``scores`` is a block of
    them (a kernel's block, a probe), for the errors to name.
    """
    out = call_modifier(fn, "score_mod", SCORE_ARGS, scores, *idx)
    shape = tuple(scores.shape)
    whole = shape if whole is None else tuple(whole)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        got = f"a {out.dtype} tensor" if isinstance(out, Tensor) else f"{type(out).__name__}"
        raise TypeError(f"score_mod {modifier_name(fn)} returned {got}; expected a floating-point tensor of the "
                        f"scores' shape {whole}")
    if out.shape != scores.shape:
        try:
            fits = torch.broadcast_shapes(out.shape, scores.shape) == scores.shape
        except RuntimeError:
            fits = False
        if not fits:
            on = "" if whole == shape else f" on a block {shape} of the scores (B, H, T, S) = {whole}"
            expected = "the block's shape" if on else f"the scores' shape {shape} (B, H, T, S)"
            raise ValueError(f"score_mod {modifier_name(fn)} returned shape {tuple(out.shape)}{on}; expected "
                             f"{expected}: a score modifier must not change it")
        out = out.expand(scores.shape).contiguous()  # the kernels may write into it
    return out if out.dtype == scores.dtype else out.to(scores.dtype)


def apply_mask_mod(fn: MaskMod, idx: tuple[Tensor, ...], whole: tuple[int, ...] | None = None) -> Tensor:
    """fn(*idx), checked: bool, broadcastable to (B, H, Tb, Sb) of these indices.

    ``whole``: the call's scores (B, H, T, S) when the indices are a block of them, for the error to name.
    """
    out = mask_result(fn, call_modifier(fn, "mask_mod", MASK_ARGS, *idx))
    shape = _scores_shape(idx)
    try:
        fits = out.dim() <= 4 and torch.broadcast_shapes(out.shape, shape) == shape
    except RuntimeError:
        fits = False
    if not fits:
        to = f"(B, H, T, S) = {shape}" if whole in (None, shape) else f"its block {shape} of (B, H, T, S) = {whole}"
        raise ValueError(f"mask_mod {modifier_name(fn)} returned shape {tuple(out.shape)}; expected a bool tensor "
                         f"that broadcasts to {to}")
    return out


def additive_bias(fn: ScoreMod) -> ScoreModifier | None:
    """``fn`` if it declares itself score + bias (:meth:`ScoreModifier.bias`), else None."""
    return fn if isinstance(fn, ScoreModifier) and declares(fn, "bias") else None


def can_branch_on_data(t: Tensor) -> bool:
    """Whether a Python branch on t's values is allowed: not while compiling, not under torch.func."""
    return not torch.compiler.is_compiling() and not torch._C._functorch.is_functorch_wrapped_tensor(t)


def add_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """A sink logit per head in the softmax denominator: (out (B, H, T, Dv), lse (B, H, T)) over keys and sink.

    ``out`` is softmax-normalised over the keys with log-sum-exp ``lse``
    (-inf where a query sees none); the sink is one more key with score
    sinks[h] and value 0, so out shrinks by exp(lse - new lse).
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)  # (H,) -> (1, H, 1)
    total = torch.logaddexp(lse, sink)  # (B, H, T)
    safe = total.masked_fill(total == -torch.inf, 0.0)  # no key and a -inf sink: out stays 0
    return out * torch.exp(lse - safe).unsqueeze(-1), total


def sink_grad(sinks: Tensor, lse: Tensor, delta: Tensor) -> Tensor:
    """d loss / d sinks (H,): the sink's weight exp(sink - lse) times its dscore 0 - delta, summed over B and T.

    ``lse`` (B, H, T) covers keys and sink; ``delta`` (B, H, T) = rowsum(dO * O).
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)  # (H,) -> (1, H, 1)
    safe = lse.masked_fill(lse == -torch.inf, 0.0)
    weight = torch.exp(sink - safe)  # (B, H, T)
    return -(weight * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (B, H, T) -> (H,)
