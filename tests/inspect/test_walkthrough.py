"""The walkthrough behind `attnkit explain`: its steps are the layer's own computation."""

from __future__ import annotations

import pytest
import torch

from attnkit import textbook as tb
from attnkit.inspect import walkthrough as wt
from tests._util import assert_close64, assert_printed
from tests.textbook import nb000_printed as nb000


def _steps(mha, example, **kw):
    return {s.key: s for s in wt.walkthrough(mha, example, **kw)}


def test_steps_in_order_and_output_equals_the_layer():
    example = wt.book_example()
    mha = wt.build_layer(3, 4, 2, 6, seed=123).eval()
    steps = wt.walkthrough(mha, example)
    assert [s.key for s in steps] == list(wt.STEPS)
    torch.testing.assert_close(steps[-1].tensors["output"], mha(example.embeddings).detach())


def test_with_dropout_equals_the_layer_in_training_mode_under_one_seed():
    example = wt.book_example()
    mha = wt.build_layer(3, 4, 2, 6, seed=123, dropout=0.5).train()
    torch.manual_seed(7)
    steps = _steps(mha, example)
    torch.manual_seed(7)
    expected = mha(example.embeddings).detach()
    torch.testing.assert_close(steps["output"].tensors["output"], expected)
    dropped = steps["dropout"].tensors["weights"]
    assert (dropped == 0).sum() > (steps["softmax"].tensors["weights"] == 0).sum()


def test_weights_rows_sum_to_one_and_respect_the_mask():
    steps = _steps(wt.build_layer(3, 6, 3, 6, seed=1).eval(), wt.book_example())
    weights, mask = steps["softmax"].tensors["weights"], steps["mask"].tensors["mask"]
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, 6))
    assert torch.equal(mask, torch.ones(6, 6, dtype=torch.bool).tril())
    assert (weights[:, ~mask] == 0).all()


def test_no_causal_against_a_float64_reference():
    example = wt.book_example()
    mha = wt.build_layer(3, 4, 2, 6, seed=5).eval().double()
    x = example.embeddings.double()
    steps = _steps(mha, wt.Example(example.tokens, x, "test"), causal=False)
    assert steps["mask"].tensors["mask"].all()
    q, k, v = (mha.split_heads(w(x).unsqueeze(0)) for w in (mha.W_query, mha.W_key, mha.W_value))
    expected = mha.out_proj(mha.merge_heads(torch.softmax(q @ k.mT / 2**0.5, -1) @ v))[0]
    assert_close64(steps["output"].tensors["output"], expected)


def test_text_example_is_seeded_and_rejects_empty_text():
    a, b = wt.text_example("a b c", seed=1), wt.text_example("a  b c ", seed=1)
    assert a.tokens == ("a", "b", "c") and torch.equal(a.embeddings, b.embeddings)
    assert not torch.equal(a.embeddings, wt.text_example("a b c", seed=2).embeddings)
    assert "seed 1" in a.source
    with pytest.raises(ValueError, match=r"text '  ' is empty"):
        wt.text_example("  ", seed=0)


def test_mismatched_or_non_finite_example():
    mha = wt.build_layer(3, 4, 2, 6, seed=0)
    x = tb.book_inputs()
    with pytest.raises(ValueError, match=r"2 tokens but 6 embeddings"):
        wt.walkthrough(mha, wt.Example(("a", "b"), x, "t"))
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite"):
        wt.walkthrough(mha, wt.Example(tb.WORDS, x, "t"))


def test_select_keeps_order_and_rejects_unknown_names():
    steps = wt.walkthrough(wt.build_layer(3, 4, 2, 6, seed=0), wt.book_example())
    assert [s.key for s in wt.select(steps, ["output", "scores"])] == ["scores", "output"]
    with pytest.raises(ValueError, match=r"unknown step\(s\) sores; choose from: inputs, weights"):
        wt.select(steps, ["sores"])


def _nb000_layer() -> tb.MultiHeadAttention:
    mha = tb.MultiHeadAttention(4, 4, context_length=6, dropout=0.2, num_heads=2).eval()
    with torch.no_grad():
        for name, w in (("W_query", nb000.WQ), ("W_key", nb000.WK), ("W_value", nb000.WV)):
            getattr(mha, name).weight.copy_(torch.tensor(w))
    return mha


def test_notebook_000_every_printed_step():
    """Notebook 000 prints its inputs and weights but no seed that reproduces them.

    Every later step is recomputed from those 4-decimal prints, so rounding
    (up to 5e-5 in each of 4 input and 4 weight entries per dot product)
    bounds the error of projections and scores by about 3e-4; softmax
    weights, which damp it, are held to 1e-4.
    """
    rounding = 3e-4
    example = wt.Example(tuple("abcdef"), torch.tensor(nb000.INPUT_EMBEDDINGS), "notebook 000")
    steps = _steps(_nb000_layer(), example)
    qkv = steps["qkv"].tensors
    for name, printed in (("queries", nb000.QUERIES), ("keys", nb000.KEYS), ("values", nb000.VALUES)):
        assert_printed(qkv[name], printed, atol=rounding)
    assert_printed(steps["scores"].tensors["scores"], nb000.SCORES, atol=rounding)
    assert torch.equal(steps["mask"].tensors["mask"], ~torch.ones(6, 6).triu(1).bool())
    assert_printed(steps["softmax"].tensors["weights"], nb000.WEIGHTS)
    # 000's dropout mask is a draw we cannot replay; start from the weights it printed:
    values = steps["split"].tensors["values"]
    context = torch.tensor(nb000.DROPPED_WEIGHTS) @ values
    assert_printed(context, nb000.CONTEXT, atol=rounding)
    assert_printed(_nb000_layer().merge_heads(context.unsqueeze(0))[0], nb000.MERGED, atol=rounding)
