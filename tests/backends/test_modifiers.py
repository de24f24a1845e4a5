"""attnkit.attention with score and mask modifiers and learned sinks, on every backend.

The reference below shares no code with attnkit's kernels: it calls each
modifier once per (b, h, query, key) with 0-d index tensors (as FlexAttention's
vmap does), spells causal / window out from their definitions, and adds a sink
as one more softmax entry.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit import attention
from attnkit.backends import BACKENDS, blockmods, choose, chunked, make_call
from attnkit.functional import (
    MaskModifier,
    alibi,
    alibi_slopes,
    and_masks,
    causal,
    document_mask,
    or_masks,
    prefix_lm,
    sink_window,
    sliding_window,
    softcap,
)
from attnkit.functional.modifiers import Alibi, Band
from tests.backends.test_memory import LargestTensor


@contextlib.contextmanager
def blocks_of(tb: int, sb: int):
    """Run the chunked kernel with Tb x Sb blocks, so that small tests cross many blocks."""
    with mock.patch.object(chunked, "_block_sizes", lambda b, h, t, s: (tb, sb)):
        yield


def reference(q, k, v, *, mask=None, key_mask=None, causal=False, window=None, score_mod=None, mask_mod=None,
              sinks=None, scale=None):
    """out (B, H, T, Dv) in float64, differentiable, one (b, h, i, j) at a time; empty rows give 0."""
    b_size, h_size, t_size, d = q.shape
    g_size, s_size = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    full = None if mask is None else mask.expand(b_size, h_size, t_size, s_size)
    rows = []
    for b in range(b_size):
        for h in range(h_size):
            g = h // (h_size // g_size)
            for i in range(t_size):
                pos = s_size - t_size + i  # the queries are the last T positions
                idx = [torch.tensor(b), torch.tensor(h), torch.tensor(pos)]
                logits, values = [], []
                for j in range(s_size):
                    s = (q[b, h, i].double() @ k[b, g, j].double()) * scale
                    if score_mod is not None:
                        s = score_mod(s, *idx, torch.tensor(j))
                    seen = (not causal or j <= pos) and (window is None or j > pos - window)
                    seen = seen and (key_mask is None or bool(key_mask[b, j]))
                    seen = seen and (mask_mod is None or bool(mask_mod(*idx, torch.tensor(j))))
                    if full is not None and full.dtype == torch.bool:
                        seen = seen and bool(full[b, h, i, j])
                    elif full is not None:
                        s = s + full[b, h, i, j].double()
                    if seen and s > -torch.inf:
                        logits.append(s)
                        values.append(v[b, g, j].double())
                if sinks is not None:
                    logits.append(sinks[h].double())
                    values.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                if logits:
                    rows.append(torch.softmax(torch.stack(logits), 0) @ torch.stack(values))
                else:
                    rows.append(v[b, g, 0].double() * 0)  # zero, still in the graph
    return torch.stack(rows).reshape(b_size, h_size, t_size, v.shape[-1])


# ----------------------------------------------------------------------------- random compositions


def _sorted_ids(draw, gen, b, s):
    cuts = torch.rand(b, s, generator=gen) < 0.3
    ids = cuts.long().cumsum(-1)  # sorted, runs of equal ids
    return ids if draw(st.booleans()) else ids[0]


@st.composite
def mask_mods(draw, gen, b, h, t, s, depth=0):
    kinds = ["causal", "window", "document", "unsorted", "prefix", "prefix_b", "sinks", "table"]
    if depth == 0:
        kinds += ["and", "or"]
    kind = draw(st.sampled_from(kinds))
    if kind == "causal":
        return causal()
    if kind == "window":
        return sliding_window(draw(st.integers(1, 4)))
    if kind == "document" and t <= s:
        return document_mask(_sorted_ids(draw, gen, b, s), draw(st.sampled_from([None, prefix_lm(2)])))
    if kind == "unsorted" and t <= s:
        return document_mask(torch.randint(0, 3, (b, s), generator=gen))
    if kind == "prefix":
        return prefix_lm(draw(st.integers(0, 4)))
    if kind == "prefix_b":
        return prefix_lm(torch.randint(0, 4, (b,), generator=gen))
    if kind == "sinks":
        return sink_window(draw(st.integers(1, 2)), draw(st.integers(1, 3)))
    if kind in ("and", "or"):
        parts = [draw(mask_mods(gen, b, h, t, s, depth=1)) for _ in range(2)]
        return (and_masks if kind == "and" else or_masks)(*parts)
    table = torch.rand(b, h, t + s, s, generator=gen) > 0.3  # a plain function: no block rule

    def from_table(bi, hi, q_idx, kv_idx):
        return table[bi, hi, q_idx + t, kv_idx]  # queries sit at S - T .. S - 1, negative when T > S
    return from_table


@st.composite
def score_mods(draw, gen, h):
    """A score modifier and the tensors it closes over that require grad."""
    kind = draw(st.sampled_from(["alibi", "learned_alibi", "softcap", "learned_softcap", "both", "user"]))
    if kind == "alibi":
        return alibi(h), []
    if kind == "learned_alibi":
        slopes = torch.rand(h, generator=gen, dtype=torch.float64).requires_grad_()
        return alibi(slopes=slopes), [slopes]
    if kind == "softcap":
        return softcap(draw(st.sampled_from([0.5, 2.0]))), []
    if kind == "learned_softcap":
        cap = (torch.rand(h, generator=gen, dtype=torch.float64) + 0.5).requires_grad_()
        return softcap(cap), [cap]
    if kind == "both":
        slopes = torch.rand(h, generator=gen, dtype=torch.float64).requires_grad_()
        inner, outer = alibi(slopes=slopes), softcap(1.5)
        return (lambda s, b, hh, qi, ki: outer(inner(s, b, hh, qi, ki), b, hh, qi, ki)), [slopes]
    bias = torch.randn(h, generator=gen, dtype=torch.float64).requires_grad_()  # a closure over a leaf

    def user(score, b, hh, q_idx, kv_idx):
        return score * 0.5 + bias[hh] * (q_idx - kv_idx).abs()
    return user, [bias]


@st.composite
def calls(draw):
    b, g, r = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    h = g * r
    t, s = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    q, k, v = (torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
               for shape in ((b, h, t, 3), (b, g, s, 3), (b, g, s, 2)))
    kwargs = dict(q=q, k=k, v=v)
    captured = []
    if draw(st.booleans()):
        kwargs["score_mod"], captured = draw(score_mods(gen, h))
    if draw(st.booleans()):
        kwargs["mask_mod"] = draw(mask_mods(gen, b, h, t, s))
    if draw(st.booleans()):
        kwargs["causal"] = True
        kwargs["window"] = draw(st.sampled_from([None, 2]))
    if draw(st.booleans()):
        key_mask = torch.rand(b, s, generator=gen) > 0.3
        key_mask[0] = draw(st.booleans()) and key_mask[0]  # sometimes a whole sequence of padding
        kwargs["key_mask"] = key_mask
    if draw(st.booleans()):
        additive = torch.randn(b, 1, t, s, generator=gen, dtype=torch.float64)
        kwargs["mask"] = additive.masked_fill(torch.rand(b, 1, t, s, generator=gen) > 0.7, -torch.inf)
    if draw(st.booleans()):
        kwargs["sinks"] = torch.randn(h, generator=gen, dtype=torch.float64).requires_grad_()
        captured.append(kwargs["sinks"])
    return kwargs, captured


def _variants(call_kwargs):
    """(name, context, backend) of every way to run this call; sdpa only where it can serve it."""
    call = make_call(**call_kwargs)
    out = [("math", contextlib.nullcontext(), "math"), ("chunked", contextlib.nullcontext(), "chunked"),
           ("chunked 2x3", blocks_of(2, 3), "chunked"), ("auto", contextlib.nullcontext(), "auto")]
    if BACKENDS["sdpa"].why_not(call) is None:
        out.append(("sdpa", contextlib.nullcontext(), "sdpa"))
    return out


@given(case=calls())
@settings(max_examples=60, deadline=None)
def test_every_backend_equals_the_reference_with_modifiers(case):
    """Random compositions of score and mask modifiers with causal, window, key masks, GQA, sinks and rows
    that see nothing: outputs and the gradients of q, k, v, sinks and every learned tensor equal the reference."""
    kwargs, captured = case
    inputs = [kwargs["q"], kwargs["k"], kwargs["v"], *captured]
    expected = reference(**kwargs)
    dout = torch.randn_like(expected)
    want = torch.autograd.grad(expected, inputs, dout, allow_unused=True, materialize_grads=True)
    for name, context, backend in _variants(kwargs):
        with context:
            out = attention(**kwargs, backend=backend)
            got = torch.autograd.grad(out, inputs, dout, allow_unused=True, materialize_grads=True)
        torch.testing.assert_close(out, expected, msg=lambda m, n=name: f"{n}: {m}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert torch.isfinite(g).all(), f"{name}: gradient {i} is not finite"
            torch.testing.assert_close(g, w, msg=lambda m, n=name, i=i: f"{n}, gradient {i}: {m}")


# ----------------------------------------------------------------------------- block skipping


class _Spy:
    """Counts the calls of a modifier and records the shapes of the index tensors it got."""

    def __init__(self, fn):
        self.fn, self.shapes = fn, []

    def __call__(self, *args):
        self.shapes.append(tuple(args[-2].shape[-2:]) + tuple(args[-1].shape[-1:]))
        return self.fn(*args)


def _ids(t: int, docs: int) -> torch.Tensor:
    return torch.arange(t) // (t // docs)


def _visible_blocks(dense: torch.Tensor, tb: int, sb: int) -> int:
    """How many (tb x sb) blocks of a dense (T, S) mask have something visible."""
    t, s = dense.shape
    return sum(bool(dense[i:i + tb, j:j + sb].any()) for i in range(0, t, tb) for j in range(0, s, sb))


def test_a_built_in_mask_skips_hidden_blocks_and_evaluates_only_partial_ones():
    """16 blocks of 8 x 8, two documents of 16, causal: the block rule alone finds the 10 hidden blocks (above
    the diagonal or between documents) and the 2 wholly visible ones; the mask is evaluated on the 4 diagonal
    blocks only, and the score modifier runs on the 6 blocks with something visible."""
    q = k = v = torch.randn(1, 2, 32, 4, dtype=torch.float64)
    mask = and_masks(causal(), document_mask(_ids(32, 2)))
    score = _Spy(lambda s, *idx: s * 0.5)
    with blocks_of(8, 8), torch.no_grad(), mock.patch.object(
            blockmods, "apply_mask_mod", wraps=blockmods.apply_mask_mod) as evaluated:
        out = attention(q, k, v, mask_mod=mask, score_mod=score, backend="chunked")
    assert evaluated.call_count == 4
    dense = (torch.arange(32)[None] <= torch.arange(32)[:, None]) & (_ids(32, 2)[:, None] == _ids(32, 2)[None])
    assert len(score.shapes) == _visible_blocks(dense, 8, 8) == 6
    expected = reference(q[:, :, :8], k[:, :, :8], v[:, :, :8], causal=True, score_mod=lambda s, *i: s * 0.5)
    torch.testing.assert_close(out[:, :, :8], expected)


def test_a_plain_mask_function_is_evaluated_per_block_and_its_hidden_blocks_are_skipped():
    """A FlexAttention-style function has no rule: it is evaluated on (Tb, Sb) blocks, never on (T, S), and the
    score modifier runs only where the block has something visible."""
    ids = _ids(24, 3)
    mask = _Spy(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])
    score = _Spy(lambda s, *idx: s + 1.0)
    q = k = v = torch.randn(1, 1, 24, 4, dtype=torch.float64)
    with blocks_of(8, 4), torch.no_grad():
        out = attention(q, k, v, mask_mod=mask, score_mod=score, backend="chunked")
    assert set(mask.shapes) == {(8, 1, 4)} and len(mask.shapes) == 3 * 6  # every block, one at a time
    assert len(score.shapes) == _visible_blocks(ids[:, None] == ids[None], 8, 4) == 6
    torch.testing.assert_close(out, reference(q, k, v, mask_mod=mask.fn, score_mod=score.fn))




def test_chunked_with_modifiers_never_holds_t_by_s():
    """Forward and backward with a score modifier, a plain mask function and sinks: no (T, S) tensor."""
    t = 1024
    q, k, v = (torch.randn(1, 1, t, 8, requires_grad=True) for _ in range(3))
    sinks = torch.zeros(1, requires_grad=True)
    with LargestTensor() as mode:
        out = attention(q, k, v, score_mod=softcap(5.0), mask_mod=lambda b, h, qi, ki: ki <= qi, sinks=sinks,
                        backend="chunked")
        out.sum().backward()
    assert mode.largest < t * t // 2


# ----------------------------------------------------------------------------- learned tensors and sinks


def test_tensors_a_score_modifier_closes_over_get_gradients_through_chunked():
    """Learned slopes reached through a non-leaf (softplus of a parameter), a module's parameter and a global:
    each gets math's gradient from chunked, which has to find them to return it."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    raw = torch.randn(4, dtype=torch.float64, requires_grad=True)
    slopes = torch.nn.functional.softplus(raw)  # not a leaf: the gradient must pass through it
    temperature = torch.nn.Linear(1, 1, bias=False, dtype=torch.float64)

    def score_mod(score, b, h, q_idx, kv_idx):
        scaled = temperature(score.unsqueeze(-1)).squeeze(-1)  # (B, H, T, S, 1) -> (B, H, T, S)
        return scaled + slopes[h] * (kv_idx - q_idx) + _GLOBAL_BIAS[h] * (kv_idx - q_idx) ** 2

    inputs = (q, k, v, raw, temperature.weight, _GLOBAL_BIAS)
    grads = {}
    for backend in ("math", "chunked"):
        with blocks_of(2, 2):
            out = attention(q, k, v, score_mod=score_mod, causal=True, backend=backend)
        grads[backend] = torch.autograd.grad(out.pow(2).sum(), inputs, retain_graph=True)
    for got, want in zip(grads["chunked"], grads["math"], strict=True):
        assert want.abs().sum() > 0
        torch.testing.assert_close(got, want)


