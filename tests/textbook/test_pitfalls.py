"""One test per pitfall listed in shared/seeds/README.md.

Each test fails on the notebook's mistaken version; the docstring says how.
"""

from __future__ import annotations

import pytest
import torch

from attnkit import textbook as tb
from tests._util import assert_close64


def _perturb_after(x: torch.Tensor, t: int) -> torch.Tensor:
    y = x.clone()
    y[:, t + 1 :] += torch.randn_like(y[:, t + 1 :])
    return y


@pytest.mark.parametrize("make", [
    lambda: tb.CausalAttention(5, 4, 8, 0.0),
    lambda: tb.MultiHeadAttentionWrapper(5, 2, 8, 0.0, num_heads=3),
    lambda: tb.MultiHeadAttention(5, 6, 8, 0.0, num_heads=3),
    lambda: tb.PerHeadAttention(5, 2, num_heads=3),
])
def test_1_causal_outputs_ignore_future_tokens(make):
    """004's CasualAttention dropped masked_fill's result, so token t saw tokens after t."""
    torch.manual_seed(0)
    layer, x = make(), torch.randn(2, 7, 5)
    for t in range(6):
        torch.testing.assert_close(layer(_perturb_after(x, t))[:, : t + 1], layer(x)[:, : t + 1])


def test_2_scores_scaled_once_by_sqrt_head_dim():
    """004's MultiHeadAttention divided by sqrt(head_dim) twice (invisible at head_dim=1)."""
    torch.manual_seed(0)
    mha = tb.MultiHeadAttention(3, 8, 6, 0.0, num_heads=2).double()  # head_dim = 4
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    q, k, v = (mha.split_heads(w(x)) for w in (mha.W_query, mha.W_key, mha.W_value))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()

    def reference(scale: float) -> torch.Tensor:
        scores = (q @ k.transpose(-2, -1) * scale).masked_fill(~causal, -torch.inf)
        return mha.out_proj(mha.merge_heads(torch.softmax(scores, -1) @ v))

    assert_close64(mha(x), reference(4**-0.5))
    assert (mha(x) - reference(4**-1.0)).abs().amax() > 1e-3  # the twice-scaled version differs


def test_3_divisibility_checks_d_out_not_batch_size():
    """003 asserted Q.size(0) // n_heads == 0: it tested the batch size, not d_model % n_heads."""
    with pytest.raises(ValueError, match=r"d_out=10 is not divisible by num_heads=3"):
        tb.MultiHeadAttention(9, 10, 4, 0.0, num_heads=3)
    mha = tb.MultiHeadAttention(9, 9, 4, 0.0, num_heads=3)
    assert mha(torch.randn(5, 4, 9)).shape == (5, 4, 9)  # batch 5: 5 // 3 != 0, yet valid


def test_4_heads_merged_after_transposing_back():
    """003 merged (b, heads, seq, hd) with .view(b, seq, d_model) and no transpose."""
    mha = tb.MultiHeadAttention(3, 6, 4, 0.0, num_heads=2)
    per_token = torch.arange(2 * 4 * 6, dtype=torch.float32).reshape(2, 4, 6)
    torch.testing.assert_close(mha.merge_heads(mha.split_heads(per_token)), per_token)
    wrong = mha.split_heads(per_token).contiguous().view(2, 4, 6)
    assert not torch.equal(wrong, per_token)


