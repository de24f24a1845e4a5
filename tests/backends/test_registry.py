"""The registry of kernels and how "auto" chooses among them (src/attnkit/backends/registry.py)."""

from __future__ import annotations

import torch

from attnkit.backends import BACKENDS, choose, make_call


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
