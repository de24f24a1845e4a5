"""What one rank's ring arguments must be (src/attnkit/distributed/checks.py): the backends' own checks, as text."""

from __future__ import annotations

import pytest
import torch

from attnkit.backends.kernel import check_kernel
from attnkit.distributed import ContextParallel
from attnkit.distributed.checks import describe
from attnkit.functional import MaskModifier, alibi, document_mask, softcap


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


def test_a_ring_takes_one_dtype_though_attention_reads_half_precision_keys():
    q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    problem, _ = _describe(q, kv.bfloat16(), kv.bfloat16())
    assert problem == "ring attention takes q, k, v in one dtype, got q torch.float32 and k, v torch.bfloat16"


def test_a_ring_needs_as_many_keys_as_queries_on_each_rank():
    q, kv = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    problem, meta = _describe(q, kv, kv)
    assert problem == "q, k and v must hold the same n positions of this rank, got q n=4, k n=6" and meta == {}


def test_the_scale_is_a_fact_every_rank_must_share():
    q = torch.randn(1, 2, 4, 8)
    assert _describe(q, q, q)[1]["scale"] is None
    assert _describe(q, q, q, scale=torch.tensor(0.5))[1]["scale"] == 0.5


def test_modifiers_are_checked_at_the_whole_sequences_positions():
    """A document mask labels all T = n * P positions, not the n of a shard; ALiBi needs one slope per head."""
    q = torch.randn(1, 2, 4, 8)
    problem, _ = _describe(q, q, q, mask_mod=document_mask(torch.zeros(4, dtype=torch.long)))
    assert problem is not None and "doc_ids must label positions 0 .. 7" in problem
    assert _describe(q, q, q, mask_mod=document_mask(torch.zeros(8, dtype=torch.long)))[0] is None
    assert _describe(q, q, q, score_mod=alibi(3))[0] == "alibi(3 heads) has 3 slopes (one per head) but q has H=2 heads"
    problem, _ = _describe(q, q, q, sinks=torch.zeros(3))
    assert problem is not None and problem.startswith("sinks must be a floating-point (H,) = (2,) tensor")


def test_a_modifier_is_evaluated_once_before_the_ring():
    """A modifier that returns the wrong kind of tensor is a rank's problem (the same on every rank), not an
    error inside the ring, where its peers would wait for it."""
    q = torch.randn(1, 2, 4, 8)
    problem, _ = _describe(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx)
    assert problem is not None and "returned a torch.int64 tensor; expected a bool tensor" in problem
    problem, _ = _describe(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score > 0)
    assert problem is not None and "returned a torch.bool tensor; expected a floating-point tensor" in problem


def test_the_modifiers_and_their_learned_tensors_are_facts_every_rank_shares():
    q = torch.randn(1, 2, 4, 8)
    meta = _describe(q, q, q, score_mod=alibi(2), sinks=torch.zeros(2))[1]
    assert (meta["score_mod"], meta["mask_mod"], meta["sinks given"]) == ("alibi(2 heads)", None, True)
    assert meta["gradients needed"] is False
    cap = torch.tensor(5.0, requires_grad=True)  # closed over by the modifier: the ring must differentiate
    assert _describe(q, q, q, score_mod=softcap(cap))[1]["gradients needed"] is True
    assert _describe(q, q, q, sinks=torch.zeros(2, requires_grad=True))[1]["gradients needed"] is True
    with torch.no_grad():
        assert _describe(q, q, q, score_mod=softcap(cap))[1]["gradients needed"] is False

    class Everything(MaskModifier):  # no repr of its own: the default one holds a per-process address
        def __call__(self, b, h, q_idx, kv_idx):
            return torch.ones_like(q_idx - kv_idx, dtype=torch.bool)

    name = _describe(q, q, q, mask_mod=Everything())[1]["mask_mod"]
    assert name.endswith("Everything object>") and "0x" not in name, name  # equal on every rank


def test_context_parallel_takes_the_modifiers_a_layer_hands_its_kernel():
    """check_kernel(modifiers=True) accepts ContextParallel, refuses a kernel whose attention lacks the keywords
    (naming them), and without modifiers still accepts it."""
    check_kernel(ContextParallel.__new__(ContextParallel), modifiers=True)

    class Old:
        def prepare(self, request):
            return None

        def attention(self, q, k, v, *, causal, key_mask, scale, sinks=None):
            return q

    check_kernel(Old())
    with pytest.raises(TypeError, match=r"Old.attention lacks score_mod, mask_mod$"):
        check_kernel(Old(), modifiers=True)
