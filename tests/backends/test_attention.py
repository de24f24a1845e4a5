"""attnkit.attention: every backend equals the reference, on whole tensors and gradients."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import attention
from attnkit.backends import BACKENDS, chunked
from tests._reference import reference_attention

BACKEND_NAMES = ["math", "sdpa", "chunked"]


@contextlib.contextmanager
def backend_variant(name):
    """'chunked-tiny' runs the chunked kernel with 2 x 3 blocks, so that small
    tests cross many query and key blocks (the online-softmax rescaling,
    skipped and partial blocks)."""
    if name != "chunked-tiny":
        yield name
        return
    with mock.patch.object(chunked, "_block_sizes", lambda b, h, t, s: (2, 3)):
        yield "chunked"


VARIANTS = [*BACKEND_NAMES, "chunked-tiny"]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-4), torch.float64: dict(atol=1e-10, rtol=1e-9)}


@st.composite
def attention_inputs(draw):
    """Small random shapes, masks (some rows fully masked), causal, windows, dtypes."""
    b, g, r = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    t, s = draw(st.integers(1, 7)), draw(st.integers(1, 9))
    d = draw(st.sampled_from([1, 2, 4, 8]))
    dv = draw(st.sampled_from([d, d + 3]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    h = g * r
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for shape in ((b, h, t, d), (b, g, s, d), (b, g, s, dv)))
    kind = draw(st.sampled_from(["none", "keys", "full", "float"]))
    mask = None
    if kind == "keys":
        mask = torch.rand(b, 1, 1, s, generator=gen) > 0.3
        if draw(st.booleans()):
            mask[0] = False  # a whole sequence of padding: every query of it sees nothing
    elif kind == "full":
        mask = torch.rand(b, h, t, s, generator=gen) > 0.4
    elif kind == "float":
        mask = torch.randn(b, 1, t, s, generator=gen, dtype=dtype)
        mask[torch.rand(b, 1, t, s, generator=gen) > 0.6] = -torch.inf
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 5))) if causal else None
    return dict(q=q, k=k, v=v, mask=mask, causal=causal, window=window)


@given(inputs=attention_inputs())
@settings(max_examples=60, deadline=None)
def test_every_backend_equals_the_reference(inputs):
    expected, expected_weights = reference_attention(**inputs)
    tol = TOL[inputs["q"].dtype]
    for variant in VARIANTS:
        with backend_variant(variant) as name:
            out = attention(**inputs, backend=name)
        assert out.dtype == inputs["q"].dtype and out.shape == expected.shape
        torch.testing.assert_close(out.double(), expected, **tol, msg=lambda m, n=variant: f"{n}: {m}")
    _, weights = attention(**inputs, return_weights=True)
    torch.testing.assert_close(weights.double(), expected_weights, **tol)


@given(inputs=attention_inputs())
@settings(max_examples=30, deadline=None)
def test_every_backend_has_the_gradients_of_math(inputs):
    inputs = {n: (t.double().requires_grad_() if n in "qkv" else t) for n, t in inputs.items()}
    if inputs["mask"] is not None and inputs["mask"].is_floating_point():
        inputs["mask"] = inputs["mask"].double()
    grad_out = torch.randn(*inputs["q"].shape[:3], inputs["v"].shape[-1], dtype=torch.float64)
    grads = {}
    for variant in VARIANTS:
        with backend_variant(variant) as name:
            out = attention(**inputs, backend=name)
            grads[variant] = torch.autograd.grad(out, [inputs[n] for n in "qkv"], grad_out)
    for name in ("sdpa", "chunked", "chunked-tiny"):
        for which, got, want in zip("qkv", grads[name], grads["math"], strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-8, msg=lambda m, n=name, w=which: f"{n} d{w}: {m}")


@pytest.mark.parametrize("variant", VARIANTS)
def test_gradcheck(variant):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 2, dtype=torch.float64, requires_grad=True)
    keys = torch.tensor([[True] * 6, [True, True, False, True, False, False]]).view(2, 1, 1, 6)
    for kwargs in (dict(), dict(causal=True), dict(mask=keys, causal=True, window=2)):
        with backend_variant(variant) as backend:
            assert torch.autograd.gradcheck(
                lambda q, k, v, kw=kwargs, be=backend: attention(q, k, v, backend=be, **kw), (q, k, v))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_query_with_no_visible_key_gets_zeros_and_finite_gradients(backend):
    """softmax over an all -inf row is NaN: the commonest complaint about SDPA and nn.MultiheadAttention."""
    torch.manual_seed(0)
    q = torch.randn(2, 2, 4, 8, requires_grad=True)
    k = torch.randn(2, 2, 4, 8, requires_grad=True)
    v = torch.randn(2, 2, 4, 8, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1] = False  # sequence 1 is all padding
    mask[0, :, 2] = False  # query 2 of sequence 0 sees nothing
    out = attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(out[1], torch.zeros(2, 4, 8))
    torch.testing.assert_close(out[0, :, 2], torch.zeros(2, 8))
    assert out[0, :, [0, 1, 3]].abs().sum() > 0
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    torch.testing.assert_close(q.grad[1], torch.zeros(2, 4, 8))
    float_mask = torch.zeros(2, 1, 4, 4).masked_fill(~mask, -torch.inf)
    torch.testing.assert_close(attention(q, k, v, mask=float_mask, backend=backend), out)


def test_weights_of_an_empty_row_are_zero():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    mask = torch.tensor([[True, False, True], [False, False, False]])
    _, weights = attention(q, k, v, mask=mask, return_weights=True)
    torch.testing.assert_close(weights[0, 0, 1], torch.zeros(3))
    torch.testing.assert_close(weights[0, 0, 0].sum(), torch.tensor(1.0))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_causal_is_aligned_bottom_right(backend):
    """3 queries that are the last 3 of 7 positions: query i sees keys 0 .. 4 + i."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4)
    _, weights = attention(q, k, v, causal=True, return_weights=True)
    visible = weights[0, 0] > 0
    assert torch.equal(visible, torch.ones(3, 7, dtype=torch.bool).tril(4))
    out = attention(q, k, v, causal=True, backend=backend)
    torch.testing.assert_close(out, reference_attention(q, k, v, causal=True)[0].float())
    top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (top_left - out).abs().amax() > 1e-3  # SDPA's own is_causal would be wrong here


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_grouped_query_head_order(backend):
    """Query head h reads key/value head h // (H // G): heads 0, 1 -> 0 and 2, 3 -> 1 (not h % G)."""
    q = torch.zeros(1, 4, 3, 2)  # uniform weights: each output is the mean of its values
    k = torch.randn(1, 2, 5, 2)
    v = torch.stack([torch.full((5, 2), 10.0), torch.full((5, 2), 20.0)]).unsqueeze(0)  # (1, G=2, 5, 2)
    out = attention(q, k, v, backend=backend)
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor([10.0, 10.0, 20.0, 20.0]))


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_sliding_window_sees_the_w_most_recent_keys(backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4), torch.randn(1, 1, 6, 4)
    _, weights = attention(q, k, v, causal=True, window=2, return_weights=True)
    band = torch.ones(6, 6, dtype=torch.bool).tril() & ~torch.ones(6, 6, dtype=torch.bool).tril(-2)
    assert torch.equal(weights[0, 0] > 0, band)
    torch.testing.assert_close(attention(q, k, v, causal=True, window=2, backend=backend),
                               reference_attention(q, k, v, causal=True, window=2)[0].float())


