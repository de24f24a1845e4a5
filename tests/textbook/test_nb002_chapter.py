"""Notebook 002 (the whole chapter): every number it prints, reproduced.

Each test names the notebook cell it reproduces. Seeds and call order are the
notebook's, so a change in a class's parameter creation order, its scaling or
its masking changes these numbers.
"""

from __future__ import annotations

import torch

from attnkit import textbook as tb
from tests._util import assert_printed

INPUTS = tb.book_inputs()

ATTN_SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
]


def test_in4_scores_for_query_2_loop_and_matrix():
    expected = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
    assert_printed(tb.attn_scores_for_query_loop(INPUTS, INPUTS[1]), expected)
    assert_printed(tb.attn_scores_for_query(INPUTS, INPUTS[1]), expected)


def test_in5_to_in7_normalisations():
    scores = tb.attn_scores_for_query(INPUTS, INPUTS[1])
    assert_printed(tb.normalize_by_sum(scores), [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])
    softmaxed = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
    assert_printed(tb.softmax_naive(scores), softmaxed)
    assert_printed(tb.softmax_stable(scores), softmaxed)
    assert_printed(torch.softmax(scores, dim=0), softmaxed)


def test_in8_context_vector_2_loop():
    weights = torch.softmax(tb.attn_scores_for_query(INPUTS, INPUTS[1]), dim=0)
    assert_printed(tb.context_vec_loop(INPUTS, weights), [0.4419, 0.6515, 0.5683])


