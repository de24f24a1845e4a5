"""What one rank's ring arguments must be (src/attnkit/distributed/checks.py): the backends' own checks, as text."""

from __future__ import annotations

import torch

from attnkit.distributed.checks import describe


def _describe(q, k, v, **options):
    return describe(q, k, v, **{"causal": False, "key_mask": None, "layout": "zigzag", "world": 2, **options})


def test_a_ranks_problem_is_the_message_attention_itself_would_raise():
    """Validation exists once: ring arguments are checked by attnkit.backends.call, turned into a description."""
    q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    assert _describe(q, kv, kv) == ("q has H=3 heads, k and v have G=2: H must be a multiple of G", {})
    problem, _ = _describe(q[:, :2], kv, kv, key_mask=torch.ones(1, 5, dtype=torch.bool))
    assert problem == "key_mask must be a bool (B, n) = (1, 4) tensor, True = real token; got torch.bool (1, 5)"
    problem, _ = _describe(q[:, :2], kv, kv, scale=0.0)
    assert problem == "scale must be a positive finite number or None, got scale=0.0"


def test_a_ring_needs_as_many_keys_as_queries_on_each_rank():
    q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    problem, meta = _describe(q, kv, kv)
    assert problem == "q, k and v must hold the same n positions of this rank, got q n=4, k n=6" and meta == {}


def test_the_scale_is_a_fact_every_rank_must_share():
    q = torch.randn(1, 2, 4, 8)
    assert _describe(q, q, q)[1]["scale"] is None
    assert _describe(q, q, q, scale=torch.tensor(0.5))[1]["scale"] == 0.5
