"""Soft-capping (Gemma 2) and learned sinks (gpt-oss) on "attnkit" equal transformers' eager attention.

Tiny random models, float32, a fixed seed, one sliding-window layer (window 3 over 8 tokens) and one full
layer, a left-padded batch. Weights are initialised wide enough that the scores reach the soft-cap and the
sinks take a real share of each row, so dropping either changes the logits far beyond the tolerance
(``test_the_feature_matters`` checks that the equality tests do test it).

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from attnkit.integrations import transformers as hf
from tests.integrations._tiny import transformers

TOL = dict(atol=1e-5, rtol=1e-5)
VOCAB, T, H, G, D = 64, 8, 4, 2, 8
CAP = 2.0  # Gemma 2's attn_logit_softcapping, small enough for these scores to reach it
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=G,
               head_dim=D, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
               max_position_embeddings=64, initializer_range=0.3)


# attnkit's backends under names of their own ("sdpa" in a name makes transformers check the model supports SDPA)
_NAMES = {"math": "attnkit-math", "chunked": "attnkit-chunked", "sdpa": "attnkit-fused"}


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    hf.register()
    for backend in ("math", "chunked", "sdpa"):
        hf.register(name=_NAMES[backend], backend=backend)


def _gemma2(seed: int = 0) -> nn.Module:
    config = transformers.Gemma2Config(**_COMMON, intermediate_size=64, query_pre_attn_scalar=D,
                                       attn_logit_softcapping=CAP, final_logit_softcapping=None)
    torch.manual_seed(seed)
    return transformers.Gemma2ForCausalLM(config).float().eval()


def _gpt_oss(seed: int = 0) -> nn.Module:
    """gpt-oss with 2 experts (one per token) and sinks drawn from N(0, 1): a real share of each row."""
    config = transformers.GptOssConfig(**_COMMON, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1,
                                       rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()  # (H,)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {"gemma2": _gemma2, "gpt_oss": _gpt_oss}
BACKENDS = {"gemma2": ["attnkit", "attnkit-math", "attnkit-chunked"],  # SDPA cannot serve a non-additive score_mod
            "gpt_oss": ["attnkit", "attnkit-math", "attnkit-chunked", "attnkit-fused"]}
CASES = [(name, impl) for name, impls in BACKENDS.items() for impl in impls]


def _batch(padded: bool = True) -> tuple[Tensor, Tensor]:
    """input_ids (B, T) and attention_mask (B, T): sequence 1 left-padded by 3 tokens (if ``padded``)."""
    ids = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))  # (B, T)
    mask = torch.ones(2, T, dtype=torch.long)  # (B, T)
    if padded:
        mask[1, :3] = 0
        ids[mask == 0] = 0
    return ids, mask


def _logits(model: nn.Module, impl: str, ids: Tensor, mask: Tensor, **kw: object):
    model.set_attn_implementation(impl)
    return model(ids, attention_mask=mask, **kw)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize(("name", "impl"), CASES)
def test_logits_equal_eager(name: str, impl: str, padded: bool) -> None:
    """Catches a dropped or misplaced soft-cap (after the mask, before the scaling), sinks ignored or added as a
    key with a value, a sink per key/value head instead of per query head, and a lost window on the sliding layer.

    Unpadded, transformers passes no mask to the full layer: the cap and sinks then ride on causal=True.
    Rows of padding see no key: eager spreads them uniformly, attnkit gives 0, so only real tokens compare.
    """
    model = MODELS[name]()
    ids, mask = _batch(padded)
    with torch.no_grad():
        ours = _logits(model, impl, ids, mask).logits  # (B, T, V)
        eager = _logits(model, "eager", ids, mask).logits  # (B, T, V)
    rows = mask.bool()  # (B, T)
    torch.testing.assert_close(ours[rows], eager[rows], **TOL)


@pytest.mark.parametrize("name", MODELS)
def test_the_feature_matters(name: str) -> None:
    """Without the soft-cap (or the sinks) eager's logits move far beyond the tolerance: the tests above test it."""
    model = MODELS[name]()
    ids, mask = _batch()
    rows = mask.bool()  # (B, T)
    with torch.no_grad():
        full = _logits(model, "eager", ids, mask).logits[rows]
        if name == "gemma2":
            model.config.attn_logit_softcapping = None
            for layer in model.model.layers:
                layer.self_attn.attn_logit_softcapping = None
        else:
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
        without = _logits(model, "eager", ids, mask).logits[rows]
    assert (full - without).abs().max() > 1e-2


