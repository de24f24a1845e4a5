"""Notebook 004 (the chapter again, other seeds): its printed numbers.

Its ``CasualAttention`` drops the result of ``masked_fill``, so the outputs it
prints for that class and for the wrapper are *not* causal. Those tests show
the printed numbers are the unmasked computation, and that attnkit's fixed
class agrees with them only where a mask changes nothing: the last token.
"""

from __future__ import annotations

import torch

from attnkit import textbook as tb
from tests._util import assert_printed

INPUTS = tb.book_inputs()


def test_step_by_step_with_rand_weights():
    torch.manual_seed(42)
    w_query, w_key, w_value = (torch.rand(3, 2) for _ in range(3))
    x_2 = INPUTS[1]
    query_2 = x_2 @ w_query
    keys, values = INPUTS @ w_key, INPUTS @ w_value
    assert_printed(query_2, [1.0760, 1.7344])
    assert_printed(query_2.dot(keys[1]), torch.tensor(3.3338))
    attention_score_2 = tb.attn_scores_for_query(keys, query_2)
    assert_printed(attention_score_2, [2.7084, 3.3338, 3.3013, 1.7563, 1.7869, 2.1966])
    attention_weights_2 = tb.softmax_stable(attention_score_2 / keys.shape[-1] ** 0.5)
    assert_printed(attention_weights_2, [0.1723, 0.2681, 0.2620, 0.0879, 0.0898, 0.1200])
    assert_printed(attention_weights_2 @ values, [1.4201, 0.8892])


def test_self_attention_v1_seed_123():
    torch.manual_seed(123)
    out = tb.SelfAttention_v1(3, 2)(INPUTS)
    assert_printed(out[:2], [[0.2845, 0.4071], [0.2854, 0.4081]])


def _sa_v2_768() -> tb.SelfAttention_v2:
    torch.manual_seed(768)
    return tb.SelfAttention_v2(3, 2)


def test_self_attention_v2_seed_768():
    assert_printed(
        _sa_v2_768()(INPUTS),
        [
            [-0.0256, -0.0702],
            [-0.0175, -0.0742],
            [-0.0175, -0.0744],
            [-0.0177, -0.0735],
            [-0.0187, -0.0765],
            [-0.0175, -0.0721],
        ],
    )


CAUSAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5130, 0.4870, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3453, 0.3274, 0.3273, 0.0000, 0.0000, 0.0000],
    [0.2586, 0.2478, 0.2479, 0.2457, 0.0000, 0.0000],
    [0.2104, 0.1982, 0.1975, 0.2048, 0.1890, 0.0000],
    [0.1722, 0.1667, 0.1671, 0.1624, 0.1722, 0.1593],
]


def test_causal_masking_both_ways_and_dropout():
    sa_v2 = _sa_v2_768()
    queries, keys = sa_v2.W_query(INPUTS), sa_v2.W_key(INPUTS)
    attention_scores = queries @ keys.T
    attention_weights = torch.softmax(attention_scores / keys.shape[-1] ** 0.5, dim=-1)
    weights = [
        [0.1546, 0.1686, 0.1686, 0.1703, 0.1673, 0.1706],
        [0.1741, 0.1653, 0.1653, 0.1649, 0.1653, 0.1651],
        [0.1742, 0.1652, 0.1651, 0.1651, 0.1648, 0.1656],
        [0.1731, 0.1658, 0.1659, 0.1644, 0.1672, 0.1637],
        [0.1737, 0.1636, 0.1631, 0.1691, 0.1561, 0.1744],
        [0.1722, 0.1667, 0.1671, 0.1624, 0.1722, 0.1593],
    ]
    assert_printed(attention_weights, weights)
    assert_printed(attention_weights * tb.causal_mask_simple(6), torch.tensor(weights).tril())
    assert_printed(tb.mask_by_renormalizing(attention_weights), CAUSAL_WEIGHTS)
    inf = float("-inf")
    masked = tb.mask_with_neg_inf(attention_scores)
    assert_printed(
        masked,
        [
            [-0.1101, inf, inf, inf, inf, inf],
            [0.0592, -0.0141, inf, inf, inf, inf],
            [0.0569, -0.0181, -0.0186, inf, inf, inf],
            [0.0615, 0.0007, 0.0014, -0.0112, inf, inf],
            [-0.0016, -0.0861, -0.0909, -0.0399, -0.1530, inf],
            [0.0848, 0.0392, 0.0422, 0.0024, 0.0853, -0.0248],
        ],
    )
    causal_weights = torch.softmax(masked / keys.shape[-1] ** 0.5, dim=-1)
    assert_printed(causal_weights, CAUSAL_WEIGHTS)
    torch.manual_seed(123)
    assert_printed(
        torch.nn.Dropout(0.5)(causal_weights),
        [
            [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.6905, 0.6549, 0.6546, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.4955, 0.4958, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.3964, 0.0000, 0.4096, 0.0000, 0.0000],
            [0.0000, 0.3334, 0.3341, 0.3249, 0.3445, 0.0000],
        ],
    )


