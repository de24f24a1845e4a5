"""Regression tests for the adversarial review (issue "Nothing silently wrong"), one per finding.

Each test is named after the bug it pins; each failed on the code before its fix.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import attnkit
from attnkit import CrossAttention, KVCache, MultiHeadAttention, RotaryEmbedding


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


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(backend="chunked", dropout=0.1), r"backend 'chunked' cannot serve this layer: it has no dropout"),
    (dict(rope=True, causal=False, window=None, num_heads=0), r"num_heads must be a positive int"),
])
def test_configurations_that_fail_on_every_call_fail_at_construction(kwargs, message):
    args = dict(d_in=8, d_out=8, num_heads=2) | kwargs
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**args)


def test_cross_attention_has_no_rope_or_causal_arguments_to_get_wrong():
    """Before, MultiHeadAttention(d_context=4, causal=False, rope=True) built and failed on every call."""
    with pytest.raises(TypeError, match="rope"):
        CrossAttention(8, 8, 2, d_context=4, rope=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="causal"):
        CrossAttention(8, 8, 2, d_context=4, causal=True)  # type: ignore[call-arg]


def test_rope_base_of_the_wrong_type_is_a_clear_error():
    with pytest.raises(ValueError, match=r"RotaryEmbedding base must be > 1, got base='10'"):
        RotaryEmbedding(4, base="10")  # type: ignore[arg-type]


def test_a_bad_attn_mask_is_reported_as_attn_mask():
    layer = MultiHeadAttention(8, 8, 2)
    with pytest.raises(ValueError, match=r"^attn_mask of shape \(5, 6\) does not broadcast"):
        layer(torch.randn(1, 5, 8), attn_mask=torch.ones(5, 6, dtype=torch.bool))


def test_numpy_dropout_is_accepted():
    layer = MultiHeadAttention(8, 8, 2, dropout=np.float32(0.25))
    assert layer.dropout == pytest.approx(0.25)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_fails_at_once_naming_torch_compile():
    with pytest.raises(TypeError, match=r"does not support TorchScript .* use torch.compile"):
        torch.jit.script(MultiHeadAttention(8, 8, 2))


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


def test_a_learnable_scale_is_refused_rather_than_silently_detached():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(TypeError, match="requires grad"):
        attnkit.attention(q, q, q, scale=torch.tensor(0.5, requires_grad=True))


def test_changing_rope_base_changes_the_angles():
    """Review finding: the remembered angles ignored base, so a changed base kept the old rotation."""
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 3, 8)
    rope(q, q)
    rope.base = 500.0
    torch.testing.assert_close(rope(q, q)[0], RotaryEmbedding(8, base=500.0)(q, q)[0])


def test_integer_input_is_named_as_such():
    with pytest.raises(TypeError, match=r"x must be floating point, got dtype torch.int64"):
        MultiHeadAttention(8, 8, 2)(torch.ones(1, 3, 8, dtype=torch.long))


def test_to_torch_batch_first_must_be_a_bool():
    """None would silently have meant sequence-first."""
    with pytest.raises(TypeError, match="batch_first must be a bool, got None"):
        MultiHeadAttention(8, 8, 2).to_torch(batch_first=None)  # type: ignore[arg-type]
