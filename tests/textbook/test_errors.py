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


def test_loops_accept_the_batched_input_the_module_docstring_promises():
    """attn_scores_loop and context_vec_loop failed on (B, T, d) input."""
    batch = torch.randn(2, 5, 3, dtype=torch.float64)
    torch.testing.assert_close(tb.attn_scores_loop(batch), tb.attn_scores_matrix(batch))
    weights = torch.softmax(torch.randn(2, 5, dtype=torch.float64), dim=-1)
    expected = (weights[:, :, None] * batch).sum(1)  # (B, T, 1) * (B, T, d) -> (B, d)
    torch.testing.assert_close(tb.context_vec_loop(batch, weights), expected)
    torch.testing.assert_close(tb.attn_scores_for_query_loop(batch, batch[:, 1]), tb.attn_scores_for_query(
        batch, batch[:, 1, :, None])[..., 0])
    with pytest.raises(ValueError, match=r"attn_scores_loop: inputs must be \(T, d\) or \(B, T, d\), got \(3,\)"):
        tb.attn_scores_loop(torch.randn(3))


def test_softmax_stable_on_empty_and_integer_tensors():
    """An empty tensor gave IndexError, an integer one a finfo TypeError."""
    for shape in [(3, 0), (0, 3), (0,)]:
        assert tb.softmax_stable(torch.empty(shape)).shape == shape
    with pytest.raises(TypeError, match=r"softmax_stable needs a floating-point tensor, got torch.int64"):
        tb.softmax_stable(torch.ones(3, dtype=torch.long))


@pytest.mark.parametrize("layer", [
    tb.SelfAttention_v1(3, 2), tb.SelfAttention_v2(3, 2), tb.CausalAttention(3, 2, 6, 0.0),
    tb.MultiHeadAttention(3, 4, 6, 0.0, 2), tb.PerHeadAttention(3, 2, 2), tb.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2),
])
def test_float64_input_to_a_float32_layer_names_both_dtypes(layer):
    """torch's bare "mat1 and mat2 must have the same dtype" came instead."""
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but this layer's weights are torch.float32"):
        layer(tb.book_inputs(torch.float64))
    assert layer.double()(tb.book_inputs(torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("make", [
    lambda: tb.SelfAttention_v1(3, 2), lambda: tb.SelfAttention_v2(3, 2), lambda: tb.CausalAttention(3, 2, 6, 0.0),
    lambda: tb.MultiHeadAttention(3, 4, 6, 0.0, 2), lambda: tb.PerHeadAttention(3, 2, 2),
    lambda: tb.MultiHeadAttentionWrapper(3, 2, 6, 0.0, 2),
])
def test_finiteness_pass_runs_on_the_cpu_only(make, monkeypatch: pytest.MonkeyPatch):
    """The input check ran a full isfinite pass (a device sync off the CPU) on every forward."""
    layer = make()
    x = tb.book_inputs()
    x[0, 0] = float("nan")
    seen = []
    real_isfinite = torch.isfinite

    def spy(t):
        seen.append(t.device.type)
        return real_isfinite(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    with pytest.raises(ValueError, match=r"x contains 1 non-finite value\(s\) \(nan or inf\)"):
        layer(x)  # on the CPU: checked
    assert seen and set(seen) == {"cpu"}
    seen.clear()
    out = layer.to("meta")(torch.full((6, 3), float("nan"), device="meta"))
    assert out.device.type == "meta" and out.shape[0] == 6 and seen == []  # off the CPU: no pass over x
