"""attnkit's transformers attention function called directly: masks, window, dropout, refusals, register().

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import Tensor, nn

from attnkit.integrations import transformers as hf
from tests._util import need
from tests.integrations._tiny import FAMILIES, build, padded_batch

masking = need("transformers.masking_utils")
B, H, G, T, D = 2, 4, 2, 7, 8


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    hf.register()


class _Module(nn.Module):
    """Stands in for a transformers attention module: only ``is_causal`` and ``training`` are read."""

    def __init__(self, is_causal: bool = True) -> None:
        super().__init__()
        self.is_causal = is_causal


def _qkv(seed: int = 0, t: int = T) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, t, D, generator=g), torch.randn(B, G, t, D, generator=g),  # (B, H, T, D), (B, G, S, D)
            torch.randn(B, G, t, D, generator=g))  # (B, G, S, D)


def _reference(q: Tensor, k: Tensor, v: Tensor, additive: Tensor, scale: float) -> Tensor:
    """float64 softmax(q k^T * scale + additive) v with k, v repeated to H heads, out (B, T, H, D)."""
    k, v = (x.double().repeat_interleave(H // G, dim=1) for x in (k, v))  # (B, G, S, D) -> (B, H, S, D)
    scores = q.double() @ k.transpose(-1, -2) * scale + additive.double()  # (B, H, T, S)
    return (scores.softmax(-1) @ v).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


def _band(window: int, t: int = T) -> Tensor:
    """transformers' own sliding-window causal pattern (1, 1, T, T), True = may attend."""
    return masking.sdpa_mask(batch_size=1, q_length=t, kv_length=t, allow_is_causal_skip=False,
                             mask_function=masking.sliding_window_causal_mask_function(window))


@pytest.mark.parametrize("window", [1, 2, 3, 6, 7, 10])
def test_sliding_window_without_a_mask_is_hfs_window(window: int) -> None:
    """window=W is transformers' i - W < j <= i (W keys, itself included): off by one would fail here."""
    q, k, v = _qkv()
    out, weights = hf.attention_forward(_Module(), q, k, v, None, scaling=0.3, sliding_window=window)
    assert weights is None
    band = _band(window)  # (1, 1, T, S)
    expected = _reference(q, k, v, torch.zeros(band.shape).masked_fill(~band, float("-inf")), 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)
    with_mask, _ = hf.attention_forward(_Module(), q, k, v, band, scaling=0.3)  # the mask form transformers builds
    torch.testing.assert_close(with_mask, out, atol=1e-6, rtol=1e-6)


def test_custom_float_and_bool_masks_and_weights() -> None:
    """A caller's 4-d float mask is added to the scores; a bool mask blocks where False; weights are real."""
    q, k, v = _qkv(1)
    g = torch.Generator().manual_seed(2)
    additive = torch.randn(B, 1, T, T, generator=g)  # (B, 1, T, S)
    additive[0, 0, 2, :4] = float("-inf")
    out, weights = hf.attention_forward(_Module(False), q, k, v, additive, output_attentions=True)
    torch.testing.assert_close(out.double(), _reference(q, k, v, additive, D**-0.5), atol=1e-6, rtol=1e-6)
    assert weights is not None and weights.shape == (B, H, T, T)
    torch.testing.assert_close(weights[0, :, 2, :4], torch.zeros(H, 4))
    keep = torch.rand(B, 1, T, T, generator=g) > 0.4  # (B, 1, T, S)
    keep[..., 0] = True
    out, _ = hf.attention_forward(_Module(True), q, k, v, keep)  # a mask overrides the module's is_causal
    expected = _reference(q, k, v, torch.zeros(keep.shape).masked_fill(~keep, float("-inf")), D**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=1e-6, rtol=1e-6)


def test_dropout_only_in_training_mode() -> None:
    """dropout is applied while module.training, never in eval (where eager-style callers may still pass it)."""
    q, k, v = _qkv(3)
    module = _Module()
    plain, _ = hf.attention_forward(module, q, k, v, None)
    evaluated, _ = hf.attention_forward(module.eval(), q, k, v, None, dropout=0.5)
    torch.testing.assert_close(evaluated, plain, atol=0, rtol=0)
    torch.manual_seed(0)
    trained, _ = hf.attention_forward(module.train(), q, k, v, None, dropout=0.5)
    assert (trained - plain).abs().max() > 1e-2


# soft-capping and learned sinks are computed, not refused: tests/integrations/test_transformers_mods.py
@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"position_bias": torch.zeros(1, H, T, T)}, r"an additive position bias: _Module passed position_bias=<tensor"),
    ({"block_indices": 3}, r"an argument attnkit does not know: _Module passed block_indices=3"),
])
def test_what_attnkit_cannot_compute_raises_not_implemented(kwargs: dict, pattern: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match=pattern):
        hf.attention_forward(_Module(), q, k, v, None, **kwargs)


def test_harmless_and_absent_arguments_are_accepted() -> None:
    """softcap=None, sinks=None, position ids, cache flags: same result as without them."""
    q, k, v = _qkv()
    plain, _ = hf.attention_forward(_Module(), q, k, v, None)
    out, _ = hf.attention_forward(_Module(), q, k, v, None, softcap=None, s_aux=None, use_cache=True,
                                  position_ids=torch.arange(T)[None], output_attentions=False)
    torch.testing.assert_close(out, plain, atol=0, rtol=0)


