"""Masks: bottom-right causal alignment, windows, block visibility, combining."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.functional import (
    block_has_empty_rows,
    block_visibility,
    causal_mask,
    combine_masks,
    key_padding_to_mask,
    visible_band,
)


def test_causal_mask_bottom_right_and_square():
    assert torch.equal(causal_mask(3, 3), torch.ones(3, 3, dtype=torch.bool).tril())
    assert torch.equal(causal_mask(2, 5), torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, 4), torch.ones(1, 4, dtype=torch.bool))  # decoding: sees all
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
    """"none" lets kernels skip a block and "all" lets them drop its mask: both must be exact."""
    rows, cols, kw = block
    band = visible_band(rows, cols, **kw)
    verdict = block_visibility(rows, cols, **kw)
    if band is None:
        assert verdict == "all"
    else:
        assert verdict == ("none" if not band.any() else "all" if band.all() else "some")


@given(blocks())
@settings(max_examples=200, deadline=None)
def test_block_has_empty_rows_is_exact(block):
    """Kernels skip the empty-row guard when this says no row is empty: it must never miss one."""
    rows, cols, kw = block
    band = visible_band(rows, cols, **kw)
    expected = band is not None and bool((~band.any(dim=-1)).any())
    assert block_has_empty_rows(rows, cols, **kw) == expected


def test_combine_masks():
    a = torch.tensor([True, True, False])
    b = torch.tensor([True, False, True])
    assert torch.equal(combine_masks(a, b), torch.tensor([True, False, False]))
    assert combine_masks(None, b) is b and combine_masks(a, None) is a and combine_masks(None, None) is None
    bias = torch.tensor([0.5, -1.0, 2.0])
    torch.testing.assert_close(combine_masks(bias, a), torch.tensor([0.5, -1.0, -torch.inf]))
    torch.testing.assert_close(combine_masks(a, bias), torch.tensor([0.5, -1.0, -torch.inf]))
    torch.testing.assert_close(combine_masks(bias, bias), 2 * bias)


def test_key_padding_to_mask_shape():
    keys = torch.tensor([[True, False, True]])
    assert key_padding_to_mask(keys).shape == (1, 1, 1, 3)
