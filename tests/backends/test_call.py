"""One attention call, validated once (src/attnkit/backends/call.py): what every backend receives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit.backends import chunked, make_call, math_intermediates
from attnkit.backends.call import compute_dtype


def _qkv(b=2, h=4, g=2, t=5, s=5, d=8, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, g, s, d, dtype=dtype),
            torch.randn(b, g, s, d, dtype=dtype))


def test_a_learnable_scale_is_refused_rather_than_silently_detached():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="requires grad"):
        attnkit.attention(q, q, q, scale=torch.tensor(0.5, requires_grad=True))


@pytest.mark.parametrize("scale", [np.float32(0.5), torch.tensor(0.5), np.float64(0.5)])
def test_numpy_and_tensor_scales_are_accepted(scale):
    q, k, v = _qkv()
    torch.testing.assert_close(attnkit.attention(q, k, v, scale=scale), attnkit.attention(q, k, v, scale=0.5))


@pytest.mark.parametrize("bad", [True, "0.5", torch.tensor([0.5, 0.5])])
def test_a_bool_or_non_number_scale_is_refused(bad):
    """Before, scale=True was taken as 1.0."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        attnkit.attention(q, k, v, scale=bad)


def test_numpy_dropout_p_is_accepted():
    q, k, v = _qkv()
    out = attnkit.attention(q, k, v, dropout_p=np.float32(0.0))
    torch.testing.assert_close(out, attnkit.attention(q, k, v))


def test_zero_heads_and_zero_head_dim_are_refused():
    """Before: H = 0 was accepted and D = 0 raised ZeroDivisionError."""
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q has H=0 heads"):
        attnkit.attention(q[:, :0], k, v)
    with pytest.raises(ValueError, match="head dim D=0"):
        attnkit.attention(q[..., :0], k[..., :0], v)


def test_a_bad_key_mask_names_its_shape():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"key_mask must be a bool \(B, S\) = \(2, 5\) tensor"):
        attnkit.attention(q, k, v, key_mask=torch.ones(5, 5, dtype=torch.bool))


def test_a_decoding_call_with_a_key_mask_builds_no_band():
    """The causal band of one query over its keys hides nothing: no all-True (T, S) mask is built."""
    q, k, v = _qkv(t=1, s=9)
    key_mask = torch.ones(2, 9, dtype=torch.bool)
    call = make_call(q, k, v, key_mask=key_mask, causal=True)
    assert call.band() is None and call.dense_mask() is call.mask
    assert call.mask.shape == (2, 1, 1, 9)


def test_half_precision_is_computed_in_the_one_compute_dtype_by_math_and_chunked():
    """The upcast rule was written twice (math and chunked); both now read compute_dtype."""
    assert compute_dtype(torch.float16) == compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float64) == torch.float64
    q = torch.randn(1, 2, 3, 4, dtype=torch.bfloat16)
    assert chunked.block_plan(q, 3, causal=True, scale=0.5, offset=0).compute == torch.float32
    steps = math_intermediates(make_call(q, q, q, causal=True))
    assert steps.weights.dtype == torch.float32 and steps.out.dtype == torch.bfloat16
