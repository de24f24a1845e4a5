"""Masks: bottom-right causal alignment, windows, block visibility, combining."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.functional import (
    Visibility,
    block_has_empty_rows,
    block_visibility,
    combine_masks,
    key_padding_to_mask,
    visible_band,
)


def causal_mask(t: int, s: int, window: int | None = None) -> torch.Tensor:
    """The whole (T, S) bottom-right causal band, all True where it hides nothing."""
    band = visible_band(range(t), range(s), offset=s - t, causal=True, window=window)
    return torch.ones(t, s, dtype=torch.bool) if band is None else band


def reference_band(rows: range, cols: range, offset: int, causal: bool, window: int | None) -> torch.Tensor:
    """The band, entry by entry, from its definition (independent of attnkit)."""
    return torch.tensor([[(not causal or j <= i + offset) and (window is None or j > i + offset - window)
                          for j in cols] for i in rows], dtype=torch.bool).reshape(len(rows), len(cols))


def test_causal_mask_bottom_right_and_square():
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(causal_mask(2, 5), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, 4), torch.ones(1, 4, dtype=torch.bool))  # decoding: sees all
    assert visible_band(range(1), range(4), offset=3, causal=True, window=None) is None  # so no band is built
    assert not causal_mask(3, 2)[0].any()  # T > S: the first query has no key


def test_window_keeps_the_w_most_recent_keys_including_itself():
    mask = causal_mask(4, 6, window=2)  # query i sits at position i + 2
    expected = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0],
                             [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


@st.composite
def blocks(draw: st.DrawFn) -> tuple[range, range, dict]:
    """A (rows, cols) block of a T x S attention and the band's keywords (offset = S - T, causal, window)."""
    t, s = draw(st.integers(1, 40)), draw(st.integers(1, 40))
    r0, c0 = draw(st.integers(0, 39)), draw(st.integers(0, 39))
    h, w = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rows, cols = range(min(r0, t - 1), min(r0 + h, t)), range(min(c0, s - 1), min(c0 + w, s))
    band = {"offset": s - t, "causal": draw(st.booleans()), "window": draw(st.one_of(st.none(), st.integers(1, 9)))}
    return rows, cols, band


@given(blocks())
@settings(max_examples=200, deadline=None)
def test_block_visibility_is_exact(block):
    """NONE lets kernels skip a block and ALL lets them drop its mask: both must be exact."""
    rows, cols, kw = block
    expected = reference_band(rows, cols, **kw)
    verdict = block_visibility(rows, cols, **kw)
    assert verdict == (Visibility.NONE if not expected.any() else Visibility.ALL if expected.all()
                       else Visibility.SOME)
    band = visible_band(rows, cols, **kw)
    assert torch.equal(expected, torch.ones_like(expected) if band is None else band)
    assert (band is None) == (verdict is Visibility.ALL)  # no band is built where it would hide nothing


@given(blocks())
@settings(max_examples=200, deadline=None)
def test_block_has_empty_rows_is_exact(block):
    """Kernels skip the empty-row guard when this says no row is empty: it must never miss one."""
    rows, cols, kw = block
    expected = bool((~reference_band(rows, cols, **kw).any(dim=-1)).any())
    assert block_has_empty_rows(rows, cols, **kw) == expected


def test_combine_masks():
    a = torch.tensor([True, True, False])
    b = torch.tensor([True, False, True])
    assert torch.equal(combine_masks(a, b), torch.tensor([True, False, False]))
    assert combine_masks(None, b) is b and combine_masks(a, None) is a and combine_masks(None, None) is None
    additive = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(combine_masks(additive, a), torch.tensor([0.5, -1.0, -torch.inf]))
    torch.testing.assert_close(combine_masks(a, additive), torch.tensor([0.5, -1.0, -torch.inf]))
    torch.testing.assert_close(combine_masks(additive, additive), 2 * additive)


def test_key_padding_to_mask_broadcasts_each_rows_keys_to_every_head_and_query():
    keys = torch.tensor([[True, False, True], [False, True, True]])
    mask = key_padding_to_mask(keys)
    assert mask.shape == (2, 1, 1, 3)
    expanded = mask.expand(2, 4, 5, 3)  # (B, H, T, S)
    for b in range(2):
        assert torch.equal(expanded[b], keys[b].expand(4, 5, 3))
