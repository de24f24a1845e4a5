"""torch.compile(fullgraph=True) of attnkit.attention with modifiers: one graph, eager's values and gradients.

Tiny sizes: what is tested is that the whole call traces (a graph break fails
fullgraph), not speed. Each compile takes seconds: the tests are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from attnkit import attention
from attnkit.functional import alibi, alibi_slopes, and_masks, causal, document_mask, sliding_window, softcap


def _qkv(requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(shape, generator=gen).requires_grad_(requires_grad)
                 for shape in ((1, 4, 8, 4), (1, 2, 8, 4), (1, 2, 8, 4)))


def _compiled_and_eager(fn, *inputs):
    """(compiled outputs and gradients, eager outputs and gradients) of fn(*inputs).sum()."""
    results = []
    for run in (torch.compile(fn, fullgraph=True), fn):
        out = run(*inputs)
        grads = torch.autograd.grad(out.sum(), inputs) if out.requires_grad else ()
        results.append((out, *grads))
    return results


@pytest.mark.slow
def test_math_with_a_learned_score_modifier_compiles_whole_with_gradients():
    slopes = alibi_slopes(4).requires_grad_()

    def fn(q, k, v, slopes):
        return attention(q, k, v, score_mod=alibi(slopes=slopes), mask_mod=sliding_window(3), backend="math")

    compiled, eager = _compiled_and_eager(fn, *_qkv(True), slopes)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)


_MASK = and_masks(causal(), document_mask(torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])))


@pytest.mark.slow
def test_chunked_inference_with_modifiers_compiles_whole():
    """The block loop, with the band's blocks skipped by its rule (the document ids are not read while
    compiling: their blocks are masked instead)."""
    with torch.no_grad():
        compiled, eager = _compiled_and_eager(
            lambda q, k, v: attention(q, k, v, score_mod=softcap(2.0), mask_mod=_MASK, backend="chunked"), *_qkv())
    torch.testing.assert_close(compiled, eager)


@pytest.mark.slow
def test_chunked_training_with_a_mask_modifier_and_sinks_compiles_whole():
    """The custom backward of the block kernel, sinks included."""
    sinks = torch.ones(4, requires_grad=True)
    compiled, eager = _compiled_and_eager(
        lambda q, k, v, sinks: attention(q, k, v, mask_mod=_MASK, sinks=sinks, backend="chunked"),
        *_qkv(True), sinks)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_chunked_training_with_a_learned_score_modifier_compiles_whole():
    """Dynamo traces neither the search for the tensors a modifier closes over nor the per-block autograd of
    the backward: compiled, the call takes the dense differentiable path, and the learned slopes still get
    their gradients."""
    slopes = alibi_slopes(4).requires_grad_()
    compiled, eager = _compiled_and_eager(
        lambda q, k, v, slopes: attention(q, k, v, score_mod=alibi(slopes=slopes), causal=True, backend="chunked"),
        *_qkv(True), slopes)
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want)