# What 004 printed for its CasualAttention and for a wrapper of two of them.
PRINTED_UNMASKED_HEAD = [
    [-0.5337, -0.1051],
    [-0.5323, -0.1080],
    [-0.5323, -0.1079],
    [-0.5297, -0.1076],
    [-0.5311, -0.1066],
    [-0.5299, -0.1081],
]
PRINTED_UNMASKED_WRAPPER = [
    [-0.5337, -0.1051, 0.5085, 0.3508],
    [-0.5323, -0.1080, 0.5084, 0.3508],
    [-0.5323, -0.1079, 0.5084, 0.3506],
    [-0.5297, -0.1076, 0.5074, 0.3471],
    [-0.5311, -0.1066, 0.5076, 0.3446],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]


def _unmasked(head: tb.CausalAttention, x: torch.Tensor) -> torch.Tensor:
    """004's computation: scores never masked."""
    q, k, v = head.W_query(x), head.W_key(x), head.W_value(x)
    return torch.softmax(q @ k.transpose(-2, -1) / k.shape[-1] ** 0.5, dim=-1) @ v


def test_printed_causal_attention_is_the_unmasked_computation():
    torch.manual_seed(123)
    ca = tb.CausalAttention(3, 2, 6, 0.0)
    batch = tb.book_batch()
    assert_printed(_unmasked(ca, batch), [PRINTED_UNMASKED_HEAD] * 2)
    fixed = ca(batch)
    # The last token may see every token, so the mask does not change its row:
    assert_printed(fixed[:, -1], [PRINTED_UNMASKED_HEAD[-1]] * 2)
    # The first token sees only itself: its context vector is its own value.
    torch.testing.assert_close(fixed[:, 0], ca.W_value(batch)[:, 0])
    assert (fixed[0, :-1] - torch.tensor(PRINTED_UNMASKED_HEAD[:-1])).abs().amax() > 1e-2


def test_wrapper_two_heads_fixed_matches_notebook_002_not_004():
    torch.manual_seed(123)
    mha = tb.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    out = mha(tb.book_batch())
    assert_printed(out[:, -1], [PRINTED_UNMASKED_WRAPPER[-1]] * 2)
    # 002 printed the correct, causal wrapper with the same seed (its first 2 heads):
    assert_printed(out[0, 0], [-0.4519, 0.2216, 0.4772, 0.1063])
    assert_printed(out[0, 1], [-0.5874, 0.0058, 0.5891, 0.3257])


def test_multi_head_attention_weight_split_seed_123():
    torch.manual_seed(123)
    mha = tb.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    row = [
        [0.3190, 0.4858],
        [0.2943, 0.3897],
        [0.2856, 0.3593],
        [0.2693, 0.3873],
        [0.2639, 0.3928],
        [0.2575, 0.4028],
    ]
    assert_printed(mha(tb.book_batch()), [row, row])