_GLOBAL_BIAS = torch.randn(4, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("backend", ["math", "sdpa", "chunked"])
def test_sinks_on_rows_that_see_nothing_give_zero_and_finite_gradients(backend):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 4, 3, requires_grad=True) for _ in range(3))
    sinks = torch.randn(2, requires_grad=True)
    key_mask = torch.tensor([[True, True, False, True], [False] * 4])  # sequence 1 is all padding
    out = attention(q, k, v, key_mask=key_mask, causal=True, sinks=sinks, backend=backend)
    torch.testing.assert_close(out[1], torch.zeros(2, 4, 3))
    out.pow(2).sum().backward()
    for t in (q, k, v, sinks):
        assert torch.isfinite(t.grad).all()
    expected = reference(q, k, v, key_mask=key_mask, causal=True, sinks=sinks)
    torch.testing.assert_close(out, expected.float())


def test_sinks_take_weight_from_every_key_as_gpt_oss_does():
    """weights = softmax([scores, sink])[:-1], gpt-oss's formula: each row sums to less than 1."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    sinks = torch.tensor([0.0, 3.0])
    _, weights = attention(q, k, v, sinks=sinks, return_weights=True)
    scores = q @ k.transpose(-2, -1) / 2.0
    with_sink = torch.cat([scores, sinks.view(1, 2, 1, 1).expand(1, 2, 3, 1)], dim=-1)
    torch.testing.assert_close(weights, torch.softmax(with_sink, dim=-1)[..., :-1])
    assert (weights.sum(-1) < 1).all()


_LEARNED = {  # each call with a learned (2,) tensor in it
    "learned softcap": lambda learned: dict(score_mod=softcap(learned.abs() + 0.5)),
    "learned alibi, causal": lambda learned: dict(score_mod=alibi(slopes=learned), causal=True),
    "window and sinks": lambda learned: dict(mask_mod=sliding_window(2), sinks=learned),
}


@pytest.mark.parametrize("name", list(_LEARNED))
def test_gradcheck_through_chunked_with_modifiers(name):
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    learned = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    with blocks_of(2, 3):
        assert torch.autograd.gradcheck(
            lambda q, k, v, learned: attention(q, k, v, backend="chunked", **_LEARNED[name](learned)),
            (q, k, v, learned))


def test_double_backward_through_chunked_with_a_score_modifier_equals_math():
    torch.manual_seed(0)
    slopes = alibi_slopes(2).double().requires_grad_()
    results = {}
    for backend in ("math", "chunked"):
        q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                   .requires_grad_() for i in range(3))
        out = attention(q, k, v, score_mod=alibi(slopes=slopes), causal=True, backend=backend)
        (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        results[backend] = torch.autograd.grad(gq.pow(2).sum(), (q, k, v, slopes))
    for got, want in zip(results["chunked"], results["math"], strict=True):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- routing


def _pick(t: int, s: int, **kwargs) -> str:
    q, k = torch.zeros(1, 2, t, 4), torch.zeros(1, 2, s, 4)
    return choose("auto", make_call(q, k, k, **kwargs), return_weights=False).name


def test_auto_routes_modified_calls():
    assert _pick(64, 64, mask_mod=sliding_window(8)) == "sdpa"  # a small dense mask
    assert _pick(64, 64, score_mod=alibi(2), causal=True) == "sdpa"  # an additive bias is a float mask
    assert _pick(64, 64, sinks=torch.zeros(2)) == "sdpa"  # one more key
    assert _pick(64, 64, score_mod=softcap(5.0)) == "chunked"  # not a bias: SDPA cannot take it
    assert _pick(4096, 4096, mask_mod=document_mask(_ids(4096, 8))) == "chunked"  # above DENSE_BAND_LIMIT
    assert _pick(64, 64, score_mod=softcap(5.0), dropout_p=0.1) == "math"  # chunked has no dropout


def test_math_returns_the_modified_weights():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2), torch.randn(1, 1, 4, 2)
    _, weights = attention(q, k, v, mask_mod=sliding_window(2), score_mod=softcap(0.1), return_weights=True)
    band = torch.ones(4, 4, dtype=torch.bool).tril() & ~torch.ones(4, 4, dtype=torch.bool).tril(-2)
    assert torch.equal(weights[0, 0] > 0, band)
    scores = torch.tanh((q @ k.transpose(-2, -1)) / 2**0.5 / 0.1) * 0.1  # capped: nearly uniform weights
    expected = torch.softmax(scores.masked_fill(~band, -torch.inf), dim=-1)
    torch.testing.assert_close(weights, expected)


# ----------------------------------------------------------------------------- bad modifiers


def _qkv():
    return torch.randn(2, 2, 3, 4), torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(score_mod=3), TypeError, r"score_mod must be a callable \(score, b, h, q_idx, kv_idx\) -> score, as "
                                   r"FlexAttention's, or None; got int"),
    (dict(mask_mod="causal"), TypeError, r"mask_mod must be a callable \(b, h, q_idx, kv_idx\) -> bool"),
    (dict(score_mod=lambda s, b: s), TypeError, r"score_mod .*<lambda> must take 5 positional arguments \(score, "
                                                r"b, h, q_idx, kv_idx\), .* its signature is \(s, b\)"),
    (dict(mask_mod=lambda s, b, h, q, kv: q > kv), TypeError, r"mask_mod .* must take 4 positional arguments"),
    (dict(mask_mod=prefix_lm(torch.tensor([1, 2, 3]))), ValueError,
     r"prefix_length has 3 lengths \(one per sequence\) but the batch has B=2"),
    (dict(score_mod=alibi(4)), ValueError, r"alibi\(4 heads\) has 4 slopes \(one per head\) but q has H=2 heads"),
    (dict(mask_mod=document_mask(torch.zeros(4, dtype=torch.long))), ValueError,
     r"doc_ids must label positions 0 \.\. 4 of each sequence, as \(S,\) = \(5,\) or \(B, S\) = \(2, 5\); "
     r"got shape \(4,\)"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be a floating-point \(H,\) = \(2,\) tensor, one logit "
                                             r"per query head; got torch.float32 \(3,\)"),
    (dict(sinks=torch.zeros(2, dtype=torch.long)), ValueError, r"sinks must be a floating-point"),
])
def test_bad_modifiers_are_refused_before_anything_runs(kwargs, error, message):
    with pytest.raises(error, match=message):
        attention(*_qkv(), **kwargs)


@pytest.mark.parametrize("backend", ["math", "chunked", "sdpa"])
@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx).float()), TypeError,
     r"mask_mod .*<lambda> returned a torch.float32 tensor; expected a bool tensor \(True = may attend\)"),
    (dict(mask_mod=lambda b, h, q_idx, kv_idx: True), TypeError, r"mask_mod .* returned bool True; expected a bool "
                                                                 r"tensor"),
    (dict(mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx)[None]), ValueError,
     r"mask_mod .* returned shape \(1, 1, 1, 3, 5\); expected a bool tensor that broadcasts to \(B, H, T, S\)"),
    (dict(mask_mod=and_masks(causal(), lambda b, h, q_idx, kv_idx: q_idx - kv_idx)), TypeError,
     r"mask_mod .*<lambda> returned a torch.int64 tensor"),
])
def test_a_mask_modifier_that_returns_the_wrong_thing_is_named(backend, kwargs, error, message):
    with pytest.raises(error, match=message):
        attention(*_qkv(), **kwargs, backend=backend)


@pytest.mark.parametrize("backend", ["math", "chunked"])
@pytest.mark.parametrize(("score_mod", "error", "message"), [
    (lambda s, b, h, q_idx, kv_idx: s > 0, TypeError,  # the call's scores, not chunked's (B, H, 1, 1) probe
     r"score_mod .*<lambda> returned a torch.bool tensor; expected a floating-point tensor of the scores' shape "
     r"\(2, 2, 3, 5\)$"),
    (lambda s, b, h, q_idx, kv_idx: s.sum(-1), ValueError,  # chunked finds it on the probe, and says so
     r"score_mod .* returned shape \((2, 2, 3\); expected the scores' shape \(2, 2, 3, 5\) \(B, H, T, S\)|2, 2, 1\) "
     r"on a block \(2, 2, 1, 1\) of the scores \(B, H, T, S\) = \(2, 2, 3, 5\); expected the block's shape): "
     r"a score modifier must not change it"),
    (lambda s, b, h, q_idx, kv_idx: s[None], ValueError, r"returned shape \(1, 2, 2, [13], [15]\)"),
    (lambda s, b, h, q_idx, kv_idx: 1.0, TypeError, r"score_mod .* returned float; expected a floating-point"),
])
def test_a_score_modifier_that_returns_the_wrong_thing_is_named(backend, score_mod, error, message):
    with pytest.raises(error, match=message):
        attention(*_qkv(), score_mod=score_mod, backend=backend)
    with pytest.raises(error, match=message), torch.no_grad():  # no probe: the first block finds it
        attention(*_qkv(), score_mod=score_mod, backend=backend)


def test_sdpa_refuses_a_score_modifier_that_is_not_a_bias():
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot serve this call: it applies a score_mod only as "
                                         r"an additive bias .* softcap\(1.0\) is not one; use 'chunked' or 'math'"):
        attention(*_qkv(), score_mod=softcap(1.0), backend="sdpa")


def _exploding_mod(score, b, h, q_idx, kv_idx):
    return score / 0 if q_idx.numel() > 100 else {}["no such key"]


@pytest.mark.parametrize("backend", ["math", "chunked"])
def test_a_modifier_that_raises_is_reported_with_its_own_traceback(backend):
    q, k, v = _qkv()
    with pytest.raises(KeyError, match="no such key") as info:
        attention(q.requires_grad_(), k, v, score_mod=_exploding_mod, backend=backend)
    assert info.traceback[-1].name == "_exploding_mod"


def test_a_score_modifier_may_return_a_bias_that_broadcasts_to_the_scores():
    """FlexAttention allows a score_mod that ignores the score; its result broadcasts to the block."""
    q, k, v = _qkv()

    def distance_only(score, b, h, q_idx, kv_idx):
        return -(q_idx - kv_idx).abs().double()
    expected = reference(q, k, v, score_mod=distance_only).float()
    for backend in ("math", "chunked"):
        torch.testing.assert_close(attention(q, k, v, score_mod=distance_only, backend=backend), expected)


def test_a_mask_modifier_subclass_without_a_rule_is_evaluated_per_block():
    """A MaskModifier whose block_rule is None is evaluated on each block, like a plain function."""

    class EvenKeys(MaskModifier):
        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx % 2 == 0

    q, k, v = _qkv()
    with blocks_of(2, 2):
        out = attention(q, k, v, mask_mod=EvenKeys(), backend="chunked")
    torch.testing.assert_close(out, reference(q, k, v, mask_mod=EvenKeys()).float())


class _CausalAndLastKey(Band):
    """causal(), and every query sees key 4 too: Band's rule (nothing above the diagonal) does not say so."""

    def __call__(self, b, h, q_idx, kv_idx):
        return super().__call__(b, h, q_idx, kv_idx) | (kv_idx == 4)