@pytest.mark.parametrize(("mask", "pattern"), [
    (torch.ones(B, 1, T, T, dtype=torch.long), r"shape \(2, 1, 7, 7\) and dtype torch\.int64"),
    (torch.ones(B, T, dtype=torch.bool), r"shape \(2, 7\) and dtype torch\.bool"),
    (torch.ones(B, 1, T, T + 1, dtype=torch.bool), r"shape \(2, 1, 7, 8\).*\(B, H, T, S\) = \(2, 4, 7, 7\)"),
    ("causal", r"shape \(\) and dtype str"),
])
def test_a_mask_attnkit_cannot_read_is_a_value_error_naming_it(mask: object, pattern: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=pattern):
        hf.attention_forward(_Module(), q, k, v, mask)  # type: ignore[arg-type]


def test_bidirectional_window_without_mask_is_refused() -> None:
    q, k, v = _qkv()
    with pytest.raises(NotImplementedError, match="bidirectional sliding window"):
        hf.attention_forward(_Module(is_causal=False), q, k, v, None, sliding_window=3)


def test_register_without_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    with pytest.raises(ImportError, match=r"pip install -c constraints.txt 'attnkit\[hf\]' \(transformers>=5\.0\)"):
        hf.register()


def test_register_with_old_transformers_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    # the module register() imports (transformers may have replaced its entry in sys.modules since our import)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.44.2")
    with pytest.raises(ImportError,
                       match=r"transformers>=5\.0, found 4\.44\.2: pip install -c constraints.txt 'attnkit\[hf\]'"):
        hf.register()


@pytest.mark.parametrize(("kwargs", "pattern"), [
    ({"backend": "fast"}, r"unknown attnkit backend 'fast'"),
    ({"name": "sdpa"}, r"new implementation name, got 'sdpa'"),
    ({"name": ""}, r"got ''"),
    ({"name": "attnkit_flash"}, r"name 'attnkit_flash' contains 'flash', which transformers reads by substring"),
    ({"name": "ak-sdpa", "backend": "sdpa"}, r"contains 'sdpa'.*choose a name without"),
])
def test_register_rejects_bad_options(kwargs: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        hf.register(**kwargs)


@pytest.mark.parametrize("backend", ["chunked", "math"])
def test_register_with_a_backend_runs_that_backend(backend: str) -> None:
    """A model on register(backend=...) equals sdpa, and the backend really is the one asked for."""
    name = hf.register(name=f"attnkit-{backend}", backend=backend)
    family = FAMILIES[0]
    model = build(family)
    ids, mask = padded_batch(family)
    calls = []
    from attnkit.backends import BACKENDS
    original = BACKENDS[backend].run
    try:
        object.__setattr__(BACKENDS[backend], "run", lambda call: calls.append(call) or original(call))
        with torch.no_grad():
            model.set_attn_implementation(name)
            ours = model(ids, attention_mask=mask).logits
    finally:
        object.__setattr__(BACKENDS[backend], "run", original)
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        torch.testing.assert_close(ours, model(ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # one per layer


def test_user_4d_masks_on_a_model_equal_sdpa() -> None:
    """A 4-d bool or float mask given to the model is passed through as is, as sdpa reads it."""
    model = build(FAMILIES[0])
    ids, _ = padded_batch(FAMILIES[0])
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()  # (T, S)
    allowed[5, 1:3] = False
    bool_mask = allowed.expand(2, 1, 8, 8)  # (B, 1, T, S)
    float_mask = torch.zeros(2, 1, 8, 8).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
    for mask in (bool_mask, float_mask):
        out = {}
        for impl in ("attnkit", "sdpa"):
            model.set_attn_implementation(impl)
            with torch.no_grad():
                out[impl] = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(out["attnkit"], out["sdpa"], atol=1e-5, rtol=1e-5)


def test_read_mask_runs_attnkits_own_mask_checks_and_names_what_it_cannot_read():
    """Mask reading exists once (attnkit.backends.check_mask): a float mask comes back in the query's dtype, an
    integer or non-broadcasting one is refused with its shape, dtype and the reason."""
    q, k, _ = _qkv()
    additive = torch.zeros(1, 1, q.shape[2], k.shape[2], dtype=torch.float64)
    assert hf.read_mask(additive, q, k).dtype == q.dtype
    allowed = torch.ones(1, 1, q.shape[2], k.shape[2], dtype=torch.bool)
    assert torch.equal(hf.read_mask(allowed, q, k), allowed)
    with pytest.raises(ValueError, match=r"cannot read an attention mask of shape \(1, 1, \d+, \d+\) and dtype "
                                         r"torch.int64: .*\(attention_mask must be bool"):
        hf.read_mask(allowed.long(), q, k)
    with pytest.raises(ValueError, match=r"shape \(\d+, \d+\) and dtype torch.bool: .*\(it is not a 4-d tensor\)"):
        hf.read_mask(allowed[0, 0], q, k)
    with pytest.raises(ValueError, match=r"\(attention_mask of shape \(1, 1, \d+, 1000\) does not broadcast"):
        hf.read_mask(torch.ones(1, 1, q.shape[2], 1000, dtype=torch.bool), q, k)