@pytest.mark.parametrize("name", MODELS)
def test_output_attentions_equal_eager_weights(name: str) -> None:
    """Weights come back soft-capped and without the sink's column (gpt-oss rows sum to less than 1), as eager's."""
    model = MODELS[name]()
    ids, mask = _batch()
    with torch.no_grad():
        ours = _logits(model, "attnkit", ids, mask, output_attentions=True).attentions
        eager = _logits(model, "eager", ids, mask, output_attentions=True).attentions
    rows = mask.bool()  # (B, T)
    assert len(ours) == len(eager) == 2
    for a, b in zip(ours, eager, strict=True):
        assert a.shape == (2, H, T, T)  # (B, H, T, S)
        torch.testing.assert_close(a.transpose(1, 2)[rows], b.transpose(1, 2)[rows], **TOL)  # (B, T, H, S)[rows]
    totals = ours[1].transpose(1, 2)[rows].sum(-1)  # (B, T, H, S)[rows] -> (N, H)
    if name == "gpt_oss":
        assert totals.max() <= 1 and totals.mean() < 0.9  # the sinks take their share
    else:
        torch.testing.assert_close(totals, torch.ones_like(totals))


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", MODELS)
def test_cached_greedy_decoding_equals_eager(name: str, cache: str) -> None:
    """Prefill and 6 cached decoding steps (past the window of 3, with the sliding layer's cache) give eager's
    tokens and eager's logits at every step: catches positions misaligned between queries and cached keys.

    The static cache runs unpadded, so its prefill comes without a mask (keys cropped to the queries).
    """
    model = MODELS[name]()
    ids, mask = _batch(padded=cache == "dynamic")
    out = {}
    for impl in ("attnkit", "eager"):
        model.set_attn_implementation(impl)
        out[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True, cache_implementation=cache)
    assert out["attnkit"].sequences.shape == (2, T + 6)
    torch.testing.assert_close(out["attnkit"].sequences, out["eager"].sequences, atol=0, rtol=0)
    torch.testing.assert_close(torch.stack(out["attnkit"].logits), torch.stack(out["eager"].logits), **TOL)


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_gradients_equal_eager(name: str, impl: str) -> None:
    """Every parameter's gradient, the sinks' included, equals eager's: catches a backward that skips the sinks
    (zero or missing gradient) or differentiates the scores as if they were not capped.

    Gradients reach 300 here, so the absolute tolerance is 1e-5 of each gradient's largest entry (float32's
    rounding over two layers is a few 1e-6 of it; a missed term of the backward is of the order of the gradient).
    """
    model = MODELS[name]()
    ids, mask = _batch()
    rows = mask.bool()  # (B, T)
    probe = torch.randn(int(rows.sum()), VOCAB, generator=torch.Generator().manual_seed(5))  # (N, V)
    grads = {}
    for which in (impl, "eager"):
        model.zero_grad()
        (_logits(model, which, ids, mask).logits[rows] * probe).sum().backward()
        grads[which] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[impl].keys() == grads["eager"].keys()
    for param, grad in grads["eager"].items():
        torch.testing.assert_close(grads[impl][param], grad, atol=1e-5 * float(grad.abs().max()), rtol=1e-5,
                                   msg=lambda m, n=param: f"{n}: {m}")
    sinks = [g for n, g in grads[impl].items() if n.endswith("self_attn.sinks")]
    assert len(sinks) == (2 if name == "gpt_oss" else 0)
    assert all(g.abs().min() > 1e-6 for g in sinks)  # every head's sink gets a gradient


# ----------------------------------------------------------------------------- attention_forward called directly


class _Module(nn.Module):
    """Stands in for a transformers attention module: only ``is_causal`` and ``training`` are read."""

    is_causal = True