@pytest.mark.parametrize("combined", [False, True])
def test_a_mask_subclass_that_overrides_call_alone_has_no_inherited_rule(combined):
    """Chunked must not skip key 4 (above the diagonal for queries 2 and 3) on the word of Band's rule, which
    describes Band's call, not the subclass's; alone and inside and_masks (whose rule combines its members')."""
    mask = _CausalAndLastKey()
    if combined:
        mask = and_masks(mask, document_mask(torch.zeros(5, dtype=torch.long)))
    q, k, v = _qkv()
    expected = reference(q, k, v, mask_mod=mask).float()
    with blocks_of(2, 2):
        torch.testing.assert_close(attention(q, k, v, mask_mod=mask, backend="chunked"), expected)


@pytest.mark.parametrize("grad", [True, False])
def test_errors_of_modifiers_name_the_calls_scores_not_a_block_or_probe(grad):
    """Chunked runs modifiers on (Tb, Sb) blocks and, to find the tensors a score modifier closes over, on a
    (B, H, 1, 1) probe; their errors still name the scores (B, H, T, S) = (2, 2, 3, 5) of the call."""
    with blocks_of(2, 2), torch.set_grad_enabled(grad):
        with pytest.raises(TypeError, match=r"returned a torch.bool tensor; expected a floating-point tensor of the "
                                            r"scores' shape \(2, 2, 3, 5\)$"):
            attention(*_qkv(), score_mod=lambda s, b, h, q_idx, kv_idx: s > 0, backend="chunked")
        with pytest.raises(ValueError, match=r"returned shape \(1, 1, 2, 2, 1\); expected a bool tensor that "
                                             r"broadcasts to its block \(2, 2, 2, 2\) of \(B, H, T, S\) = "
                                             r"\(2, 2, 3, 5\)$"):
            attention(*_qkv(), mask_mod=lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx)[..., None], backend="chunked")


