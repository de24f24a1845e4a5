"""attnkit.trace on a transformers model running on "attnkit" records every layer, equal to eager.

Needs the lead's commit "trace through attention()": attnkit.trace observing every
attnkit.attention() call made inside the traced model.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnkit
from attnkit.integrations.transformers import register
from tests.integrations._tiny import FAMILIES, build, padded_batch, transformers

_seen: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []


def _eager_probe(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 **kwargs: Any) -> tuple[Tensor, Tensor]:
    """Llama's eager attention, keeping its q, k, v (G heads) and weights."""
    from transformers.models.llama.modeling_llama import eager_attention_forward
    out, weights = eager_attention_forward(module, query, key, value, attention_mask, **kwargs)
    _seen.append((query, key, value, weights))
    return out, weights


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()
    transformers.AttentionInterface.register("eager-probe", _eager_probe)
    transformers.masking_utils.AttentionMaskInterface.register("eager-probe", transformers.masking_utils.eager_mask)


def test_trace_records_every_layer_of_an_hf_model_equal_to_eager() -> None:
    """Each layer's record (named after its attention module) holds eager's q, k, v and weights on valid rows."""
    family = FAMILIES[0]  # Llama with GQA: 4 query heads, 2 key/value heads
    model = build(family)
    ids, mask = padded_batch(family)
    model.set_attn_implementation("eager-probe")
    _seen.clear()
    with torch.no_grad():
        model(ids, attention_mask=mask)
    model.set_attn_implementation("attnkit")
    with torch.no_grad(), attnkit.trace(model) as t:
        model(ids, attention_mask=mask)
    assert [r.name for r in t.records] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    rows = mask.bool()  # (B, T): eager spreads fully masked (padding) query rows uniformly; attnkit gives 0
    for record, (q, k, v, weights) in zip(t.records, _seen, strict=True):
        # padding positions' hidden states differ after layer 0 (eager's uniform rows), so compare real tokens
        def real(x):
            return x.transpose(1, 2)[rows]  # (B, H, T, D) -> (N, H, D)

        torch.testing.assert_close(real(record.queries), real(q), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(real(record.keys), real(k.repeat_interleave(2, dim=1)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(real(record.values), real(v.repeat_interleave(2, dim=1)), atol=1e-5, rtol=1e-5)
        ours, theirs = record.weights.transpose(1, 2)[rows], weights.transpose(1, 2)[rows]  # (N, H, S)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert len(_seen) == 2
