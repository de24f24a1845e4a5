"""Bad input to attnkit.attention: a clear error naming the value and what was expected."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention


def qkv(b=2, h=4, g=2, t=3, s=5, d=8, dtype=torch.float32):
    shapes = ((b, h, t, d), (b, g, s, d), (b, g, s, d))
    return tuple(torch.randn(shape, dtype=dtype) for shape in shapes)


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda q, k, v: (q[0], k, v), ValueError, r"q must be 4-d, got shape \(4, 3, 8\)"),
    (lambda q, k, v: (q, k.long(), v), TypeError, r"k must be floating point, got dtype torch.int64"),
    (lambda q, k, v: (q, k, v.double()), TypeError, r"q, k, v must share a dtype"),
    (lambda q, k, v: (q, k.to("meta"), v), ValueError, r"q, k, v must be on one device"),
    (lambda q, k, v: (q[:1], k, v), ValueError, r"batch sizes differ: q has B=1, k has 2"),
    (lambda q, k, v: (q[..., :4], k, v), ValueError, r"q has head dim D=4 but k has 8"),
    (lambda q, k, v: (q[:, :3], k, v), ValueError, r"q has H=3 heads, k and v have G=2: H must be a multiple of G"),
    (lambda q, k, v: (q, k, v[:, :, :4]), ValueError, r"must agree on G and S"),
    (lambda q, k, v: (q[:, :, :0], k, v), ValueError, r"at least one query and one key, got T=0"),
    (lambda q, k, v: ([1.0], k, v), TypeError, r"q must be a torch.Tensor, got list"),
])
def test_bad_tensors(change, error, message):
    with pytest.raises(error, match=message):
        attention(*change(*qkv()))


@pytest.mark.parametrize(("mask", "error", "message"), [
    (torch.ones(2, 4, 3, 6, dtype=torch.bool), ValueError,
     r"mask of shape \(2, 4, 3, 6\) does not broadcast to \(B, H, T, S\) = \(2, 4, 3, 5\)"),
    (torch.ones(1, 2, 1, 4, 3, 5, dtype=torch.bool), ValueError, r"does not broadcast"),
    (torch.ones(3, 5, dtype=torch.int64), TypeError, r"mask must be bool \(True = may attend\) or float"),
    (torch.ones(3, 5, dtype=torch.bool, device="meta"), ValueError, r"mask is on meta but q is on cpu"),
    ([[True]], TypeError, r"mask must be a torch.Tensor or None, got list"),
])
def test_bad_masks(mask, error, message):
    with pytest.raises(error, match=message):
        attention(*qkv(), mask=mask)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(window=2), ValueError, r"window=2 needs causal=True"),
    (dict(causal=True, window=0), ValueError, r"window must be a positive int.* got window=0"),
    (dict(causal=1), TypeError, r"causal must be a bool, got 1"),
    (dict(scale=-1.0), ValueError, r"scale must be a positive finite number or None, got scale=-1.0"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p=1.0 is outside \[0, 1\)"),
    (dict(backend="flash"), ValueError, r"unknown attention backend 'flash'; choose from: auto, "),
    (dict(backend="sdpa", return_weights=True), ValueError,
     r"backend 'sdpa' cannot return attention weights .* use backend='math' or 'auto'"),
    (dict(backend="chunked", return_weights=True), ValueError, r"backend 'chunked' cannot return"),
    (dict(return_weights=1), TypeError, r"return_weights must be a bool"),
])
def test_bad_options(kwargs, error, message):
    with pytest.raises(error, match=message):
        attention(*qkv(), **kwargs)


def test_chunked_refuses_a_differentiable_float_mask():
    additive = torch.zeros(1, 1, 3, 5, requires_grad=True)
    with pytest.raises(ValueError, match=r"does not differentiate through a float mask"):
        attention(*qkv(), mask=additive, backend="chunked")