def test_a_built_in_score_modifier_is_not_run_on_a_probe():
    """alibi and softcap name the tensors they read, so chunked needs no probe (B, H, 1, 1) to find which need
    gradients: with nothing requiring grad it runs them on the blocks alone; learned slopes still get math's
    gradient when q, k and v need none."""
    q, k, v = _qkv()
    seen = []
    original = Alibi.__call__
    with mock.patch.object(Alibi, "__call__", lambda self, s, *idx: seen.append(s.shape) or original(self, s, *idx)):
        attention(q, k, v, score_mod=alibi(2), backend="chunked")
        assert (2, 2, 1, 1) not in seen
        slopes = alibi_slopes(2).requires_grad_()
        grads = [torch.autograd.grad(attention(q, k, v, score_mod=alibi(slopes=slopes), backend=backend).pow(2).sum(),
                                     slopes) for backend in ("math", "chunked")]
    assert grads[0][0].abs().sum() > 0
    torch.testing.assert_close(*grads)


def test_a_score_subclass_that_overrides_call_alone_is_probed_for_what_it_reads():
    """alibi's list of the tensors it reads does not describe a subclass's own call (here, one more learned
    tensor): chunked runs it on a probe instead, and the temperature gets math's gradient."""
    temperature = torch.tensor(0.7, requires_grad=True)

    class Tempered(Alibi):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return super().__call__(score, b, h, q_idx, kv_idx) / temperature

    mod, (q, k, v) = Tempered(alibi_slopes(2)), _qkv()
    grads = [torch.autograd.grad(attention(q, k, v, score_mod=mod, backend=backend).pow(2).sum(), temperature)
             for backend in ("math", "chunked")]
    assert grads[0][0] != 0
    torch.testing.assert_close(*grads)


