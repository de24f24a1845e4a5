"""Regression tests for attention() from the adversarial review and the one-path refactor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnkit
from attnkit.backends import BACKENDS, choose, make_call

BACKEND_NAMES = ["math", "sdpa", "chunked", "auto"]


def _qkv(b=2, h=4, g=2, t=5, s=5, d=8, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, g, s, d, dtype=dtype),
            torch.randn(b, g, s, d, dtype=dtype))


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


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_a_nan_query_gives_nan_in_its_row_in_every_backend(backend):
    """Before: math and chunked gave NaN, sdpa and auto gave 0 (PyTorch's CPU flash kernel)."""
    q, k, v = _qkv(dtype=torch.float32)
    q[0, 1, 2, 3] = torch.nan
    out = attnkit.attention(q, k, v, causal=True, backend=backend)
    assert out[0, 1, 2].isnan().all()
    clean = torch.ones_like(out, dtype=torch.bool)
    clean[0, 1, 2] = False
    assert not out[clean].isnan().any()


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_key_mask_is_the_same_as_its_4d_mask(backend):
    q, k, v = _qkv(t=3, s=6)
    key_mask = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    expected = attnkit.attention(q, k, v, mask=key_mask[:, None, None, :], causal=True, backend="math")
    torch.testing.assert_close(attnkit.attention(q, k, v, key_mask=key_mask, causal=True, backend=backend), expected)
    extra = torch.rand(3, 6) > 0.3
    both = attnkit.attention(q, k, v, key_mask=key_mask, mask=extra, causal=True, backend=backend)
    torch.testing.assert_close(both, attnkit.attention(q, k, v, mask=key_mask[:, None, None, :] & extra,
                                                       causal=True, backend="math"))


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


def test_auto_picks_chunked_for_a_large_causal_call_with_a_padding_mask():
    """Before: auto built a dense (B, 1, T, S) mask for SDPA (129 MiB vs 75 at T=4096)."""
    t = 2304  # T * S above DENSE_BAND_LIMIT
    q = torch.zeros(1, 1, t, 8)
    key_mask = torch.ones(1, t, dtype=torch.bool)
    big = make_call(q, q, q, key_mask=key_mask, causal=True)
    assert choose("auto", big, return_weights=False) is BACKENDS["chunked"]
    assert choose("auto", make_call(q, q, q, causal=True), return_weights=False) is BACKENDS["sdpa"]  # is_causal
    small = make_call(q[:, :, :64], q[:, :, :64], q[:, :, :64], key_mask=key_mask[:, :64], causal=True)
    assert choose("auto", small, return_weights=False) is BACKENDS["sdpa"]


@pytest.mark.parametrize("backend", ["sdpa", "auto", "math", "chunked"])
def test_attention_runs_under_vmap(backend):
    """The NaN check of the sdpa adapter was a data-dependent branch that vmap refuses."""
    q = torch.randn(3, 1, 2, 4, 8)
    out = torch.func.vmap(lambda a: attnkit.attention(a, a, a, backend=backend))(q)
    torch.testing.assert_close(out, torch.stack([attnkit.attention(a, a, a, backend="math") for a in q]))
