"""KVCache: prefill then decode equals the full forward, with RoPE, GQA, windows and padding."""

from __future__ import annotations

import copy

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
    with pytest.raises(TypeError, match=r"kv_cache must implement the cache protocol .*dict lacks next_positions"):
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


@pytest.mark.parametrize(("dtype", "error"), [(torch.int8, ValueError), (torch.bool, ValueError),
                                              ("float32", TypeError), (None, None), (torch.float64, None)])
@pytest.mark.parametrize("stored", [None, torch.int8])
def test_keys_and_values_takes_only_a_floating_dtype(stored, dtype, error):
    """Bug: keys_and_values(torch.int8) silently truncated the keys to integers, and keys_and_values("float32")
    raised torch's "Invalid device string"."""
    cache = KVCache(dtype=stored)
    k = torch.randn(1, 2, 3, 4)
    cache.update(k, k, None)
    if error is None:
        held = cache.keys_and_values(dtype)
        assert held.k.dtype == (dtype or torch.float32)
        torch.testing.assert_close(held.k.float(), cache.keys, atol=0, rtol=0)
        return
    with pytest.raises(error, match=r"keys_and_values takes None \(as stored\) or a floating torch dtype \(e\.g\. "
                                    rf"torch\.float32, .*\), got dtype={dtype!r}"):
        cache.keys_and_values(dtype)


# --- explicit positions and the cache protocol ---------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from attnkit.modules.cache_protocol import CachedKeys  # noqa: E402
from attnkit.modules.static_cache import StaticKVCache  # noqa: E402


def _layer(window=None, kv_heads=2, causal=True):
    torch.manual_seed(0)
    return MultiHeadAttention(16, 16, 4, num_kv_heads=kv_heads, rope=True, window=window,
                              causal=causal).double().eval()


@pytest.mark.parametrize("make_cache", [lambda: KVCache(), lambda: KVCache(capacity=20), lambda: StaticKVCache(20)],
                         ids=["growing", "capacity", "static"])
