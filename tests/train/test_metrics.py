"""Induction and previous-token scores on hand-built attention patterns whose scores are known."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.train import Batch, induction_scores, make_batch, previous_token_scores


def _batch(tokens_len: int, first: list[int], second: list[int], length: list[int]) -> Batch:
    b = len(first)
    return Batch(torch.zeros(b, tokens_len, dtype=torch.long), torch.tensor(first), torch.tensor(second),
                 torch.tensor(length))


def _one_hot(rows: list[list[int]], t: int) -> torch.Tensor:
    """(B, 1, T, T) weights with all of query i's attention on key rows[b][i]."""
    return torch.nn.functional.one_hot(torch.tensor(rows), t).double()[:, None]


def _reference_induction(weights: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Loop over sequences and repeat positions, in float64: the definition, written plainly."""
    total, count = torch.zeros(weights.shape[1], dtype=torch.float64), 0
    for b in range(weights.shape[0]):
        first, second, length = int(batch.first[b]), int(batch.second[b]), int(batch.length[b])
        for i in range(length):
            total += weights[b, :, second + i, first + i + 1].double()
            count += 1
    return total / count


def test_perfect_induction_pattern_scores_one_and_previous_token_pattern_scores_zero():
    """Off-by-one bugs in the target (attending to the earlier token itself, or two after) would break these."""
    t = 10
    batch = _batch(t, first=[1, 0], second=[5, 6], length=[3, 2])
    rows = [[0, 1, 2, 3, 4, 2, 3, 4, 8, 9], [0, 1, 2, 3, 4, 5, 1, 2, 8, 9]]  # repeat queries -> first + i + 1
    ind = _one_hot(rows, t)
    torch.testing.assert_close(induction_scores(ind, batch), torch.tensor([1.0], dtype=torch.float64))
    prev = _one_hot([[0, *range(t - 1)]] * 2, t)  # every query t >= 1 on t - 1
    torch.testing.assert_close(previous_token_scores(prev), torch.tensor([1.0], dtype=torch.float64))
    torch.testing.assert_close(induction_scores(prev, batch), torch.tensor([0.0], dtype=torch.float64))
    # and the induction pattern (self elsewhere) never looks at the previous position
    torch.testing.assert_close(previous_token_scores(ind), torch.tensor([0.0], dtype=torch.float64))


def test_uniform_causal_attention_has_the_known_scores():
    """Query t spreading evenly over keys 0..t gives 1 / (t + 1) to each: a mean over the wrong queries breaks it."""
    t = 8
    batch = _batch(t, first=[0], second=[4], length=[3])
    weights = torch.tril(torch.ones(t, t, dtype=torch.float64))
    weights = (weights / weights.sum(-1, keepdim=True))[None, None]  # (1, 1, T, T)
    expected_ind = (1 / 5 + 1 / 6 + 1 / 7) / 3  # repeat queries 4, 5, 6
    expected_prev = sum(1 / (q + 1) for q in range(1, t)) / (t - 1)
    torch.testing.assert_close(induction_scores(weights, batch), torch.tensor([expected_ind], dtype=torch.float64))
    torch.testing.assert_close(previous_token_scores(weights), torch.tensor([expected_prev], dtype=torch.float64))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(4, 24), heads=st.integers(1, 3))
def test_induction_score_matches_a_plain_loop_on_random_weights(seed, seq_len, heads):
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(3, seq_len, 5, generator=gen)
    weights = torch.rand(3, heads, seq_len, seq_len, generator=gen, dtype=torch.float64).softmax(-1)
    torch.testing.assert_close(induction_scores(weights, batch), _reference_induction(weights, batch))
    expected_prev = torch.stack([weights[:, :, q, q - 1] for q in range(1, seq_len)], -1).mean(dim=(0, 2))
    torch.testing.assert_close(previous_token_scores(weights), expected_prev)


def test_scores_reject_weights_of_the_wrong_shape():
    batch = _batch(6, first=[0], second=[3], length=[2])
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        induction_scores(torch.ones(1, 6, 6), batch)
    with pytest.raises(ValueError, match="do not match the batch"):
        induction_scores(torch.ones(1, 1, 5, 5), batch)
    with pytest.raises(ValueError, match=r"\(B, H, T, T\)"):
        previous_token_scores(torch.ones(1, 1, 4, 5))
