"""The data, the model and the head ablation of attnkit.train.induction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.train import AttentionOnlyTransformer, InductionConfig, ablate_heads, make_batch
from attnkit.train.induction import evaluate, find_heads


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), seq_len=st.integers(4, 40), vocab=st.integers(2, 50), size=st.integers(1, 6))
def test_every_sequence_repeats_a_segment_at_a_later_offset(seed, seq_len, vocab, size):
    batch = make_batch(size, seq_len, vocab, generator=torch.Generator().manual_seed(seed))
    assert batch.tokens.shape == (size, seq_len) and batch.tokens.dtype == torch.long
    assert int(batch.tokens.min()) >= 0 and int(batch.tokens.max()) < vocab
    assert bool(((batch.length >= 2) & (batch.length <= seq_len // 2)).all())
    assert bool((batch.first >= 0).all() and (batch.second >= batch.first + batch.length).all())
    assert bool((batch.second + batch.length <= seq_len).all())
    for b in range(size):
        f, s, n = int(batch.first[b]), int(batch.second[b]), int(batch.length[b])
        assert torch.equal(batch.tokens[b, s:s + n], batch.tokens[b, f:f + n])
    # predictable targets: the repeat after its first token, length - 1 of them per sequence
    assert torch.equal(batch.predictable_targets().sum(1), batch.length - 1)
    assert torch.equal(batch.repeat_positions().sum(1), batch.length)


def test_offsets_and_lengths_vary_and_the_seed_fixes_the_data():
    """With a fixed offset the task is solvable from positions alone, and no induction head forms."""
    batch = make_batch(512, 32, 16, generator=torch.Generator().manual_seed(0))
    assert len(set((batch.second - batch.first).tolist())) > 10
    assert len(set(batch.length.tolist())) > 10
    assert len(set(batch.first.tolist())) > 10
    again = make_batch(512, 32, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch.tokens, again.tokens) and torch.equal(batch.second, again.second)


def _model(seed: int = 0, **kw) -> AttentionOnlyTransformer:
    torch.manual_seed(seed)
    return AttentionOnlyTransformer(vocab_size=11, seq_len=12, d_model=16, num_heads=4, num_layers=2, **kw)


@pytest.mark.parametrize("rope", [False, True])
def test_model_is_causal_and_returns_each_layers_weights(rope):
    """A logit at position t must not depend on later tokens (a non-causal layer would leak the answer)."""
    model = _model(rope=rope).eval().requires_grad_(False)
    tokens = torch.randint(0, 11, (3, 12), generator=torch.Generator().manual_seed(1))
    logits, weights = model(tokens, need_weights=True)
    assert logits.shape == (3, 12, 11) and len(weights) == 2
    for w in weights:
        assert w.shape == (3, 4, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.ones(3, 4, 12))
        assert float(w.triu(1).abs().max()) == 0.0
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 11
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7])
    assert not torch.allclose(model(changed)[:, 7:], logits[:, 7:])


def test_ablating_a_head_removes_exactly_that_head_and_is_undone():
    """Inside the block the output no longer depends on the head's values; other heads still matter; restored after."""
    model = _model().eval()
    tokens = torch.randint(0, 11, (2, 12), generator=torch.Generator().manual_seed(2))
    before = model(tokens)
    weight_before = model.layers[1].out_proj.weight.detach().clone()
    weight0 = model.layers[0].out_proj.weight.detach().clone()
    qkv = model.layers[1].qkv_proj.weight  # rows: queries (16), keys (16), values (16); head 2 = rows 8..11
    with ablate_heads(model, [(1, 2)]), torch.no_grad():
        ablated = model(tokens)
        assert not torch.allclose(ablated, before)
        # random changes: a constant added to a row would cancel out (LayerNorm's output sums to zero)
        noise = torch.randn(4, 16, generator=torch.Generator().manual_seed(4))
        qkv[32 + 8:32 + 12] += noise  # head 2's values: no effect while it is ablated
        torch.testing.assert_close(model(tokens), ablated)
        qkv[32 + 4:32 + 8] += noise  # head 1's values: still an effect
        assert not torch.allclose(model(tokens), ablated)
    torch.testing.assert_close(model.layers[1].out_proj.weight, weight_before)
    with pytest.raises(ValueError, match=r"no head \(1, 4\)"), ablate_heads(model, [(0, 1), (1, 4)]):
        pass
    torch.testing.assert_close(model.layers[0].out_proj.weight, weight0)  # (0, 1) was zeroed, then restored


def test_find_heads_takes_the_previous_token_head_from_a_layer_below():
    metrics = {"induction": [[0.1, 0.2], [0.05, 0.8]], "previous_token": [[0.3, 0.6], [0.9, 0.1]]}
    assert find_heads(metrics) == ((1, 1), (0, 1))  # not (1, 0): a layer-1 head cannot feed layer 1
    metrics = {"induction": [[0.7, 0.2], [0.05, 0.1]], "previous_token": [[0.3, 0.6], [0.9, 0.1]]}
    assert find_heads(metrics) == ((0, 0), (1, 0))


def test_evaluate_separates_predictable_from_unpredictable_targets():
    """loss_repeat is the mean over predictable targets, loss_random over the rest (swapped masks would fail)."""
    batch = make_batch(8, 12, 11, generator=torch.Generator().manual_seed(3))
    model = _model().eval().requires_grad_(False)
    metrics = evaluate(model, batch)
    assert len(metrics["induction"]) == 2 and len(metrics["induction"][0]) == 4
    logits = model(batch.tokens)
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch.tokens[:, 1:], reduction="none")
    mask = batch.predictable_targets()
    assert metrics["loss_repeat"] == pytest.approx(float(losses[mask].mean()), rel=1e-5)
    assert metrics["loss_random"] == pytest.approx(float(losses[~mask].mean()), rel=1e-5)


@pytest.mark.parametrize(("option", "message"), [
    ({"steps": 0}, "steps=0"),
    ({"seq_len": 3}, "seq_len=3 is too short"),
    ({"vocab_size": 1}, "vocab_size=1"),
    ({"d_model": 30, "num_heads": 4}, "d_model=30 is not divisible by num_heads=4"),
    ({"lr": 0.0}, "lr=0.0"),
])
def test_config_rejects_bad_values_by_name(option, message):
    with pytest.raises(ValueError, match=message):
        InductionConfig(**option)