def test_a_document_mask_refuses_queries_before_position_zero():
    """More queries than keys put the first queries at negative positions, which would index doc_ids from
    its end."""
    q, k = torch.randn(1, 1, 4, 2), torch.randn(1, 1, 3, 2)
    with pytest.raises(ValueError, match=r"the queries start at position -1 \(more queries than keys\)"):
        attention(q, k, k, mask_mod=document_mask(torch.zeros(3, dtype=torch.long)))


@pytest.mark.parametrize("backend", ["math", "chunked"])
def test_a_score_modifier_may_hide_keys_with_minus_infinity(backend):
    """-inf from a score modifier hides a key as a mask does (FlexAttention allows it); a row it hides wholly
    gets 0 and finite gradients, not the NaN of a softmax over nothing."""
    q, k, v = (x.requires_grad_() for x in _qkv())

    def hide(score, b, h, q_idx, kv_idx):
        return torch.where((kv_idx > q_idx) | (q_idx == 3), -torch.inf, score)  # query 3 (row 1) sees nothing
    with blocks_of(2, 2):
        out = attention(q, k, v, score_mod=hide, backend=backend)
    torch.testing.assert_close(out, reference(q, k, v, causal=True, mask_mod=lambda b, h, qi, ki: qi != 3).float())
    assert (out[:, :, 1] == 0).all()
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
