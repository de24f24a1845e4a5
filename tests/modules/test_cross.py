"""CrossAttention: queries from one sequence, keys and values from another (src/attnkit/modules/cross.py)."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import CrossAttention, MultiHeadAttention
from tests._reference import reference_attention

BACKENDS = ["math", "sdpa", "chunked"]


def test_cross_attention_has_no_rope_or_causal_arguments_to_get_wrong():
    """Before, MultiHeadAttention(d_context=4, causal=False, rope=True) built and failed on every call."""
    with pytest.raises(TypeError, match="rope"):
        CrossAttention(8, 8, 2, d_context=4, rope=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="causal"):
        CrossAttention(8, 8, 2, d_context=4, causal=True)  # type: ignore[call-arg]


def test_cross_attention_layer():
    torch.manual_seed(0)
    layer = attnkit.CrossAttention(6, 8, 4, num_kv_heads=2, d_context=10).double()
    assert not hasattr(layer, "qkv_proj") and layer.kv_proj.weight.shape == (2 * 2 * 2, 10)
    x, context = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 7, 10, dtype=torch.float64)
    key_mask = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    q = (layer.q_proj(x)).view(2, 3, 4, 2).transpose(1, 2)
    k, v = layer.kv_proj(context).view(2, 7, 2, 2, 2).permute(2, 0, 3, 1, 4)  # (2, B, G, S, D)
    out, _ = reference_attention(q, k, v, mask=key_mask[:, None, None, :])
    expected = layer.out_proj(out.transpose(1, 2).reshape(2, 3, 8))
    for backend in BACKENDS:
        layer.backend = backend
        torch.testing.assert_close(layer(x, context, key_mask=key_mask), expected)


def test_self_attention_weights_in_a_cross_attention_layer_attend_to_a_context():
    """A self-attention layer's fused weight, split into CrossAttention's q_proj and kv_proj."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, causal=False).double()
    cross = attnkit.CrossAttention(8, 8, 2, d_context=8).double()
    with torch.no_grad():
        cross.q_proj.weight.copy_(layer.qkv_proj.weight[:8])
        cross.kv_proj.weight.copy_(layer.qkv_proj.weight[8:])
        cross.out_proj.load_state_dict(layer.out_proj.state_dict())
    x, context = torch.randn(1, 3, 8, dtype=torch.float64), torch.randn(1, 5, 8, dtype=torch.float64)
    both = torch.cat([x, context], dim=1)
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:, 3:] = True  # every query sees only the context part
    torch.testing.assert_close(cross(x, context), layer(both, attn_mask=mask)[:, :3])


def test_cross_attention_refuses_a_kernel_component():
    """Kernel components (the ring) attend a sequence to itself; CrossAttention would hand them a context."""
    class Kernel:
        def prepare(self, request):
            return None

        def attention(self, q, k, v, *, causal, key_mask, scale):
            return q

    with pytest.raises(TypeError, match=r"CrossAttention's backend must be a backend's name \(str\), got Kernel"):
        CrossAttention(8, 8, 2, d_context=4, backend=Kernel())  # type: ignore[arg-type]
