"""No path materialises (T, S) scores unless weights are asked for.

A TorchDispatchMode sees every tensor each aten op returns (what the kernels
allocate internally stays hidden, but any (T, S) tensor built in Python by
attnkit would show), so the largest one bounds what attnkit itself allocates.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from attnkit import MultiHeadAttention, attention


class LargestTensor(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


T = S = 2048


def largest_tensor(fn) -> int:
    with LargestTensor() as mode:
        fn()
    return mode.largest


def test_chunked_forward_and_backward_never_hold_t_by_s():
    q, k, v = (torch.randn(1, 1, T, 16, requires_grad=True) for _ in range(3))
    mask = torch.ones(1, 1, 1, S, dtype=torch.bool)

    def run():
        attention(q, k, v, mask=mask, causal=True, backend="chunked").sum().backward()

    assert largest_tensor(run) <= T * S // 4


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_default_causal_path_builds_no_mask(backend):
    q, k, v = (torch.randn(1, 1, T, 16) for _ in range(3))
    assert largest_tensor(lambda: attention(q, k, v, causal=True, backend=backend)) <= T * S // 4


def test_math_backend_does_materialise_weights():
    """The probe itself works: the explicit backend's (T, S) weights are seen."""
    q, k, v = (torch.randn(1, 1, T, 16) for _ in range(3))
    assert largest_tensor(lambda: attention(q, k, v, backend="math")) >= T * S


def test_layer_has_no_quadratic_buffer_and_no_length_cap():
    layer = MultiHeadAttention(32, 32, 4, rope=True, window=64)
    assert all(b.numel() <= layer.head_dim for b in layer.buffers())
    assert set(layer.state_dict()) == {n for n, _ in layer.named_parameters()}
    x = torch.randn(1, 3000, 32)
    with torch.no_grad():
        assert largest_tensor(lambda: layer(x)) < 3000 * 3000
