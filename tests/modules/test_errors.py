"""Bad configuration or input to MultiHeadAttention: clear errors naming the value."""

from __future__ import annotations

import pytest
import torch

from attnkit import CrossAttention, MultiHeadAttention, RotaryEmbedding


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(d_out=10, num_heads=4), ValueError, r"d_out=10 is not divisible by num_heads=4"),
    (dict(num_kv_heads=3), ValueError, r"num_heads=4 is not a multiple of num_kv_heads=3"),
    (dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive int, got num_kv_heads=0"),
    (dict(d_in=0), ValueError, r"d_in must be a positive int, got d_in=0"),
    (dict(dropout=1.0), ValueError, r"dropout=1.0 is outside \[0, 1\)"),
    (dict(window=4, causal=False), ValueError, r"window=4 needs causal=True"),
    (dict(window=-1), ValueError, r"window must be a positive int, got window=-1"),
    (dict(backend="fast"), ValueError, r"unknown attention backend 'fast'; choose from: auto, "),
    (dict(rope=RotaryEmbedding(8)), ValueError, r"rope has head_dim=8 but this layer's head_dim is 4"),
    (dict(d_out=12, num_heads=4, rope=True), ValueError, r"rope=True needs an even head_dim, got head_dim=3"),
    (dict(rope="yes"), TypeError, r"rope must be a bool or a RotaryEmbedding, got str"),
    (dict(causal=1), TypeError, r"causal must be a bool, got 1"),
])
def test_bad_configuration(kwargs, error, message):
    args = dict(d_in=16, d_out=16, num_heads=4) | kwargs
    with pytest.raises(error, match=message):
        MultiHeadAttention(**args)


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m: m(torch.randn(5, 16)), ValueError, r"x must be a \(B, T, d_in=16\) tensor with T >= 1, got \(5, 16\)"),
    (lambda m: m(torch.randn(2, 5, 8)), ValueError, r"x must be a \(B, T, d_in=16\) tensor"),
    (lambda m: m(torch.randn(2, 0, 16)), ValueError, r"T >= 1, got \(2, 0, 16\)"),
    (lambda m: m(torch.randn(2, 5, 16, dtype=torch.float64)), ValueError,
     r"x is torch.float64 on cpu but the layer computes in torch.float32 on cpu"),
    (lambda m: m(torch.randn(2, 5, 16), key_mask=torch.ones(2, 5)), ValueError,
     r"key_mask must be a bool \(B, S\) = \(2, 5\) tensor, True = real token"),
    (lambda m: m(torch.randn(2, 5, 16), key_mask=torch.ones(2, 4, dtype=torch.bool)), ValueError,
     r"key_mask must be a bool \(B, S\) = \(2, 5\)"),
    (lambda m: m(torch.randn(2, 5, 16), attn_mask=torch.ones(5, 6, dtype=torch.bool)), ValueError,
     r"mask of shape \(5, 6\) does not broadcast to \(B, H, T, S\) = \(2, 4, 5, 5\)"),
    (lambda m: m(torch.randn(2, 5, 16), torch.randn(2, 3, 16)), TypeError, r"positional argument"),
    (lambda m: m(torch.randn(2, 5, 16), need_weights=1), TypeError, r"need_weights must be a bool"),
])
def test_bad_forward_input(call, error, message):
    with pytest.raises(error, match=message):
        call(MultiHeadAttention(16, 16, 4))


def test_bad_context():
    cross = CrossAttention(16, 16, 4, d_context=8)
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'context'"):
        cross(torch.randn(2, 5, 16))
    with pytest.raises(ValueError, match=r"context must be a \(B, S, d_context=8\) tensor .* got \(2, 3, 16\)"):
        cross(torch.randn(2, 5, 16), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match=r"context has batch size 3 but x has 2"):
        cross(torch.randn(2, 5, 16), torch.randn(3, 3, 8))
    with pytest.raises(ValueError, match=r"context is torch.float64 on cpu but the layer computes in torch.float32"):
        cross(torch.randn(2, 5, 16), torch.randn(2, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"d_context must be a positive int, got d_context=0"):
        CrossAttention(16, 16, 4, d_context=0)
