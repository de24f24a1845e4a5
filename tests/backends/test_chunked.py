"""The chunked backend and its block API (src/attnkit/backends/chunked.py), the kernel the ring is built on."""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.backends import chunked


def _qkv(t: int = 7, s: int = 7, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
                 for shape in ((2, 4, t, 8), (2, 2, s, 8), (2, 2, s, 8)))


def _second_order(backend: str) -> tuple[torch.Tensor, ...]:
    q, k, v = _qkv()
    w = torch.randn(2, 4, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = attention(q, k, v, causal=True, backend=backend)
    (g,) = torch.autograd.grad((out * w).sum(), q, create_graph=True)
    assert g.requires_grad, f"{backend}: the first-order gradient carries no graph"
    return (g, *torch.autograd.grad(g.pow(2).sum(), (q, k, v)))


def test_double_backward_through_chunked_is_not_silently_constant():
    """create_graph=True through chunked gave a gradient with requires_grad=False (a penalty on
    it got zero gradient). Second-order gradients now equal the math backend's."""
    for got, expected in zip(_second_order("chunked"), _second_order("math"), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-9)


def test_chunked_under_torch_func_vmap_and_grad():
    """vmap failed ("inplace arithmetic ... not possible") and torch.func.grad failed ("must
    override the setup_context staticmethod"). Both now give the math backend's results."""
    q, k, v = (x.detach() for x in _qkv())
    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(2)) > 0.3

    def loss(backend: str):
        return lambda q: attention(q, k, v, causal=True, key_mask=mask, backend=backend).pow(2).sum()

    torch.testing.assert_close(torch.func.grad(loss("chunked"))(q), torch.func.grad(loss("math"))(q))
    batch = [x.unsqueeze(0).repeat(3, 1, 1, 1, 1) for x in (q, k, v)]  # (3, B, H, T, D)
    for backend_fn in (lambda *a: attention(*a, causal=True, backend="chunked"),):
        got = torch.func.vmap(backend_fn)(*batch)
        expected = torch.func.vmap(lambda *a: attention(*a, causal=True, backend="math"))(*batch)
        torch.testing.assert_close(got, expected)
    per_sample = torch.func.vmap(torch.func.grad(loss("chunked")))(batch[0])
    torch.testing.assert_close(per_sample, torch.func.vmap(torch.func.grad(loss("math")))(batch[0]))


def test_chunked_leaves_its_inputs_untouched():
    q, k, v = (x.detach() for x in _qkv())
    copies = [x.clone() for x in (q, k, v)]
    attention(q, k, v, causal=True, backend="chunked")
    for x, c in zip((q, k, v), copies, strict=True):
        assert torch.equal(x, c)


@pytest.mark.parametrize("causal", [False, True])
def test_block_forward_halves_merge_to_the_whole(causal):
    """The block API the ring uses: two key halves, each with its offset, merged by lse equal one call."""
    q, k, v = (x.detach() for x in _qkv(t=6, s=10))
    plan = chunked.block_plan(q, 10, causal=causal, scale=8**-0.5, offset=4)
    whole, whole_lse = chunked.block_forward(plan, q, k, v, None)
    parts = [chunked.block_forward(chunked.block_plan(q, 5, causal=causal, scale=8**-0.5, offset=4 - start),
                                   q, k[:, :, start:start + 5], v[:, :, start:start + 5], None)
             for start in (0, 5)]
    out, lse = parts[0][0].clone(), parts[0][1].clone()
    chunked.merge_into(out[:, :, 1:], lse[:, :, 1:], *(x[:, :, 1:] for x in parts[1]))  # views merge in place
    chunked.merge_into(out[:, :, :1], lse[:, :, :1], *(x[:, :, :1] for x in parts[1]))
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, whole_lse)
    torch.testing.assert_close(whole, attention(q, k, v, causal=causal, backend="math"))


def test_block_backward_of_halves_adds_up_to_the_whole():
    q, k, v = (x.detach() for x in _qkv(t=6, s=10))
    dout = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    mask = (torch.rand(2, 10) > 0.3)[:, None, None, :]
    plan = chunked.block_plan(q, 10, causal=True, scale=8**-0.5, offset=4)
    out, lse = chunked.block_forward(plan, q, k, v, mask)
    delta = chunked.softmax_delta(dout, out, torch.float64)
    whole = chunked.block_backward(plan, q, k, v, mask, dout, lse, delta)
    halves = [chunked.block_backward(chunked.block_plan(q, 5, causal=True, scale=8**-0.5, offset=4 - s), q,
                                     k[:, :, s:s + 5], v[:, :, s:s + 5], mask[..., s:s + 5], dout, lse, delta)
              for s in (0, 5)]
    torch.testing.assert_close(halves[0][0] + halves[1][0], whole[0])
    torch.testing.assert_close(torch.cat([halves[0][1], halves[1][1]], dim=2), whole[1])
    torch.testing.assert_close(torch.cat([halves[0][2], halves[1][2]], dim=2), whole[2])


def test_merge_into_a_wholly_hidden_block_changes_nothing_and_leaves_it_untouched():
    """block_forward of keys after every query returns out 0 (a stride-0 tensor) and lse -inf; merging it
    used to write into it and crash."""
    q, k, v = (x.detach() for x in _qkv(t=4, s=4))
    out_b, lse_b = chunked.block_forward(chunked.block_plan(q, 4, causal=True, scale=8**-0.5, offset=-4),
                                         q, k, v, None)
    out, lse = chunked.block_forward(chunked.block_plan(q, 4, causal=True, scale=8**-0.5, offset=0), q, k, v, None)
    expected = out.clone(), lse.clone()
    chunked.merge_into(out, lse, out_b, lse_b)
    torch.testing.assert_close((out, lse), expected)
    torch.testing.assert_close(out_b, torch.zeros_like(out))


def test_chunked_backward_of_an_empty_batch():
    q, k, v = (torch.randn(0, 4, 6, 8, requires_grad=True) for _ in range(3))
    attention(q, k, v, causal=True, backend="chunked").sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad.shape == k.shape


def test_merge_into_refuses_mismatched_shapes_and_leaves_out_as_it_was():
    out, lse = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match=r"got out \(1, 2, 4, 8\), lse \(1, 2, 4\), out_b \(1, 2, 3, 8\), "
                                         r"lse_b \(1, 2, 3\)"):
        chunked.merge_into(out, lse, torch.ones(1, 2, 3, 8), torch.ones(1, 2, 3))
    assert not out.any() and not lse.any()
