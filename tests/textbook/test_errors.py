"""Bad input to the textbook classes gets an error naming the value and what was expected."""

from __future__ import annotations

import pytest
import torch

from attnkit import textbook as tb


@pytest.mark.parametrize("dropout", [1.0, -0.1, 1.5])
def test_dropout_outside_unit_interval(dropout):
    with pytest.raises(ValueError, match=rf"dropout={dropout} is outside \[0, 1\)"):
        tb.CausalAttention(3, 2, 6, dropout)
    with pytest.raises(ValueError, match=r"is outside \[0, 1\)"):
        tb.MultiHeadAttention(3, 2, 6, dropout, num_heads=2)


def test_dropout_of_wrong_type():
    with pytest.raises(TypeError, match=r"dropout must be a float in \[0, 1\), got str '0.1'"):
        tb.CausalAttention(3, 2, 6, "0.1")  # type: ignore[arg-type]


def test_d_out_not_divisible():
    with pytest.raises(ValueError, match=r"d_out=10 is not divisible by num_heads=4"):
        tb.MultiHeadAttention(3, 10, 6, 0.0, num_heads=4)


@pytest.mark.parametrize(("name", "kwargs"), [
    ("d_in", dict(d_in=0)), ("d_out", dict(d_out=-2)), ("context_length", dict(context_length=0)),
    ("num_heads", dict(num_heads=0)),
])
def test_sizes_must_be_positive(name, kwargs):
    args = dict(d_in=3, d_out=2, context_length=6, dropout=0.0, num_heads=1) | kwargs
    with pytest.raises(ValueError, match=rf"{name} must be positive, got {name}="):
        tb.MultiHeadAttention(**args)


def test_sizes_must_be_ints():
    with pytest.raises(TypeError, match=r"d_out must be an int, got float 2.0"):
        tb.SelfAttention_v1(3, 2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(3,), (1, 2, 6, 3)])
def test_wrong_rank(shape):
    expected = r"x must have shape \(num_tokens, d_in=3\) or \(batch, num_tokens, d_in=3\)"
    with pytest.raises(ValueError, match=expected):
        tb.SelfAttention_v2(3, 2)(torch.randn(shape))


def test_wrong_last_dimension():
    with pytest.raises(ValueError, match=r"x has last dimension 4, expected d_in=3 \(x shape \(2, 6, 4\)\)"):
        tb.MultiHeadAttention(3, 2, 6, 0.0, 2)(torch.randn(2, 6, 4))


def test_non_finite_embeddings():
    x = tb.book_inputs()
    x[2, 1] = float("nan")
    x[4, 0] = float("inf")
    with pytest.raises(ValueError, match=r"x contains 2 non-finite value\(s\)"):
        tb.CausalAttention(3, 2, 6, 0.0)(x)


def test_no_tokens_and_integer_input():
    with pytest.raises(ValueError, match=r"num_tokens=0"):
        tb.SelfAttention_v1(3, 2)(torch.randn(0, 3))
    with pytest.raises(TypeError, match=r"floating-point tensor, got dtype torch.int64"):
        tb.SelfAttention_v1(3, 2)(torch.ones(6, 3, dtype=torch.long))
    with pytest.raises(TypeError, match=r"x must be a torch.Tensor, got list"):
        tb.SelfAttention_v1(3, 2)([[0.0, 1.0, 2.0]])


def test_transfer_refuses_bias_and_mismatched_shapes():
    with pytest.raises(ValueError, match=r"qkv_bias=True"):
        tb.transfer_v2_to_v1(tb.SelfAttention_v2(3, 2, qkv_bias=True), tb.SelfAttention_v1(3, 2))
    expected = r"SelfAttention_v2\(d_in=3, d_out=2\) vs SelfAttention_v1\(d_in=3, d_out=4\)"
    with pytest.raises(ValueError, match=expected):
        tb.transfer_v2_to_v1(tb.SelfAttention_v2(3, 2), tb.SelfAttention_v1(3, 4))