@pytest.mark.parametrize("window", [None, 3])
def test_every_cache_equals_the_full_forward_float64(make_cache, window):
    layer = _layer(window)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    full = layer(x)
    for steps in ([5, 1, 1, 1, 1, 1, 1, 1], [4, 3, 5]):
        cache, outs, start = make_cache(), [], 0
        with torch.no_grad():
            for size in steps:
                outs.append(layer(x[:, start : start + size], kv_cache=cache))
                start += size
        torch.testing.assert_close(torch.cat(outs, 1), full, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("make_cache", [KVCache, lambda: StaticKVCache(32)], ids=["growing", "static"])
def test_rows_at_different_positions_each_get_what_they_get_alone(make_cache):
    """One rotary offset (len(cache)) was shared by every row: rows could only sit at the same positions."""
    layer = _layer(window=4)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    starts = torch.tensor([0, 9])
    positions = starts[:, None] + torch.arange(5)  # row 0 at 0..4, row 1 at 9..13
    prefix = torch.randn(1, 9, 16, dtype=torch.float64)  # what row 1's cache holds before
    with torch.no_grad():
        alone0 = layer(x[:1])
        alone1_cache = make_cache()
        layer(prefix, kv_cache=alone1_cache)
        alone1 = layer(x[1:], kv_cache=alone1_cache)
        # together: row 0's cache holds nothing, row 1's 9 positions (row 0's 9 slots are padding, -1)
        cache = make_cache()
        pad = torch.cat([torch.zeros(1, 9, 16, dtype=torch.float64), prefix])  # (2, 9, 16)
        held = torch.stack([torch.full((9,), -1), torch.arange(9)])
        layer(pad, positions=held, kv_cache=cache)
        together = layer(x, positions=positions, kv_cache=cache)
    torch.testing.assert_close(together[0], alone0[0], atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(together[1], alone1[0], atol=1e-9, rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(shift=st.integers(0, 50), length=st.integers(1, 6), window=st.sampled_from([None, 2]))
def test_a_shifted_row_without_cache_equals_the_unshifted_one(shift, length, window):
    """Rotary scores depend on relative positions only; the band follows the positions."""
    layer = _layer(window)
    x = torch.randn(1, length, 16, dtype=torch.float64)
    positions = shift + torch.arange(length)[None]
    torch.testing.assert_close(layer(x, positions=positions), layer(x), atol=1e-9, rtol=1e-9)


def test_omitted_positions_keep_todays_meaning():
    layer = _layer()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    explicit = layer(x, positions=torch.arange(7).expand(2, 7))
    torch.testing.assert_close(explicit, layer(x), atol=1e-12, rtol=1e-12)
    cache = KVCache()
    layer(x[:, :3], kv_cache=cache)
    torch.testing.assert_close(layer(x[:, 3:], kv_cache=cache), layer(x)[:, 3:], atol=1e-12, rtol=1e-12)
    assert cache.positions is None  # the fast path: slots are positions


class _Wrapped:
    """A cache of our own that implements the protocol by delegating: the layer needs nothing else."""

    def __init__(self):
        self.inner, self.calls = KVCache(), 0

    def next_positions(self, batch, length, device):
        return self.inner.next_positions(batch, length, device)

    def update(self, k, v, positions):
        self.calls += 1
        return self.inner.update(k, v, positions)

    def claim(self, owner):
        return self.inner.claim(owner)

    def restore(self, checkpoint):
        self.inner.restore(checkpoint)


def test_any_object_with_the_protocol_is_a_cache():
    layer = _layer()
    x = torch.randn(1, 6, 16, dtype=torch.float64)
    cache = _Wrapped()
    out = torch.cat([layer(x[:, :4], kv_cache=cache), layer(x[:, 4:], kv_cache=cache)], 1)
    torch.testing.assert_close(out, layer(x), atol=1e-12, rtol=1e-12)
    assert cache.calls == 2


@pytest.mark.parametrize(("positions", "message"), [
    (torch.arange(4.0)[None], r"torch.long \(B, T\) = \(1, 4\)"),
    (torch.arange(3)[None], r"\(B, T\) = \(1, 4\)"),
    (torch.tensor([[0, 1, -2, 3]]), r"must be >= 0 \(or -1 to mark padding\), got -2"),
    (torch.tensor([[0, 2, 1, 3]]), "must increase within a row \\(no decrease, no repeat\\): row 0 goes from 2 to 1"),
    (torch.tensor([[0, 2, -1, 1]]), "must increase within a row \\(no decrease, no repeat\\): row 0 goes from 2 to 1"),
    # a repeat: StaticKVCache stores by position and silently kept only the second key
    (torch.tensor([[0, 1, 1, 2]]), "must increase within a row \\(no decrease, no repeat\\): row 0 goes from 1 to 1"),
])
def test_bad_positions_are_named(positions, message):
    with pytest.raises(ValueError, match=message):
        _layer()(torch.randn(1, 4, 16, dtype=torch.float64), positions=positions)


@pytest.mark.parametrize("make_cache", [KVCache, lambda: StaticKVCache(16)], ids=["growing", "static"])
def test_positions_a_cache_already_holds_are_refused(make_cache):
    layer, cache = _layer(), make_cache()
    with torch.no_grad():
        layer(torch.randn(1, 4, 16, dtype=torch.float64), kv_cache=cache)
        with pytest.raises(ValueError, match=r"positions repeat what the cache holds.* up to 3 .* starts at 2"):
            layer(torch.randn(1, 1, 16, dtype=torch.float64), kv_cache=cache, positions=torch.tensor([[2]]))
        out = layer(torch.randn(1, 1, 16, dtype=torch.float64), kv_cache=cache, positions=torch.tensor([[4]]))
    assert out.shape == (1, 1, 16)


def test_static_cache_refuses_positions_past_capacity_and_gradients():
    layer, cache = _layer(), StaticKVCache(4)
    with torch.no_grad(), pytest.raises(ValueError, match="StaticKVCache capacity 4 exceeded: position 5"):
        layer(torch.randn(1, 6, 16, dtype=torch.float64), kv_cache=cache)
    assert cache.positions is None  # the failed call allocated nothing that stays
    with pytest.raises(ValueError, match="StaticKVCache is for inference"):
        layer(torch.randn(1, 2, 16, dtype=torch.float64), kv_cache=cache)


def test_a_compiled_step_past_a_static_cache_capacity_raises(fresh_dynamo):
    """Under torch.compile the Python check is skipped: the fifth position of a 4-slot cache went silently into
    the padding slot (visible from then on) and the sixth failed inside Inductor's generated code."""
    layer, cache = _layer(), StaticKVCache(4)
    step, x = torch.compile(layer, fullgraph=True), torch.randn(1, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        for i in range(4):
            torch.testing.assert_close(step(x[:, i:i + 1], kv_cache=cache), layer(x[:, :i + 1])[:, i:])
        with pytest.raises(RuntimeError, match=r"StaticKVCache capacity exceeded.*allocate a larger cache"):
            step(x[:, 4:], kv_cache=cache)


def test_a_failing_call_leaves_a_static_cache_as_it_was():
    layer, cache = _layer(), StaticKVCache(8)
    with torch.no_grad():
        layer(torch.randn(1, 3, 16, dtype=torch.float64), kv_cache=cache)
        before = cache.positions.clone()
        with pytest.raises(ValueError):
            layer(torch.randn(1, 2, 16, dtype=torch.float64), kv_cache=cache, key_mask=torch.ones(1, 2))
    assert torch.equal(cache.positions, before)


def test_padding_positions_are_never_seen_and_attend_to_nothing():
    layer = _layer()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    padded = torch.cat([x[:, :2], torch.randn(1, 2, 16, dtype=torch.float64), x[:, 2:]], 1)  # 2 pads inside
    out = layer(padded, positions=torch.tensor([[0, 1, -1, -1, 2, 3, 4]]))
    torch.testing.assert_close(out[:, [0, 1, 4, 5, 6]], layer(x), atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(out[:, 2:4], layer.out_proj(torch.zeros(1, 2, 16, dtype=torch.float64)))


def test_cached_keys_is_what_update_returns():
    cache = KVCache()
    keys = cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), None)
    assert isinstance(keys, CachedKeys) and keys.positions is None and keys.k.shape == (1, 2, 3, 4)
    keys = cache.update(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.tensor([[7]]))
    assert keys.positions.tolist() == [[0, 1, 2, 7]]


def _decoder_layer(**kw) -> MultiHeadAttention:
    torch.manual_seed(0)
    return MultiHeadAttention(8, 8, 2, num_kv_heads=1, rope=True, **kw).double()


@pytest.mark.parametrize(("backend", "training", "second_call"), [
    ("sdpa", False, dict(need_weights=True)),  # sdpa cannot return weights: raises after the append
    ("chunked", True, dict()),  # chunked has no dropout: raises after the append (layer built without dropout)
    ("auto", False, dict(key_mask=torch.ones(1, 3, dtype=torch.bool))),  # wrong key mask shape
])
def test_a_call_that_raises_leaves_the_kv_cache_as_it_was(backend, training, second_call):
    layer = _decoder_layer(backend=backend)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    full = layer.eval()(x)
    cache = KVCache()
    layer(x[:, :5], kv_cache=cache)
    if training:  # dropout is set after construction, as a user might, so the call itself must fail
        layer.train()
        layer.dropout = 0.5
    with pytest.raises(ValueError):
        layer(x[:, 5:], kv_cache=cache, **second_call)
    assert len(cache) == 5
    layer.eval()
    layer.dropout = 0.0
    retried = layer(x[:, 5:], kv_cache=cache)
    torch.testing.assert_close(retried, full[:, 5:])  # before the fix: off by 0.069


def test_a_failed_first_call_leaves_an_empty_cache_usable_for_another_batch_size():
    layer = _decoder_layer(backend="sdpa")
    cache = KVCache()
    with pytest.raises(ValueError, match="cannot return attention weights"):
        layer(torch.randn(3, 2, 8, dtype=torch.float64), kv_cache=cache, need_weights=True)
    assert len(cache) == 0 and cache.keys is None
    layer(torch.randn(2, 2, 8, dtype=torch.float64), kv_cache=cache)  # another batch size is fine
    assert len(cache) == 2


def test_one_kv_cache_passed_to_two_layers_is_refused():
    first, second = _decoder_layer(), _decoder_layer()
    cache = KVCache()
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    first(x, kv_cache=cache)
    with pytest.raises(ValueError, match=r"already holds the keys of another layer; .* one KVCache per layer"):
        second(x, kv_cache=cache)
    assert len(cache) == 4  # before the fix: 8, and the second layer attended to the first's keys
    first(x[:, :1], kv_cache=cache)  # its own layer may go on
    cache.reset()
    second(x, kv_cache=cache)  # after reset() the cache is free for another layer
    assert len(cache) == 4


def test_a_cache_filled_under_inference_mode_works_outside_it():
    layer = _decoder_layer().eval()
    x = torch.randn(1, 5, 8, dtype=torch.float64)
    cache = KVCache()
    with torch.inference_mode():
        layer(x[:, :4], kv_cache=cache)
    out = layer(x[:, 4:], kv_cache=cache)  # before: "Inplace update to inference tensor outside InferenceMode"
    torch.testing.assert_close(out, layer(x)[:, 4:])


def test_deepcopy_of_a_layer_with_its_cache_is_independent():
    layer = _decoder_layer().eval()
    cache = KVCache()
    x = torch.randn(1, 3, 8, dtype=torch.float64)
    layer(x, kv_cache=cache)
    twin, twin_cache = copy.deepcopy((layer, cache))
    twin(x[:, :1], kv_cache=twin_cache)
    assert len(twin_cache) == 4 and len(cache) == 3


def test_a_shallow_copy_of_a_cache_does_not_share_storage():
    """Review finding: copy.copy shared the preallocated storage, so each copy overwrote the other."""
    layer = _decoder_layer().eval()
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    full = layer(x)
    cache = KVCache()
    layer(x[:, :3], kv_cache=cache)
    twin = copy.copy(cache)
    layer(x[:, 3:4], kv_cache=cache)
    layer(torch.randn(2, 1, 8, dtype=torch.float64), kv_cache=twin)
    torch.testing.assert_close(layer(x[:, 4:5], kv_cache=cache), full[:, 4:5])


@pytest.mark.parametrize("explicit", [False, True])
def test_a_sliding_window_decodes_over_a_long_cache_as_the_full_forward(explicit: bool) -> None:
    """Keys older than the window are left out of a decoding step, not masked: the outputs stay exact.

    Rows of a left-padded batch sit at different positions; every step equals the full forward's row.
    """
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True, window=3).double()
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    key_mask = torch.ones(2, 14, dtype=torch.bool)
    key_mask[1, :4] = False  # row 1: four padding tokens first
    positions = (key_mask.long().cumsum(1) - 1).masked_fill(~key_mask, -1)  # (B, T): -1 = padding
    full = layer(x, key_mask=key_mask, positions=positions if explicit else None)
    cache = KVCache()
    layer(x[:, :5], key_mask=key_mask[:, :5], positions=positions[:, :5] if explicit else None, kv_cache=cache)
    for t in range(5, 14):
        step = layer(x[:, t:t + 1], key_mask=key_mask[:, :t + 1], kv_cache=cache,
                     positions=positions[:, t:t + 1] if explicit else None)  # (B, 1, C)
        torch.testing.assert_close(step, full[:, t:t + 1])
