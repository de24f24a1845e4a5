"""The chapter's steps are one function written several ways: each equals the one before.

Property-based over small shapes, in float64 so that differences are bugs,
not rounding.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import textbook as tb
from tests._util import assert_close64

sizes = st.integers(min_value=1, max_value=5)
seeds = st.integers(min_value=0, max_value=2**16)


@given(num_tokens=sizes, d=sizes, seed=seeds)
@settings(max_examples=25, deadline=None)
def test_loops_equal_matrix_forms(num_tokens, d, seed):
    torch.manual_seed(seed)
    inputs = torch.randn(num_tokens, d, dtype=torch.float64)
    assert_close64(tb.attn_scores_loop(inputs), tb.attn_scores_matrix(inputs))
    query = inputs[0]
    assert_close64(tb.attn_scores_for_query_loop(inputs, query), tb.attn_scores_for_query(inputs, query))
    weights = torch.softmax(tb.attn_scores_matrix(inputs), dim=-1)
    assert_close64(tb.context_vec_loop(inputs, weights[0]), tb.context_vecs_matrix(weights, inputs)[0])
    assert_close64(tb.simple_self_attention(inputs), weights @ inputs)


@given(num_tokens=sizes, seed=seeds)
@settings(max_examples=25, deadline=None)
def test_renormalising_equals_masking_with_neg_inf(num_tokens, seed):
    torch.manual_seed(seed)
    scores = torch.randn(2, num_tokens, num_tokens, dtype=torch.float64) * 3
    by_renorm = tb.mask_by_renormalizing(torch.softmax(scores, dim=-1))
    by_neg_inf = torch.softmax(tb.mask_with_neg_inf(scores), dim=-1)
    assert_close64(by_renorm, by_neg_inf)
    assert_close64(tb.softmax_stable(tb.mask_with_neg_inf(scores)), by_neg_inf)


@given(d_in=sizes, d_out=sizes, seed=seeds)
@settings(max_examples=20, deadline=None)
def test_transfer_v2_to_v1(d_in, d_out, seed):
    torch.manual_seed(seed)
    sa_v2 = tb.SelfAttention_v2(d_in, d_out).double()
    sa_v1 = tb.transfer_v2_to_v1(sa_v2, tb.SelfAttention_v1(d_in, d_out).double())
    x = torch.randn(3, 4, d_in, dtype=torch.float64)
    assert_close64(sa_v1(x), sa_v2(x))


@given(d_in=sizes, d_out=sizes, num_heads=st.integers(1, 4), num_tokens=sizes,
       qkv_bias=st.booleans(), seed=seeds)
@settings(max_examples=25, deadline=None)
def test_wrapper_and_weight_split_are_one_function(d_in, d_out, num_heads, num_tokens, qkv_bias, seed):
    torch.manual_seed(seed)
    wrapper = tb.MultiHeadAttentionWrapper(d_in, d_out, 5, 0.0, num_heads, qkv_bias).double()
    mha = tb.wrapper_to_multihead(wrapper)
    x = torch.randn(2, num_tokens, d_in, dtype=torch.float64, requires_grad=True)
    out_w, out_m = wrapper(x), mha(x)
    assert_close64(out_m, out_w)
    grad = torch.randn_like(out_w)
    (g_w,) = torch.autograd.grad(out_w, x, grad)
    (g_m,) = torch.autograd.grad(out_m, x, grad)
    assert_close64(g_m, g_w)


def test_single_head_wrapper_is_causal_attention():
    torch.manual_seed(0)
    wrapper = tb.MultiHeadAttentionWrapper(3, 4, 6, 0.0, num_heads=1)
    x = torch.randn(2, 6, 3)
    torch.testing.assert_close(wrapper(x), wrapper.heads[0](x))


@given(num_heads=st.integers(1, 3), head_size=sizes, num_tokens=sizes, seed=seeds)
@settings(max_examples=20, deadline=None)
def test_per_head_form_is_weight_split_attention(num_heads, head_size, num_tokens, seed):
    """Notebook 001's hand-written heads, stacked, are MultiHeadAttention's weight split."""
    torch.manual_seed(seed)
    d_in, d_out = 4, num_heads * head_size
    heads = tb.PerHeadAttention(d_in, head_size, num_heads, d_out=d_out).double()
    mha = tb.MultiHeadAttention(d_in, d_out, 8, 0.0, num_heads).double()
    with torch.no_grad():
        mha.W_query.weight.copy_(torch.cat(list(heads.q_proj)))
        mha.W_key.weight.copy_(torch.cat(list(heads.k_proj)))
        mha.W_value.weight.copy_(torch.cat(list(heads.v_proj)))
        mha.out_proj.weight.copy_(heads.multi_head_proj)
        mha.out_proj.bias.zero_()
    x = torch.randn(2, num_tokens, d_in, dtype=torch.float64) * 0.3
    assert_close64(heads(x), mha(x))


def test_two_d_input_equals_batch_of_one():
    torch.manual_seed(0)
    x = tb.book_inputs()
    for layer in (tb.CausalAttention(3, 2, 6, 0.0), tb.MultiHeadAttention(3, 4, 6, 0.0, 2),
                  tb.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2), tb.PerHeadAttention(3, 2, 2)):
        torch.testing.assert_close(layer(x), layer(x.unsqueeze(0))[0])