def test_dropout_is_seeded_unbiased_and_refused_by_chunked():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    plain = attention(q, k, v)
    for backend in ("math", "sdpa"):
        torch.manual_seed(1)
        first = attention(q, k, v, dropout_p=0.5, backend=backend)
        torch.manual_seed(1)
        torch.testing.assert_close(attention(q, k, v, dropout_p=0.5, backend=backend), first)
        assert (first - plain).abs().amax() > 1e-3
        # 4000 independent draws in one call: the batch axis carries them (each row its own dropout mask)
        draws = attention(*(x.expand(4000, -1, -1, -1) for x in (q, k, v)), dropout_p=0.5, backend=backend)
        assert len({tuple(d.flatten().tolist()) for d in draws[:50]}) == 50  # the rows really differ
        torch.testing.assert_close(draws.mean(0, keepdim=True), plain, atol=0.06, rtol=0)  # inverted dropout
    with pytest.raises(ValueError, match=r"backend 'chunked' cannot serve this call: it has no dropout"):
        attention(q, k, v, dropout_p=0.1, backend="chunked")


def test_scale_and_additive_float_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 2, 3, 4), torch.randn(2, 2, 4, 4), torch.randn(2, 2, 4, 4)
    additive = torch.randn(1, 2, 3, 4)
    expected = reference_attention(q, k, v, mask=additive, scale=0.3)[0].float()
    for backend in BACKEND_NAMES:
        torch.testing.assert_close(attention(q, k, v, mask=additive, scale=0.3, backend=backend), expected)


