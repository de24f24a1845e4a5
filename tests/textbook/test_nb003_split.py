"""Notebook 003 (d_model=9, 3 heads, seed 42): the head split step by step.

Its ``wq, wk, wv = nn.Linear(9, 9)`` are created in the same order as the
textbook MultiHeadAttention's W_query, W_key, W_value, so the seed reproduces
every number up to dropout. The dropout mask it prints for a (2, 3, 4, 4)
tensor comes from a different CPU Bernoulli kernel than PyTorch 2.13's (the
6 x 6 masks of notebooks 002 and 004 do reproduce), so the steps after dropout
start from the weights as printed; the notebook's class output, drawn after
that dropout, is not reproducible for the same reason.
"""

from __future__ import annotations

import torch

from attnkit import textbook as tb
from tests._util import assert_printed

Q_BATCH_0 = [
    [[-0.1936, -0.1699, 0.1577], [-1.3494, 0.1358, -0.4783],
     [-0.0148, -0.5717, 0.0037], [0.2234, -0.3064, -0.5063]],
    [[0.1638, -0.0595, 0.2435], [0.5134, 0.2944, 0.9202],
     [-0.1530, 0.1878, -0.7437], [-0.3977, -0.7100, -0.6491]],
    [[-0.0672, -1.8729, 1.1167], [-0.0991, -0.0460, 1.0454],
     [0.4609, 0.6065, -0.0997], [-0.0332, -1.4115, 0.9683]],
]
Q_BATCH_1_HEADS_0_1 = [
    [[-0.3469, 0.2196, -0.0338], [-0.4134, -0.3903, -0.3228],
     [0.0970, -0.2078, 0.5537], [0.2554, -1.3217, -0.7302]],
    [[0.8727, -0.3630, 1.0433], [-0.0310, -0.4599, 0.5259],
     [0.0860, 0.0208, -0.6648], [-0.4612, -1.1273, -0.9428]],
]
SCORES_BATCH_1 = [
    [[0.2569, -0.2507, 0.0530, 0.0344], [0.0221, -0.5462, -0.1012, 0.1261],
     [-0.2866, -0.0408, -0.2315, -0.1548], [-0.6317, -0.2327, -0.2567, 0.1943]],
    [[0.4582, 0.8343, 1.8337, -0.7559], [0.0463, 0.6201, 0.7675, -0.1347],
     [0.1563, -0.1418, -0.5324, 0.1354], [0.2650, 0.9619, -0.3649, 0.4824]],
    [[-0.0670, -0.0365, -0.0631, -0.4189], [0.2537, 0.5420, 0.5959, 1.8983],
     [0.2429, -0.4177, -0.3470, 0.4181], [0.2617, 0.0530, 0.0512, 0.6890]],
]
WEIGHTS_BATCH_1 = [
    [[1.0, 0.0, 0.0, 0.0], [0.5813, 0.4187, 0.0, 0.0],
     [0.3140, 0.3619, 0.3241, 0.0], [0.1956, 0.2463, 0.2429, 0.3152]],
    [[1.0, 0.0, 0.0, 0.0], [0.4179, 0.5821, 0.0, 0.0],
     [0.3978, 0.3349, 0.2673, 0.0], [0.2313, 0.3458, 0.1607, 0.2622]],
    [[1.0, 0.0, 0.0, 0.0], [0.4585, 0.5415, 0.0, 0.0],
     [0.4177, 0.2852, 0.2971, 0.0], [0.2468, 0.2188, 0.2186, 0.3159]],
]
DROPPED_WEIGHTS_BATCH_1 = [
    [[0.0, 0.0, 0.0, 0.0], [0.9688, 0.0, 0.0, 0.0],
     [0.5233, 0.6031, 0.0, 0.0], [0.3260, 0.0, 0.0, 0.0]],
    [[1.6667, 0.0, 0.0, 0.0], [0.0, 0.9701, 0.0, 0.0],
     [0.6630, 0.5582, 0.4455, 0.0], [0.0, 0.5764, 0.0, 0.4370]],
    [[1.6667, 0.0, 0.0, 0.0], [0.7641, 0.9025, 0.0, 0.0],
     [0.0, 0.4754, 0.0, 0.0], [0.4113, 0.0, 0.0, 0.0]],
]
CONTEXT_BATCH_1 = [
    [[0.0, 0.0, 0.0], [0.5083, 0.6182, 0.3072],
     [0.4235, 0.4775, -0.2888], [0.1710, 0.2080, 0.1034]],
    [[1.4620, 0.1345, -1.6095], [0.1398, -0.9007, -0.8149],
     [0.9255, -0.4715, -1.2611], [-0.2885, -0.5021, 0.0798]],
    [[0.3246, 0.7681, 0.8544], [1.0397, 1.1539, 0.8462],
     [0.4692, 0.4223, 0.2394], [0.0801, 0.1896, 0.2109]],
]
MISTAKEN_MERGE_BATCH_1 = [
    [0.0, 0.0, 0.0, 0.5083, 0.6182, 0.3072, 0.4235, 0.4775, -0.2888],
    [0.1710, 0.2080, 0.1034, 1.4620, 0.1345, -1.6095, 0.1398, -0.9007, -0.8149],
    [0.9255, -0.4715, -1.2611, -0.2885, -0.5021, 0.0798, 0.3246, 0.7681, 0.8544],
    [1.0397, 1.1539, 0.8462, 0.4692, 0.4223, 0.2394, 0.0801, 0.1896, 0.2109],
]


def _seeded() -> tuple[torch.Tensor, tb.MultiHeadAttention]:
    torch.manual_seed(42)
    x = torch.randn(2, 4, 9)
    mha = tb.MultiHeadAttention(9, 9, context_length=4, dropout=0.4, num_heads=3, qkv_bias=True)
    return x, mha


def test_queries_split_into_three_heads():
    x, mha = _seeded()
    queries = mha.split_heads(mha.W_query(x))
    assert queries.shape == (2, 3, 4, 3)
    assert_printed(queries[0], Q_BATCH_0)
    assert_printed(queries[1, :2], Q_BATCH_1_HEADS_0_1)


def test_scores_mask_and_weights():
    x, mha = _seeded()
    queries = mha.split_heads(mha.W_query(x))
    keys = mha.split_heads(mha.W_key(x))
    scores = queries @ keys.transpose(2, 3)
    assert_printed(scores[1], SCORES_BATCH_1)
    masked = tb.mask_with_neg_inf(scores)
    weights = torch.softmax(masked / mha.head_dim**0.5, dim=-1)
    assert_printed(weights[1], WEIGHTS_BATCH_1)


def test_context_from_the_printed_dropped_weights_and_the_mistaken_merge():
    x, mha = _seeded()
    values = mha.split_heads(mha.W_value(x))
    dropped = torch.tensor(DROPPED_WEIGHTS_BATCH_1)
    context = dropped @ values[1]
    assert_printed(context, CONTEXT_BATCH_1)
    # The notebook's step-by-step merge viewed (heads, seq, hd) as (seq, d_model):
    assert_printed(context.contiguous().view(4, 9), MISTAKEN_MERGE_BATCH_1)
    merged = mha.merge_heads(context.unsqueeze(0))[0]
    # Token 0 gathers head 0, 1 and 2 at token 0:
    assert_printed(merged[0], [0.0, 0.0, 0.0, 1.4620, 0.1345, -1.6095, 0.3246, 0.7681, 0.8544])
    assert (merged - torch.tensor(MISTAKEN_MERGE_BATCH_1)).abs().amax() > 0.5
