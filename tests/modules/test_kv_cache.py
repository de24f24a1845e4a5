"""KVCache: prefill then decode equals the full forward, with RoPE, GQA, windows and padding."""

from __future__ import annotations

import pytest
import torch

from attnkit import KVCache, MultiHeadAttention

BACKENDS = ["math", "sdpa", "chunked"]


def decode_in_steps(layer, x, steps, **kw):
    cache, outs, start = KVCache(), [], 0
    for size in steps:
        outs.append(layer(x[:, start : start + size], kv_cache=cache, **kw))
        start += size
        assert len(cache) == start
    return torch.cat(outs, dim=1), cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("rope", "kv_heads", "window"), [(False, 4, None), (True, 2, None), (True, 1, 3),
                                                          (False, 2, 2)])
def test_prefill_then_decode_equals_full_forward(backend, rope, kv_heads, window):
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 16, 4, num_kv_heads=kv_heads, rope=rope, window=window,
                               backend=backend).double().eval()
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    full = layer(x)
    for steps in ([5, 1, 1, 1, 1, 1, 1, 1], [1] * 12, [4, 3, 5], [12]):
        decoded, _ = decode_in_steps(layer, x, steps)
        torch.testing.assert_close(decoded, full, atol=1e-12, rtol=1e-12)


def test_padded_prompt_with_key_mask_over_all_positions():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, rope=True).double().eval()
    x = torch.randn(2, 7, 8, dtype=torch.float64)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, :2] = False  # left padding of sequence 1
    full = layer(x, key_mask=key_mask)
    cache = KVCache()
    outs = [layer(x[:, :4], kv_cache=cache, key_mask=key_mask[:, :4])]
    for t in range(4, 7):
        outs.append(layer(x[:, t : t + 1], kv_cache=cache, key_mask=key_mask[:, : t + 1]))
    torch.testing.assert_close(torch.cat(outs, 1)[:, 2:], full[:, 2:])
    with pytest.raises(ValueError, match=r"key_mask must be a bool \(B, S\) = \(2, 8\) tensor.* counts cached"):
        layer(x[:, :1], kv_cache=cache, key_mask=key_mask[:, :1])
    assert len(cache) == 7  # the rejected call stored nothing


def test_capacity():
    layer = MultiHeadAttention(8, 8, 2).eval()
    cache = KVCache(capacity=6)
    layer(torch.randn(1, 4, 8), kv_cache=cache)
    layer(torch.randn(1, 2, 8), kv_cache=cache)  # exactly full
    with pytest.raises(ValueError, match=r"KVCache capacity 6 exceeded: it holds 6 positions and 1 more"):
        layer(torch.randn(1, 1, 8), kv_cache=cache)
    assert len(cache) == 6  # the failed call stored nothing
    with pytest.raises(ValueError, match=r"capacity must be a positive int or None, got capacity=0"):
        KVCache(capacity=0)


def test_decoding_writes_in_place_without_copying_what_is_held():
    layer = MultiHeadAttention(8, 8, 2).eval()
    cache = KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 10, 8), kv_cache=cache)
        storage = cache.keys.untyped_storage().data_ptr()
        for _ in range(20):
            layer(torch.randn(1, 1, 8), kv_cache=cache)
    assert cache.keys.untyped_storage().data_ptr() == storage and cache.keys.shape == (1, 2, 30, 4)


def test_mismatched_sequences_and_reset():
    layer = MultiHeadAttention(8, 8, 2).eval()
    cache = KVCache()
    layer(torch.randn(2, 3, 8), kv_cache=cache)
    with pytest.raises(ValueError, match=r"holds \(B, G, D, Dv\)=\(2, 2, 4, 4\) but got \(3, 2, 4, 4\); .*reset"):
        layer(torch.randn(3, 1, 8), kv_cache=cache)
    with pytest.raises(ValueError, match=r"holds torch.float32 on cpu, got torch.float64"):
        cache.append(torch.randn(2, 2, 1, 4, dtype=torch.float64), torch.randn(2, 2, 1, 4, dtype=torch.float64))
    cache.reset()
    assert len(cache) == 0 and cache.keys is None
    assert layer(torch.randn(3, 2, 8), kv_cache=cache).shape == (3, 2, 8)
    with pytest.raises(TypeError, match=r"kv_cache must be an attnkit.KVCache, got dict"):
        layer(torch.randn(3, 1, 8), kv_cache={})


def test_gradients_reach_the_current_calls_keys_and_values():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, rope=True).double()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    tail = x[:, 4:].clone().requires_grad_()
    (full_grad,) = torch.autograd.grad(layer(torch.cat([x[:, :4], tail], 1))[:, 4:].sum(), tail)
    cache = KVCache()
    with torch.no_grad():
        layer(x[:, :4], kv_cache=cache)
    (cached_grad,) = torch.autograd.grad(layer(tail, kv_cache=cache).sum(), tail)
    torch.testing.assert_close(cached_grad, full_grad)


def test_crop_rewinds_to_an_earlier_position():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, rope=True).double().eval()
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    cache = KVCache()
    layer(x[:, :4], kv_cache=cache)
    first = layer(x[:, 4:5], kv_cache=cache)
    layer(torch.randn(1, 1, 8, dtype=torch.float64), kv_cache=cache)  # a token to take back
    cache.crop(5)
    torch.testing.assert_close(layer(x[:, 5:6], kv_cache=cache), layer(x)[:, 5:6])
    cache.crop(4)
    torch.testing.assert_close(layer(x[:, 4:5], kv_cache=cache), first)
    with pytest.raises(ValueError, match=r"crop length must be an int in \[0, 5\], got 9"):
        cache.crop(9)