def _qkv(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, H, T, D, generator=g) * 2  # (B, H, T, D), scores large enough to reach the cap
    return q, torch.randn(2, G, T, D, generator=g), torch.randn(2, G, T, D, generator=g)  # (B, G, S, D) each


def _reference(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, cap: float | None,
               sinks: Tensor | None) -> Tensor:
    """float64 eager attention (Gemma 2's cap, gpt-oss's sinks), out (B, T, H, D); ``allowed`` True = may attend."""
    k, v = (x.double().repeat_interleave(H // G, dim=1) for x in (k, v))  # (B, G, S, D) -> (B, H, S, D)
    scores = q.double() @ k.transpose(-1, -2) * scale  # (B, H, T, S)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, H, 1, 1).expand(2, H, T, 1)  # (H,) -> (B, H, T, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (B, H, T, S + 1)
    weights = scores.softmax(-1)[..., :T]  # (B, H, T, S)
    return (weights @ v).transpose(1, 2)  # (B, H, T, D) -> (B, T, H, D)


@pytest.mark.parametrize("with_mask", [False, True], ids=["band", "mask"])
@pytest.mark.parametrize(("cap", "use_sinks"), [(1.5, False), (None, True), (1.5, True)])
def test_softcap_and_sinks_equal_a_float64_reference(cap: float | None, use_sinks: bool, with_mask: bool) -> None:
    """softcap and s_aux, alone and together, in a sliding window of 3, given as the flag or as transformers' mask."""
    q, k, v = _qkv()
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3)) if use_sinks else None  # (H,)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = (j <= i) & (j > i - 3)  # (T, S)
    mask = allowed.expand(2, 1, T, T) if with_mask else None  # (B, 1, T, S)
    out, _ = hf.attention_forward(_Module(), q, k, v, mask, scaling=0.4, sliding_window=3, softcap=cap, s_aux=sinks)
    torch.testing.assert_close(out.double(), _reference(q, k, v, allowed, 0.4, cap, sinks), atol=1e-6, rtol=1e-6)


def test_sinks_under_either_name_are_the_same_sinks() -> None:
    """``sinks=`` (some models' name) is ``s_aux=`` (gpt-oss's); the same tensor under both is accepted."""
    q, k, v = _qkv()
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(3))  # (H,)
    by_s_aux, _ = hf.attention_forward(_Module(), q, k, v, None, s_aux=sinks)
    by_sinks, _ = hf.attention_forward(_Module(), q, k, v, None, sinks=sinks)
    both, _ = hf.attention_forward(_Module(), q, k, v, None, s_aux=sinks, sinks=sinks)
    plain, _ = hf.attention_forward(_Module(), q, k, v, None)
    torch.testing.assert_close(by_sinks, by_s_aux, atol=0, rtol=0)
    torch.testing.assert_close(both, by_s_aux, atol=0, rtol=0)
    assert (by_s_aux - plain).abs().max() > 1e-2


@pytest.mark.parametrize(("kwargs", "error", "pattern"), [
    # per-token sinks (B, H, T, 1), as some models compute them: not one logit per head
    ({"sinks": torch.zeros(2, H, T, 1)}, NotImplementedError,
     r"sinks of shape \(H,\) = \(4,\).*_Module passed sinks=<tensor of shape \(2, 4, 8, 1\)>.*eager"),
    ({"s_aux": torch.zeros(G)}, NotImplementedError, r"_Module passed s_aux=<tensor of shape \(2,\)>"),
    ({"s_aux": torch.zeros(H), "sinks": torch.ones(H)}, ValueError, r"both s_aux=.* and sinks="),
    ({"s_aux": torch.zeros(H, dtype=torch.long)}, ValueError, r"sinks must be a floating-point"),
    ({"softcap": 0.0}, ValueError, r"_Module passed softcap=0\.0: softcap's cap must be a positive finite number"),
    ({"softcap": -30.0}, ValueError, r"softcap=-30\.0"),
])
def test_sinks_or_softcap_attnkit_cannot_serve_are_refused_by_name(kwargs: dict, error: type, pattern: str) -> None:
    q, k, v = _qkv()
    with pytest.raises(error, match=pattern):
        hf.attention_forward(_Module(), q, k, v, None, **kwargs)