def test_5_mask_follows_the_module_device():
    """003 built the mask on the CPU inside forward: wrong device on a GPU.

    The meta device stands in for a GPU: mixing a CPU mask with meta tensors
    raises, a registered buffer moves with ``.to()``.
    """
    mha = tb.MultiHeadAttention(9, 9, 4, 0.0, num_heads=3).to("meta")
    out = mha(torch.empty(2, 4, 9, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 4, 9)
    heads = tb.PerHeadAttention(9, 3, num_heads=3).to("meta")
    assert heads(torch.empty(2, 4, 9, device="meta")).device.type == "meta"


def test_6_each_hand_written_head_masks_its_own_scores():
    """001's heads masked `attn` (the single head's scores) instead of attn_1 / attn_2."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 12)
    heads = [tuple(torch.randn(16, 12) * 0.2 for _ in range(3)) for _ in range(2)]
    (_, attn_1), (_, attn_2) = (tb.causal_head(x, *h) for h in heads)
    for (q, k, _), attn in zip(heads, (attn_1, attn_2), strict=True):
        scores = (x @ q.T) @ (x @ k.T).transpose(-2, -1) / 4.0
        expected = torch.softmax(tb.mask_with_neg_inf(scores), dim=-1)
        torch.testing.assert_close(attn, expected)
    assert (attn_1 - attn_2).abs().amax() > 1e-3


@pytest.mark.parametrize("cls", ["CausalAttention", "MultiHeadAttentionWrapper", "MultiHeadAttention"])
def test_7_inputs_shorter_than_context_length(cls):
    """000 used the registered (CONTEXT_SIZE, CONTEXT_SIZE) mask unsliced: shorter inputs failed."""
    torch.manual_seed(0)
    layer = {
        "CausalAttention": lambda: tb.CausalAttention(4, 4, 6, 0.0),
        "MultiHeadAttentionWrapper": lambda: tb.MultiHeadAttentionWrapper(4, 2, 6, 0.0, num_heads=2),
        "MultiHeadAttention": lambda: tb.MultiHeadAttention(4, 4, 6, 0.0, num_heads=2),
    }[cls]()
    x = torch.randn(2, 6, 4)
    for n in range(1, 6):  # a causal prefix is computed the same whatever follows it
        torch.testing.assert_close(layer(x[:, :n]), layer(x)[:, :n])


@pytest.mark.parametrize("cls", [tb.SelfAttention_v1, tb.SelfAttention_v2])
def test_8_batched_input(cls):
    """002 and 004 used `queries @ keys.T`, which only works for unbatched 2-d input."""
    torch.manual_seed(0)
    layer, batch = cls(3, 2), torch.randn(4, 6, 3)
    torch.testing.assert_close(layer(batch), torch.stack([layer(x) for x in batch]))


def test_9_stable_softmax_does_not_overflow():
    """softmax_naive computes exp(1000) = inf, then inf / inf = NaN."""
    scores = torch.tensor([1000.0, 0.0, -1000.0, 999.0])
    assert torch.isnan(tb.softmax_naive(scores)).any()  # the notebooks' version fails here
    stable = tb.softmax_stable(scores)
    torch.testing.assert_close(stable, torch.softmax(scores.double(), 0).float())
    small = torch.randn(5, 7)
    torch.testing.assert_close(tb.softmax_stable(small), tb.softmax_naive(small))


def test_10_fully_masked_row_gives_zeros_not_nan():
    """softmax of an all -inf row (a padding query) is NaN, and so is its gradient."""
    scores = torch.tensor([[0.5, -torch.inf, 1.0], [-torch.inf] * 3], requires_grad=True)
    assert torch.isnan(torch.softmax(scores, -1)).any()
    weights = tb.softmax_stable(scores)
    torch.testing.assert_close(weights[1], torch.zeros(3))
    torch.testing.assert_close(weights[0], torch.softmax(scores[0].detach(), -1))
    (weights * torch.randn(2, 3)).sum().backward()
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("make", [
    lambda: tb.CausalAttention(4, 4, 6, 0.0),
    lambda: tb.MultiHeadAttentionWrapper(4, 2, 6, 0.0, num_heads=2),
    lambda: tb.MultiHeadAttention(4, 4, 6, 0.0, num_heads=2),
])
def test_11_too_long_input_is_a_clear_error(make):
    """An input longer than context_length failed with an unclear indexing/broadcast error."""
    with pytest.raises(ValueError, match=r"num_tokens=7 but this layer was built with context_length=6"):
        make()(torch.randn(2, 7, 4))


def test_12_dropout_only_in_training_mode():
    """With dropout the weights no longer sum to one; eval() must switch it off."""
    torch.manual_seed(0)
    mha = tb.MultiHeadAttention(4, 4, 6, dropout=0.5, num_heads=2)
    x = torch.randn(2, 6, 4)
    mha.eval()
    no_dropout = tb.MultiHeadAttention(4, 4, 6, dropout=0.0, num_heads=2)
    no_dropout.load_state_dict(mha.state_dict())
    torch.testing.assert_close(mha(x), no_dropout(x))
    mha.train()
    torch.manual_seed(1)
    first = mha(x)
    assert (first - no_dropout(x)).abs().amax() > 1e-3
    torch.manual_seed(1)
    torch.testing.assert_close(mha(x), first)  # training randomness comes from the seed alone