def test_in9_to_in10_all_scores_weights_and_context_vectors():
    assert_printed(tb.attn_scores_loop(INPUTS), ATTN_SCORES)
    assert_printed(tb.attn_scores_matrix(INPUTS), ATTN_SCORES)
    attn_weights = torch.softmax(tb.attn_scores_matrix(INPUTS), dim=-1)
    assert_printed(
        attn_weights,
        [
            [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
            [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
            [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
            [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
            [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
            [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
        ],
    )
    assert_printed(
        tb.context_vecs_matrix(attn_weights, INPUTS),
        [
            [0.4421, 0.5931, 0.5790],
            [0.4419, 0.6515, 0.5683],
            [0.4431, 0.6496, 0.5671],
            [0.4304, 0.6298, 0.5510],
            [0.4671, 0.5910, 0.5266],
            [0.4177, 0.6503, 0.5645],
        ],
    )


def test_in11_to_in12_query_key_value_of_token_2():
    """The seed-123 randn matrices are SelfAttention_v1's parameters, in creation order."""
    torch.manual_seed(123)
    sa_v1 = tb.SelfAttention_v1(3, 2)
    x_2 = INPUTS[1]
    assert_printed(x_2 @ sa_v1.W_query, [-1.1729, -0.0048])
    assert_printed(x_2 @ sa_v1.W_key, [-0.1142, -0.7676])
    assert_printed(x_2 @ sa_v1.W_value, [0.4107, 0.6274])


def test_in15_self_attention_v1():
    torch.manual_seed(123)
    sa_v1 = tb.SelfAttention_v1(3, 2)
    assert_printed(
        sa_v1(INPUTS),
        [
            [0.2845, 0.4071],
            [0.2854, 0.4081],
            [0.2854, 0.4075],
            [0.2864, 0.3974],
            [0.2863, 0.3910],
            [0.2860, 0.4039],
        ],
    )


def _sa_v2_789() -> tb.SelfAttention_v2:
    torch.manual_seed(789)
    return tb.SelfAttention_v2(3, 2)


def test_in19_self_attention_v2():
    assert_printed(
        _sa_v2_789()(INPUTS),
        [
            [-0.0739, 0.0713],
            [-0.0748, 0.0703],
            [-0.0749, 0.0702],
            [-0.0760, 0.0685],
            [-0.0763, 0.0679],
            [-0.0754, 0.0693],
        ],
    )


MASKED_NORM = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]


def test_in20_to_in34_causal_mask_both_ways():
    sa_v2 = _sa_v2_789()
    queries, keys = sa_v2.W_query(INPUTS), sa_v2.W_key(INPUTS)
    attn_scores = queries @ keys.T
    attn_weights = torch.softmax(attn_scores / keys.shape[-1] ** 0.5, dim=-1)
    assert_printed(
        attn_weights,
        [
            [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
            [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
            [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
            [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
            [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
            [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
        ],
    )
    assert_printed(tb.causal_mask_simple(6), torch.ones(6, 6).tril())
    assert_printed(tb.mask_by_renormalizing(attn_weights), MASKED_NORM)
    inf = float("-inf")
    masked = tb.mask_with_neg_inf(attn_scores)
    assert_printed(
        masked,
        [
            [0.2899, inf, inf, inf, inf, inf],
            [0.4656, 0.1723, inf, inf, inf, inf],
            [0.4594, 0.1703, 0.1731, inf, inf, inf],
            [0.2642, 0.1024, 0.1036, 0.0186, inf, inf],
            [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, inf],
            [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078],
        ],
    )
    assert_printed(torch.softmax(masked / keys.shape[-1] ** 0.5, dim=1), MASKED_NORM)


def test_in35_to_in36_dropout_on_ones_then_on_the_weights():
    """One seed, two draws: the second dropout mask continues the generator."""
    sa_v2 = _sa_v2_789()
    keys = sa_v2.W_key(INPUTS)
    masked = tb.mask_with_neg_inf(sa_v2.W_query(INPUTS) @ keys.T)
    attn_weights = torch.softmax(masked / keys.shape[-1] ** 0.5, dim=-1)
    torch.manual_seed(123)
    dropout = torch.nn.Dropout(0.5)
    assert_printed(
        dropout(torch.ones(6, 6)),
        [
            [2.0, 2.0, 0.0, 2.0, 2.0, 0.0],
            [0.0, 0.0, 0.0, 2.0, 0.0, 2.0],
            [2.0, 2.0, 2.0, 2.0, 0.0, 2.0],
            [0.0, 2.0, 2.0, 0.0, 0.0, 2.0],
            [0.0, 2.0, 0.0, 2.0, 0.0, 2.0],
            [0.0, 2.0, 2.0, 2.0, 2.0, 0.0],
        ],
    )
    assert_printed(
        dropout(attn_weights),
        [
            [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.6194, 0.6206, 0.0000, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.4925, 0.4638, 0.0000, 0.0000],
            [0.0000, 0.0000, 0.0000, 0.0000, 0.3941, 0.0000],
            [0.3869, 0.3327, 0.0000, 0.3084, 0.3331, 0.3058],
        ],
    )


def test_in41_causal_attention_shape_and_values():
    """The notebook prints only the shape; the values are checked against a float64 causal attention."""
    torch.manual_seed(123)
    ca = tb.CausalAttention(3, 2, 6, dropout=0.0)
    context_vecs = ca(tb.book_batch())
    assert context_vecs.shape == (2, 6, 2)
    x = tb.book_inputs(torch.float64)
    q, k, v = (x @ getattr(ca, name).weight.double().T for name in ("W_query", "W_key", "W_value"))  # (6, 2)
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    expected = torch.softmax((q @ k.T / 2**0.5).masked_fill(future, -torch.inf), dim=-1) @ v  # (6, 2)
    torch.testing.assert_close(context_vecs, expected.float().expand(2, 6, 2))


def test_in43_four_causal_heads_concatenated():
    torch.manual_seed(123)
    mha = tb.MultiHeadAttentionWrapper(3, 2, 6, dropout=0.0, num_heads=4)
    context_vecs = mha(tb.book_batch())
    row = [
        [-0.4519, 0.2216, 0.4772, 0.1063, 0.4566, 0.2729, -0.5684, 0.5063],
        [-0.5874, 0.0058, 0.5891, 0.3257, 0.5792, 0.3011, -0.5388, 0.6447],
        [-0.6300, -0.0632, 0.6202, 0.3860, 0.6249, 0.3102, -0.5242, 0.6954],
        [-0.5675, -0.0843, 0.5478, 0.3589, 0.5691, 0.2785, -0.4578, 0.6471],
        [-0.5526, -0.0981, 0.5321, 0.3428, 0.5543, 0.2520, -0.4006, 0.5921],
        [-0.5299, -0.1081, 0.5077, 0.3493, 0.5337, 0.2499, -0.3997, 0.5971],
    ]
    assert_printed(context_vecs, [row, row])


def test_closing_cells_split_heads_of_printed_queries():
    """The last cells view queries (2, 4, 8) as (2, 4, 2, 4), then transpose to heads first."""
    queries_reshaped = torch.tensor(
        [
            [
                [[-0.5967, -0.6374, 0.7212, 0.3788], [0.3062, -0.5439, 0.2889, -0.0084]],
                [[-0.1268, -0.5771, 0.5702, 0.9841], [0.8485, -0.9617, 0.4092, 0.2804]],
                [[-0.2514, -0.4483, -0.1014, 0.1431], [0.8711, -0.7185, 0.1488, 0.6895]],
                [[-1.2884, -0.8930, 0.9653, 0.0435], [0.5063, -0.1114, 0.7347, -0.4819]],
            ],
            [
                [[0.0749, -0.4188, 0.2072, 0.7225], [0.7075, -1.0068, 0.0929, 0.6227]],
                [[-1.4700, -0.7355, 0.3765, -0.9713], [0.1440, 0.2246, 0.2938, -0.1419]],
                [[-0.5487, -0.5882, 0.6563, 0.2844], [0.1690, -0.5411, 0.1599, 0.0616]],
                [[-1.4576, -1.0652, 1.4288, 0.4386], [0.6314, -0.1111, 1.0780, -0.8789]],
            ],
        ]
    )
    queries = queries_reshaped.reshape(2, 4, 8)
    mha = tb.MultiHeadAttention(3, 8, context_length=4, dropout=0.0, num_heads=2)
    split = mha.split_heads(queries)
    assert split.shape == (2, 2, 4, 4)
    # The printed "After transpose" rows (the rest of that print is cut off):
    assert_printed(
        split[0, 0, :3],
        [[-0.5967, -0.6374, 0.7212, 0.3788], [-0.1268, -0.5771, 0.5702, 0.9841],
         [-0.2514, -0.4483, -0.1014, 0.1431]],
    )
    assert_printed(split, queries_reshaped.transpose(1, 2))
