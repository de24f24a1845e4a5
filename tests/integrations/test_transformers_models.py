"""Tiny transformers models of several families give the same results on "attnkit" as on "sdpa" / "eager".

Legend: B batch, H heads, T tokens, S keys, C hidden size.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from attnkit.integrations.transformers import register
from tests.integrations._tiny import FAMILIES, Family, build, padded_batch, transformers

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _registered() -> None:
    register()


def _run(model: nn.Module, impl: str, ids: Tensor, mask: Tensor, **kw: object):
    model.set_attn_implementation(impl)
    return model(ids, attention_mask=mask, output_hidden_states=True, **kw)


def _valid_queries(mask: Tensor) -> Tensor:
    """(B, T) bool: query rows that see at least one key (eager spreads a fully masked row uniformly)."""
    return mask.bool()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_hidden_states_equal_sdpa_on_a_padded_batch(family: Family) -> None:
    """Catches a wrong mask polarity, a window off by one, GQA heads paired wrongly, or a dropped scaling."""
    model = build(family)
    ids, mask = padded_batch(family)
    with torch.no_grad():
        ours = _run(model, "attnkit", ids, mask).hidden_states
        theirs = _run(model, "sdpa", ids, mask).hidden_states
    assert len(ours) == len(theirs) == 3
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_gradients_equal_sdpa_on_a_padded_batch(family: Family) -> None:
    """Backward through attnkit gives sdpa's parameter gradients (every parameter, every position in the loss)."""
    model = build(family)
    ids, mask = padded_batch(family)
    probe = torch.randn(2, ids.shape[1], 32, generator=torch.Generator().manual_seed(5))  # (B, T, C)
    grads = {}
    for impl in ("attnkit", "sdpa"):
        model.zero_grad()
        (_run(model, impl, ids, mask).hidden_states[-1] * probe).sum().backward()
        grads[impl] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["attnkit"].keys() == grads["sdpa"].keys() and len(grads["sdpa"]) > 10
    for name, grad in grads["sdpa"].items():
        torch.testing.assert_close(grads["attnkit"][name], grad, **TOL, msg=lambda m, n=name: f"{n}: {m}")
    assert any(g.abs().sum() > 0 for n, g in grads["attnkit"].items() if "q_proj" in n or "query" in n or "c_attn" in n)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_output_attentions_equal_eager_weights(family: Family) -> None:
    """output_attentions=True returns real weights (not None, not sdpa's warning), equal to eager's."""
    model = build(family)
    ids, mask = padded_batch(family)
    with torch.no_grad():
        ours = _run(model, "attnkit", ids, mask, output_attentions=True)
        eager = _run(model, "eager", ids, mask, output_attentions=True)
    rows = _valid_queries(mask)  # (B, T)
    assert len(ours.attentions) == len(eager.attentions) == 2
    for a, b in zip(ours.attentions, eager.attentions, strict=True):
        assert a is not None and a.shape == (2, 4, 8, 8)  # (B, H, T, S)
        torch.testing.assert_close(a.permute(0, 2, 1, 3)[rows], b.permute(0, 2, 1, 3)[rows], **TOL)
        torch.testing.assert_close(a[rows[:, None, :].expand(-1, 4, -1)].sum(-1), torch.ones(4 * int(rows.sum())))
    torch.testing.assert_close(ours.hidden_states[-1][rows], eager.hidden_states[-1][rows], **TOL)


def test_sliding_window_is_applied_and_matters() -> None:
    """The window changes the result (so the equality tests above do test it): sdpa with a wider window differs."""
    family = next(f for f in FAMILIES if f.name == "mistral")
    model = build(family)
    ids, mask = padded_batch(family)
    with torch.no_grad():
        narrow = _run(model, "attnkit", ids, mask).hidden_states[-1]
        model.config.sliding_window = 4
        wider = _run(model, "attnkit", ids, mask).hidden_states[-1]
        wider_sdpa = _run(model, "sdpa", ids, mask).hidden_states[-1]
    assert not torch.allclose(narrow[0, 3:], wider[0, 3:], atol=1e-3)  # query 3 on sees one more key
    torch.testing.assert_close(narrow[0, :3], wider[0, :3], **TOL)  # queries 0..2 see at most 3 keys either way
    torch.testing.assert_close(wider, wider_sdpa, **TOL)


@pytest.mark.parametrize("name", ["llama", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_gives_sdpa_tokens(name: str, cache: str) -> None:
    """Prefill plus cached decoding steps (a mask each step; none for an unpadded static prefill) pick sdpa's tokens."""
    family = next(f for f in FAMILIES if f.name == name)
    model = build(family)
    ids, mask = padded_batch(family)
    if cache == "static":
        mask = torch.ones_like(mask)  # no padding: the static prefill runs without a mask, keys cropped to T
    tokens = {}
    for impl in ("attnkit", "sdpa"):
        model.set_attn_implementation(impl)
        tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      cache_implementation=cache)
    assert tokens["attnkit"].shape == (2, 14)
    torch.testing.assert_close(tokens["attnkit"], tokens["sdpa"], atol=0, rtol=0)


def test_from_pretrained_and_from_config_accept_attnkit(tmp_path) -> None:
    """attn_implementation="attnkit" is accepted at load time and the loaded model runs on attnkit."""
    model = build(FAMILIES[0])
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="attnkit")
    assert loaded.config._attn_implementation == "attnkit"
    fresh = transformers.AutoModelForCausalLM.from_config(model.config, attn_implementation="attnkit")
    assert fresh.config._attn_implementation == "attnkit"
    ids, mask = padded_batch(FAMILIES[0])
    with torch.no_grad():
        out = loaded.eval()(ids, attention_mask=mask, output_attentions=True)
    assert out.attentions[0] is not None  # weights come back: it really ran attnkit, not sdpa

