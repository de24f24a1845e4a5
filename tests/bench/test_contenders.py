"""Every contender computes the same function with the same weights, so the comparison is fair."""

from __future__ import annotations

import pytest
import torch

from attnkit import MultiHeadAttention
from attnkit.bench.contenders import CONTENDERS, padding_mask
from tests._util import need

C, H, T = 32, 4, 7
NO_OUT_PROJ = {"textbook-wrapper", "lfs-wrapper"}  # the wrapper of the chapter has no output projection


def reference_layer(training: bool = False) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(C, C, H, qkv_bias=True).double().train(training)


def before_out_proj(layer: MultiHeadAttention, x: torch.Tensor) -> torch.Tensor:
    q, k, v = layer.project(x)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(x.shape)


PADDED = {"attnkit-padded"}  # causal + key padding: compared with the reference given the same mask


@pytest.mark.parametrize("name", [n for n, c in CONTENDERS.items() if c.kind == "layer" and n not in PADDED])
def test_layer_contenders_agree_with_the_reference(name):
    contender = CONTENDERS[name]
    if contender.requires:
        need(contender.requires)
    reference = reference_layer()
    run = contender.build(reference, T)
    x = torch.randn(2, T, C, dtype=torch.float64)
    expected = before_out_proj(reference, x) if name in NO_OUT_PROJ else reference(x)
    with torch.no_grad():
        torch.testing.assert_close(run(x), expected)


@pytest.mark.parametrize("name", [n for n, c in CONTENDERS.items() if c.kind == "core" and "-padded" not in n])
def test_core_contenders_agree(name):
    q, k, v = (torch.randn(1, H, T, C // H, dtype=torch.float64) for _ in range(3))
    run = CONTENDERS[name].build(reference_layer(), T)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(run(q, k, v), expected)


def test_training_contenders_have_gradients():
    reference = reference_layer(training=True)
    x = torch.randn(1, T, C, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name in ("attnkit", "attnkit-chunked", "raw-sdpa", "torch-mha-is-causal", "textbook-mha"):
        x.grad = None
        CONTENDERS[name].build(reference, T)(x).sum().backward()
        grads[name] = x.grad.clone()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads["attnkit"], msg=name)


def test_padding_mask_pads_each_row_by_its_own_share():
    mask = padding_mask(5, 16)
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [14, 12, 10, 8, 14]
    assert torch.equal(mask, torch.arange(16) < mask.sum(1, keepdim=True))  # real tokens first


def test_padded_contenders_attend_to_real_keys_only():
    """The causal + padding rows time the function they claim to."""
    reference = reference_layer()
    x = torch.randn(3, T, C, dtype=torch.float64)
    keys = padding_mask(3, T)  # (B, S)
    with torch.no_grad():
        torch.testing.assert_close(CONTENDERS["attnkit-padded"].build(reference, T)(x), reference(x, key_mask=keys))
    q, k, v = (torch.randn(3, H, T, C // H, dtype=torch.float64) for _ in range(3))
    visible = torch.ones(T, T, dtype=torch.bool).tril() & keys[:, None, None, :]  # (B, 1, T, S)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)
    for name in ("core-auto-padded", "core-sdpa-padded", "core-chunked-padded"):
        torch.testing.assert_close(CONTENDERS[name].build(reference, T)(q, k, v), expected, msg=name)
