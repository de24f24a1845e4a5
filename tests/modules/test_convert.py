"""Converters against the original module's own output, both ways."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit
from attnkit import CrossAttention, MultiHeadAttention


def torch_call(m, x, context=None, **kw):
    """Run torch's module on batch-first x, whatever its layout."""
    key = x if context is None else context
    if not m.batch_first:
        x, key = x.transpose(0, 1), key.transpose(0, 1)
    out = m(x, key, key, need_weights=False, **kw)[0]
    return out if m.batch_first else out.transpose(0, 1)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_self_attention_with_padding_and_masks(batch_first, bias):
    torch.manual_seed(0)
    m = nn.MultiheadAttention(12, 3, bias=bias, batch_first=batch_first).double().eval()
    layer = attnkit.from_torch(m)
    x = torch.randn(2, 5, 12, dtype=torch.float64, requires_grad=True)
    pad = torch.tensor([[False] * 5, [False, False, False, True, True]])  # torch: True = padding
    blocked = torch.rand(5, 5) > 0.7
    blocked.fill_diagonal_(False)
    expected = torch_call(m, x, key_padding_mask=pad, attn_mask=blocked)
    out = layer(x, key_mask=~pad, attn_mask=~blocked)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])
    additive = torch.randn(5, 5, dtype=torch.float64)
    torch.testing.assert_close(layer(x, attn_mask=additive), torch_call(m, x, attn_mask=additive))


def test_from_torch_causal():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 6, 8)
    causal_blocked = nn.Transformer.generate_square_subsequent_mask(6, dtype=torch.bool)
    expected = m(x, x, x, attn_mask=causal_blocked, is_causal=True, need_weights=False)[0]
    torch.testing.assert_close(attnkit.from_torch(m, causal=True)(x), expected)


def test_from_torch_cross_attention_with_kdim():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, kdim=5, vdim=5, batch_first=True).eval()
    layer = attnkit.from_torch(m)
    assert layer.d_context == 5
    x, context = torch.randn(2, 3, 8), torch.randn(2, 7, 5)
    torch.testing.assert_close(layer(x, context), torch_call(m, x, context))
    torch.testing.assert_close(layer.to_torch()(x, context, context, need_weights=False)[0], layer(x, context))


def test_round_trips():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 4, batch_first=True, dropout=0.1).eval()
    back = attnkit.from_torch(m).to_torch()
    assert back.dropout == 0.1 and back.training is False
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(torch_call(back, x), torch_call(m, x))
    layer = MultiHeadAttention(8, 8, 2, qkv_bias=True, out_bias=False, causal=False).eval()
    torch.testing.assert_close(torch_call(layer.to_torch(), x), layer(x))  # missing bias becomes zero
    torch.testing.assert_close(attnkit.from_torch(layer.to_torch())(x), layer(x))


def test_converter_errors():
    with pytest.raises(ValueError, match=r"add_bias_kv and add_zero_attn have no equivalent"):
        attnkit.from_torch(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"kdim=4 and vdim=5 differ"):
        attnkit.from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=5))
    with pytest.raises(TypeError, match=r"expects a torch.nn.MultiheadAttention, got Linear"):
        attnkit.from_torch(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no grouped-query heads \(num_kv_heads=1 != num_heads=2\)"):
        MultiHeadAttention(8, 8, 2, num_kv_heads=1).to_torch()
    with pytest.raises(ValueError, match=r"no rotary embedding or sliding window"):
        MultiHeadAttention(8, 8, 2, rope=True).to_torch()
    with pytest.raises(ValueError, match=r"needs d_in == d_out, got 6 and 8"):
        MultiHeadAttention(6, 8, 2).to_torch()
    with pytest.raises(TypeError, match=r"from_textbook expects .* got Linear"):
        attnkit.from_textbook(nn.Linear(2, 2))


def test_to_torch_on_cross_attention_with_d_context_equal_to_d_out():
    torch.manual_seed(0)
    layer = CrossAttention(8, 8, 2, d_context=8, qkv_bias=True).eval()  # torch fuses in_proj_weight here
    m = layer.to_torch()  # before: AttributeError: 'NoneType' object has no attribute 'copy_'
    x, context = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    torch.testing.assert_close(m(x, context, context, need_weights=False)[0], layer(x, context))


def test_to_torch_batch_first_false_round_trips():
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=False).eval()
    back = attnkit.from_torch(m).to_torch(batch_first=False)
    assert back.batch_first is False
    x = torch.randn(5, 2, 8)  # (T, B, E)
    torch.testing.assert_close(back(x, x, x)[0], m(x, x, x)[0])


def test_to_torch_batch_first_must_be_a_bool():
    """None would silently have meant sequence-first."""
    with pytest.raises(TypeError, match="batch_first must be a bool, got None"):
        MultiHeadAttention(8, 8, 2).to_torch(batch_first=None)  # type: ignore[arg-type]


def test_to_torch_function_refuses_what_is_not_an_attnkit_layer():
    """Bug: any module was taken and failed deep inside with an AttributeError on its projections."""
    from attnkit.modules import to_torch

    with pytest.raises(TypeError, match=r"to_torch expects an attnkit MultiHeadAttention or CrossAttention, "
                                        r"got Linear"):
        to_torch(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_to_torch_function_and_method_give_the_same_module():
    """Bug: the function and the layer's method drift apart (two copies of the conversion)."""
    from attnkit.modules import to_torch

    torch.manual_seed(0)
    for layer in (MultiHeadAttention(8, 8, 2, qkv_bias=True), CrossAttention(8, 8, 2, d_context=6)):
        by_function, by_method = to_torch(layer, batch_first=False), layer.to_torch(batch_first=False)
        assert by_function.batch_first is by_method.batch_first is False
        torch.testing.assert_close(by_function.state_dict(), by_method.state_dict())
