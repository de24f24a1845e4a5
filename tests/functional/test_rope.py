"""Rotary position embedding: relative positions, the complex form, offsets, Llama's tables."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import RotaryEmbedding
from attnkit.functional import rotate_half


@given(m=st.integers(0, 5000), n=st.integers(0, 5000), shift=st.integers(0, 5000),
       d=st.sampled_from([2, 8, 64]), seed=st.integers(0, 1000))
@settings(max_examples=50, deadline=None)
def test_scores_depend_only_on_relative_position(m, n, shift, d, seed):
    gen = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d)
    q, k = torch.randn(d, generator=gen, dtype=torch.float64), torch.randn(d, generator=gen, dtype=torch.float64)

    def score(i, j):
        return rope.rotate(q[None], torch.tensor([i]))[0] @ rope.rotate(k[None], torch.tensor([j]))[0]

    torch.testing.assert_close(score(m, n), score(m + shift, n + shift), atol=1e-9, rtol=1e-9)


def test_equals_the_complex_number_formulation():
    """Pairs (x[i], x[i + D/2]) are complex numbers multiplied by exp(i * pos * theta_i)."""
    d, positions = 16, torch.arange(0, 40, dtype=torch.float64)
    x = torch.randn(40, d, dtype=torch.float64)
    theta = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[:, : d // 2], x[:, d // 2 :])
    rotated = z * torch.polar(torch.ones_like(theta), positions[:, None] * theta)
    expected = torch.cat([rotated.real, rotated.imag], dim=-1)
    torch.testing.assert_close(RotaryEmbedding(d).rotate(x, positions.long()), expected)


def test_half_precision_keeps_positions():
    """Angles are computed in float64 whatever the dtype: a bf16 layer rotates like a float32 one."""
    rope, x = RotaryEmbedding(64), torch.randn(1, 1, 8, 64)
    positions = torch.arange(10000, 10008)
    expected = rope.rotate(x.double(), positions)
    torch.testing.assert_close(rope.rotate(x.bfloat16(), positions).double(), expected, atol=0.05, rtol=0.02)
    assert not list(rope.buffers())


def test_offset_continues_the_positions():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 10, 8)
    q_all, k_all = rope(q, k)
    q_tail, k_tail = rope(q[:, :, 6:], k[:, :, 6:], offset=6)
    torch.testing.assert_close(q_tail, q_all[:, :, 6:])
    torch.testing.assert_close(k_tail, k_all[:, :, 6:])
    torch.testing.assert_close(rotate_half(rotate_half(q)), -q)


def test_matches_llama_cos_sin_tables():
    """Same convention as Llama in transformers (half split, base 10000).

    transformers computes angles in float32, off by ~1e-4 rad near position
    3000; attnkit computes them in float64, hence the tolerance there.
    """
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=10000.0,
                                      max_position_embeddings=4096)
    hf_rope = LlamaRotaryEmbedding(config=config)
    q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 4, 40, 16)
    for start, atol in ((0, 1e-5), (3000, 2e-4)):
        cos, sin = hf_rope(q, torch.arange(start, start + 40)[None])
        hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
        ours_q, ours_k = RotaryEmbedding(16)(q, k, offset=start)
        torch.testing.assert_close(ours_q, hf_q, atol=atol, rtol=0)
        torch.testing.assert_close(ours_k, hf_k, atol=atol, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"positive even head_dim, got head_dim=7"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match=r"base must be > 1, got base=1.0"):
        RotaryEmbedding(8, base=1.0)
    with pytest.raises(ValueError, match=r"RotaryEmbedding\(head_dim=8\) got vectors of size 6"):
        RotaryEmbedding(8)(torch.randn(1, 1, 2, 6), torch.randn(1, 1, 2, 6))
    with pytest.raises(ValueError, match=r"same positions, got T=2 and 3"):
        RotaryEmbedding(8)(torch.randn(1, 1, 2, 8), torch.randn(1, 1, 3, 8))


def test_remembered_angles_never_leak_an_inference_tensor_into_autograd():
    """The last call's angles are reused only in the same mode: inference-mode tensors cannot be saved for backward."""
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 2, 3, 8)
    with torch.inference_mode():
        expected = rope(q, q, offset=4)
    x = q.clone().requires_grad_()
    rotated, _ = rope(x, x, offset=4)  # same positions, outside inference mode
    rotated.sum().backward()
    torch.testing.assert_close(rotated.detach(), expected[0])
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_linear_scaling_divides_every_position():
    """scaling=4 at position 4p is plain RoPE at p, through rotate, offsets and per-row positions alike."""
    plain, scaled = RotaryEmbedding(16), RotaryEmbedding(16, scaling=4.0)
    q, k = torch.randn(2, 3, 5, 16, dtype=torch.float64), torch.randn(2, 3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(scaled.rotate(q, torch.arange(0, 20, 4)), plain.rotate(q, torch.arange(5)))
    rows = torch.tensor([[0, 4, 8, 12, 16], [40, 44, 48, 52, 56]])
    expected = plain(q, k, positions=rows // 4)
    for ours, theirs in zip(scaled(q, k, positions=rows), expected, strict=True):
        torch.testing.assert_close(ours, theirs)
    q_off, _ = scaled(q, k, offset=8)  # positions 8 .. 12: plain 2, 2.25, ..., 3
    torch.testing.assert_close(q_off[..., ::4, :], plain.rotate(q[..., ::4, :], torch.tensor([2, 3])))
    assert not torch.allclose(q_off, plain(q, k, offset=8)[0])  # scaling is not ignored


def test_remembered_angles_are_not_shared_across_scalings():
    """Angles remembered for one scaling must not be reused after it changes."""
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 3, 8, dtype=torch.float64)
    before, _ = rope(q, q, offset=5)
    rope.scaling = 2.0
    after, _ = rope(q, q, offset=5)
    torch.testing.assert_close(after, RotaryEmbedding(8, scaling=2.0)(q, q, offset=5)[0])
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("scaling", [0, -1.0, float("nan"), float("inf"), True, "4"])
def test_bad_scaling_is_named(scaling):
    with pytest.raises(ValueError, match=rf"scaling must be a finite number > 0, got scaling={scaling!r}"):
        RotaryEmbedding(8, scaling=scaling)


def test_repr_shows_scaling_only_when_used():
    assert repr(RotaryEmbedding(8)) == "RotaryEmbedding(head_dim=8, base=10000)"
    assert repr(RotaryEmbedding(8, scaling=4)) == "RotaryEmbedding(head_dim=8, base=10000, scaling=4)"


def test_rope_base_of_the_wrong_type_is_a_clear_error():
    with pytest.raises(ValueError, match=r"RotaryEmbedding base must be > 1, got base='10'"):
        RotaryEmbedding(4, base="10")  # type: ignore[arg-type]


def test_changing_rope_base_changes_the_angles():
    """Review finding: the remembered angles ignored base, so a changed base kept the old rotation."""
    rope = RotaryEmbedding(8)
    q = torch.randn(1, 1, 3, 8)
    rope(q, q)
    rope.base = 500.0
    torch.testing.assert_close(rope(q, q)[0], RotaryEmbedding(8, base=500.0)(q, q)[0])
