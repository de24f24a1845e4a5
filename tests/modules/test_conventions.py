"""PyTorch's module conventions: factory arguments, meta device, reset_parameters, torch.compile."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import CrossAttention, KVCache, MultiHeadAttention


def test_device_and_dtype_factory_arguments():
    layer = MultiHeadAttention(8, 8, 2, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in layer.parameters())
    cross = CrossAttention(8, 8, 2, d_context=4, dtype=torch.float16)
    assert all(p.dtype == torch.float16 for p in cross.parameters())
    with pytest.raises(RuntimeError):  # torch's own error, unchanged
        MultiHeadAttention(8, 8, 2, device="no-such-device")


def test_build_on_meta_then_materialise_with_reset_parameters():
    layer = MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True, device="meta")
    assert all(p.is_meta for p in layer.parameters())
    layer.to_empty(device="cpu")
    torch.manual_seed(3)
    layer.reset_parameters()
    torch.manual_seed(3)
    fresh = MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True)  # the constructor's initialisation
    for (name, p), q in zip(layer.named_parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    x = torch.randn(1, 3, 16)
    torch.testing.assert_close(layer(x), fresh(x))


def test_torch_compile_fullgraph_forward_training_step_and_cached_decoding():
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 16, 4, num_kv_heads=2, rope=True)
    x = torch.randn(2, 5, 16)
    key_mask = torch.ones(2, 5, dtype=torch.bool)
    key_mask[1, :2] = False
    compiled = torch.compile(layer, fullgraph=True)  # fullgraph: a graph break is an error
    torch.testing.assert_close(compiled(x, key_mask=key_mask), layer(x, key_mask=key_mask))

    def loss(x: torch.Tensor) -> torch.Tensor:
        return layer(x, key_mask=key_mask).square().mean()

    torch.compile(loss, fullgraph=True)(x).backward()
    compiled_grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    loss(x).backward()
    for got, expected in zip(compiled_grads, (p.grad for p in layer.parameters()), strict=True):
        torch.testing.assert_close(got, expected)

    layer.eval()
    cache = KVCache(capacity=8)
    with torch.no_grad():
        full = layer(x)
        layer(x[:, :3], kv_cache=cache)
        for i in range(3, 5):
            torch.testing.assert_close(compiled(x[:, i:i + 1], kv_cache=cache), full[:, i:i + 1])
    assert len(cache) == 5


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo notes the tracer's graph breaks
def test_compiled_attention_still_traces():
    layer = MultiHeadAttention(8, 8, 2).eval()
    compiled = torch.compile(layer)
    x = torch.randn(1, 3, 8)
    compiled(x)
    with attnkit.trace(layer) as t:
        out = compiled(x)
    torch.testing.assert_close(t.records[0].output, out)
