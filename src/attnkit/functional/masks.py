"""Masks for attention, in attnkit's one convention: True = may attend.

A bool mask is True where a query may attend to a key. A float mask is added
to the scores: 0 keeps a key, -inf blocks it. Both broadcast to (B, H, T, S).

Causal masks are aligned bottom-right: with T queries that are the last T of
S keys (as in cached decoding), query i sees keys 0 .. S - T + i. A sliding
window of W lets query i see only its W most recent keys, itself included:
keys S - T + i - W + 1 .. S - T + i.

Legend: B batch, H query heads, T queries, S keys.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor


class Visibility(str, Enum):
    """How much of a (queries x keys) block the causal / window band lets through."""

    NONE = "none"
    ALL = "all"
    SOME = "some"


def visible_band(
    rows: range, cols: range, *, offset: int, causal: bool, window: int | None, device: torch.device | None = None
) -> Tensor | None:
    """The causal / sliding-window mask for query rows ``rows`` and key columns ``cols``.

    ``offset`` is S - T: query i is aligned with key i + offset (bottom-right
    causal alignment; ``offset=S - T`` over ``range(T), range(S)`` gives the
    whole (T, S) mask). Returns a bool (len(rows), len(cols)) tensor, True =
    may attend, or None when the band hides nothing in this block (neither
    causal nor window, or every key visible to every query).
    """
    if block_visibility(rows, cols, offset=offset, causal=causal, window=window) is Visibility.ALL:
        return None
    i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(1) + offset  # (Tb, 1)
    j = torch.arange(cols.start, cols.stop, device=device).unsqueeze(0)  # (1, Sb)
    visible = j <= i if causal else torch.ones(len(rows), len(cols), dtype=torch.bool, device=device)
    if window is not None:
        visible = visible & (j > i - window)  # (Tb, Sb)
    return visible


def block_visibility(rows: range | slice, cols: range | slice, *, offset: int, causal: bool,
                     window: int | None) -> Visibility:
    """Whether a (rows x cols) block of the causal/window band is NONE, ALL or SOME visible.

    Lets blocked kernels skip hidden blocks and drop the mask on full ones. Only
    ``start`` and ``stop`` are read: a slice keeps sizes symbolic under
    torch.compile, where ``range()`` would fix them.
    """
    first_i, last_i = rows.start + offset, rows.stop - 1 + offset
    first_j, last_j = cols.start, cols.stop - 1
    if causal and first_j > last_i:
        return Visibility.NONE
    if window is not None and last_j <= first_i - window:
        return Visibility.NONE
    if (not causal or last_j <= first_i) and (window is None or first_j > last_i - window):
        return Visibility.ALL
    return Visibility.SOME


def block_has_empty_rows(rows: range, cols: range, *, offset: int, causal: bool, window: int | None) -> bool:
    """Whether some query row of the block sees no key column under the causal/window band.

    Row i sees columns (i + offset - window, i + offset]: the first row is the
    one that can fall before the block, the last row the one a window can
    leave behind it.
    """
    first_i, last_i = rows.start + offset, rows.stop - 1 + offset
    if causal and first_i < cols.start:
        return True
    return window is not None and last_i - window + 1 > cols.stop - 1


def key_padding_to_mask(key_mask: Tensor) -> Tensor:
    """A (B, S) key mask, True = real token, as a mask broadcastable to (B, H, T, S)."""
    return key_mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)


def combine_masks(first: Tensor | None, second: Tensor | None) -> Tensor | None:
    """Both masks at once: a key is visible only if both allow it.

    Bool & bool stays bool; with a float (additive) mask, a key blocked by the
    bool mask gets -inf. The result broadcasts to the shapes of both.
    """
    if first is None or second is None:
        return first if second is None else second
    if first.dtype == torch.bool and second.dtype == torch.bool:
        return first & second
    if first.dtype == torch.bool:
        first, second = second, first
    if second.dtype == torch.bool:
        return torch.where(second, first, torch.tensor(-torch.inf, dtype=first.dtype, device=first.device))
    return first + second


def position_mask(q_positions: Tensor, k_positions: Tensor, *, causal: bool, window: int | None) -> Tensor:
    """Which key each query may see, from their positions: bool (B, 1, T, S), True = may attend.

    ``q_positions`` (B, T) and ``k_positions`` (B, S) are long; a key at
    position -1 is an empty slot that no query sees. With ``causal`` a query
    at position p sees keys at positions <= p, and with ``window`` only those
    > p - window: the band of :func:`visible_band`, aligned by positions
    instead of by index, so rows at different positions each get their own.
    """
    q = q_positions[:, :, None]  # (B, T) -> (B, T, 1)
    k = k_positions[:, None, :]  # (B, S) -> (B, 1, S)
    visible = k >= 0  # (B, 1, S)
    if causal:
        visible = visible & (k <= q)  # (B, T, S)
    if window is not None:
        visible = visible & (k > q - window)
    return visible.expand(-1, q.shape[1], -1)[:, None]  # (B, T, S) -> (B, 1, T, S)