def test_auto_picks_sdpa_and_math_for_weights():
    from attnkit.backends import choose, make_call

    call = make_call(torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), causal=True)
    assert choose("auto", call, return_weights=False) is BACKENDS["sdpa"]
    assert choose("auto", call, return_weights=True) is BACKENDS["math"]


def test_auto_avoids_a_dense_band_for_long_windows_and_partial_causal():
    from attnkit.backends import choose, make_call

    def pick(t, s, **kw):
        call = make_call(torch.randn(1, 1, t, 4), torch.randn(1, 1, s, 4), torch.randn(1, 1, s, 4), **kw)
        return choose("auto", call, return_weights=False).name

    assert pick(4096, 4096, causal=True, window=256) == "chunked"
    assert pick(2048, 4096, causal=True) == "chunked"  # a long prefill after cached positions
    assert pick(4096, 4096, causal=True) == "sdpa"  # is_causal serves it, no band needed
    assert pick(1, 8192, causal=True, window=256) == "sdpa"  # one decoding query: a tiny band
    assert pick(64, 64, causal=True, window=8) == "sdpa"
    assert pick(4096, 4096, causal=True, window=256, dropout_p=0.1) == "sdpa"  # chunked has no dropout


@pytest.mark.parametrize("variant", VARIANTS)
def test_inputs_are_not_modified(variant):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 4, requires_grad=True) for _ in range(3))
    mask = torch.randn(1, 1, 5, 5)
    before = [t.detach().clone() for t in (q, k, v, mask)]
    with backend_variant(variant) as backend:
        attention(q, k, v, mask=mask, causal=True, backend=backend).sum().backward()
    for original, t in zip(before, (q, k, v, mask), strict=True):
        assert torch.equal(original, t.detach())


def _qkv(b=2, h=4, g=2, t=5, s=5, d=8, dtype=torch.float64):
    torch.manual_seed(0)
    return (torch.randn(b, h, t, d, dtype=dtype), torch.randn(b, g, s, d, dtype=dtype),
            torch.randn(b, g, s, d, dtype=dtype))


@pytest.mark.parametrize("backend", [*BACKEND_NAMES, "auto"])
def test_a_nan_query_gives_nan_in_its_row_in_every_backend(backend):
    """Before: math and chunked gave NaN, sdpa and auto gave 0 (PyTorch's CPU flash kernel)."""
    q, k, v = _qkv(dtype=torch.float32)
    q[0, 1, 2, 3] = torch.nan
    out = attnkit.attention(q, k, v, causal=True, backend=backend)
    assert out[0, 1, 2].isnan().all()
    clean = torch.ones_like(out, dtype=torch.bool)
    clean[0, 1, 2] = False
    assert not out[clean].isnan().any()


@pytest.mark.parametrize("backend", [*BACKEND_NAMES, "auto"])
def test_key_mask_is_the_same_as_its_4d_mask(backend):
    q, k, v = _qkv(t=3, s=6)
    key_mask = torch.tensor([[True] * 6, [False, False, True, True, True, False]])
    expected = attnkit.attention(q, k, v, mask=key_mask[:, None, None, :], causal=True, backend="math")
    torch.testing.assert_close(attnkit.attention(q, k, v, key_mask=key_mask, causal=True, backend=backend), expected)
    extra = torch.rand(3, 6) > 0.3
    both = attnkit.attention(q, k, v, key_mask=key_mask, mask=extra, causal=True, backend=backend)
    torch.testing.assert_close(both, attnkit.attention(q, k, v, mask=key_mask[:, None, None, :] & extra,
                                                       causal=True, backend="math"))


@pytest.mark.parametrize("backend", ["sdpa", "auto", "math", "chunked"])
def test_attention_runs_under_vmap(backend):
    """The NaN check of the sdpa adapter was a data-dependent branch that vmap refuses."""
    q = torch.randn(3, 1, 2, 4, 8)
    out = torch.func.vmap(lambda a: attnkit.attention(a, a, a, backend=backend))(q)
    torch.testing.assert_close(out, torch.stack([attnkit.attention(a, a, a, backend="math") for a in q]))
