"""Decoding over a long cache reads grouped key/value heads as they are: SDPA never copies them per query head."""

from __future__ import annotations

import pytest
import torch

import attnkit.backends.sdpa as sdpa_module
from attnkit import MultiHeadAttention
from attnkit.modules import KVCache


@pytest.mark.parametrize("batch", [1, 8])
def test_decoding_with_grouped_heads_and_padding_never_expands_them(batch: int, monkeypatch: pytest.MonkeyPatch):
    """One query per row over a padded batch's cache: the heads fold into the key/value heads (no repeat copy).

    The decoding steps equal the math backend's (which expands), so folding changes nothing but the bytes.
    """
    torch.manual_seed(0)
    layer = MultiHeadAttention(48, 48, 6, num_kv_heads=2, rope=True, backend="sdpa").double()
    reference = MultiHeadAttention(48, 48, 6, num_kv_heads=2, rope=True, backend="math").double()
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(batch, 12, 48, dtype=torch.float64)
    key_mask = torch.ones(batch, 12, dtype=torch.bool)
    key_mask[batch // 2:, :3] = False  # left padding of half the rows
    caches, reference_caches = KVCache(), KVCache()
    layer(x[:, :9], key_mask=key_mask[:, :9], kv_cache=caches)  # the prompt: T > 1 may expand
    reference(x[:, :9], key_mask=key_mask[:, :9], kv_cache=reference_caches)

    def no_copy(*args: object, **kwargs: object) -> None:
        raise AssertionError("a decoding step expanded the key/value heads")

    monkeypatch.setattr(sdpa_module, "expand_kv", no_copy)
    for t in range(9, 12):
        step = layer(x[:, t:t + 1], key_mask=key_mask[:, :t + 1], kv_cache=caches)  # (B, 1, C)
        expected = reference(x[:, t:t + 1], key_mask=key_mask[:, :t + 1], kv_cache=reference_caches)
        torch.testing.assert_close(step, expected)
