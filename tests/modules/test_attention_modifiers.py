"""Score and mask modifiers and learned sinks as components of MultiHeadAttention.

What must hold: the layer applies them at the tokens' true positions, so a
KV cache (growing or static, token by token or in pieces), explicit positions
and padded rows all give what the full forward of each row alone gives; trace
records the modified scores; torch.compile(fullgraph=True) compiles a layer
with them; sinks and learned modifiers get gradients.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from attnkit import KVCache, MultiHeadAttention, StaticKVCache, trace
from attnkit.functional import RotaryEmbedding
from attnkit.functional.modifiers import (
    alibi,
    alibi_slopes,
    document_mask,
    prefix_lm,
    sink_window,
    softcap,
)

B, T, C, H, G = 2, 12, 32, 4, 2


def _layer(seed: int = 0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    return MultiHeadAttention(C, C, H, num_kv_heads=G, rope=True, **kwargs).double().eval()


def _x(batch: int = B, length: int = T, seed: int = 1) -> Tensor:
    return torch.randn(batch, length, C, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _reference(layer: MultiHeadAttention, x: Tensor, positions: Tensor, score, mask, sinks: Tensor | None) -> Tensor:
    """Float64 attention written out: every (query, key) pair scored at the positions of ``positions`` (B, T)."""
    q, k, v = layer.project(x)  # (B, H, T, D), (B, G, T, D), (B, G, T, D)
    q, k = layer.rope(q, k, positions=positions)
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, G, T, D) -> (B, H, T, D)
    out = torch.zeros_like(q)
    for b in range(x.shape[0]):
        for h in range(H):
            for i in range(x.shape[1]):
                logits, values = [], []
                for j in range(x.shape[1]):
                    pi, pj = int(positions[b, i]), int(positions[b, j])
                    if pj < 0 or pj > pi or not mask(b, h, pi, pj):
                        continue
                    s = float((q[b, h, i] @ k[b, h, j]).detach()) * layer.scale
                    logits.append(score(s, b, h, pi, pj))
                    values.append(v[b, h, j])
                if sinks is not None:
                    logits.append(float(sinks[h]))
                    values.append(torch.zeros_like(v[b, h, 0]))
                if logits:
                    w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
                    out[b, h, i] = sum(wi * vi for wi, vi in zip(w, values, strict=True))
    return layer.merge(out)


SLOPES = alibi_slopes(H).double()
CASES = {  # name -> (layer kwargs, the score and mask the reference applies at true positions)
    "alibi": (dict(score_mod=alibi(H)), lambda s, b, h, i, j: s + float(SLOPES[h]) * (j - i), None),
    "softcap": (dict(score_mod=softcap(1.5)), lambda s, b, h, i, j: 1.5 * math.tanh(s / 1.5), None),
    "prefix_lm": (dict(causal=False, mask_mod=prefix_lm(3)), None, lambda b, h, i, j: j <= i or j < 3),
    "sink_window": (dict(mask_mod=sink_window(2, 4)), None, lambda b, h, i, j: j < 2 or i - j < 4),
    "sinks": (dict(sinks=nn.Parameter(torch.linspace(-1.0, 1.0, H))), None, None),
}


def _case(name: str) -> tuple[MultiHeadAttention, object, object, Tensor | None]:
    kwargs, score, mask = CASES[name]
    layer = _layer(**kwargs)
    sinks = None if layer.sinks is None else layer.sinks.detach()
    return layer, score or (lambda s, b, h, i, j: s), mask or (lambda b, h, i, j: True), sinks


def _reference_of(layer, x, positions, score, mask, sinks):
    if not layer.causal:  # the reference's loop is causal; a non-causal layer's mask says it all
        return _reference_noncausal(layer, x, positions, score, mask, sinks)
    return _reference(layer, x, positions, score, mask, sinks)


def _reference_noncausal(layer, x, positions, score, mask, sinks):
    """As _reference, without the causal cut (prefix-LM's prefix sees ahead)."""
    q, k, v = layer.project(x)
    q, k = layer.rope(q, k, positions=positions)
    k, v = k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1)  # (B, G, T, D) -> (B, H, T, D)
    pos = positions
    idx = pos[:, None, :, None], pos[:, None, None, :]  # (B, 1, T, 1), (B, 1, 1, T)
    keep = torch.tensor([[[[mask(b, h, int(pos[b, i]), int(pos[b, j])) for j in range(pos.shape[1])]
                           for i in range(pos.shape[1])] for h in range(H)] for b in range(pos.shape[0])])
    keep &= idx[1] >= 0
    s = (q @ k.transpose(-2, -1)) * layer.scale  # (B, H, T, D) @ (B, H, D, T) -> (B, H, T, T)
    w = torch.softmax(s.masked_fill(~keep, -torch.inf), -1).nan_to_num(0.0)
    return layer.merge(w @ v)


@pytest.mark.parametrize("name", CASES)
def test_full_forward_equals_a_float64_reference_at_true_positions(name):
    layer, score, mask, sinks = _case(name)
    x = _x()
    positions = torch.arange(T).expand(B, T)
    torch.testing.assert_close(layer(x), _reference_of(layer, x, positions, score, mask, sinks))


def _decode(layer: MultiHeadAttention, x: Tensor, cuts: list[int], cache, positions: Tensor | None = None,
            key_mask: Tensor | None = None) -> Tensor:
    """x fed in the pieces [0, cuts[0]), [cuts[0], cuts[1]), ... through one cache."""
    outs, edges = [], [0, *cuts, x.shape[1]]
    for a, b in itertools.pairwise(edges):
        if a == b:
            continue
        kwargs = {} if positions is None else {"positions": positions[:, a:b].contiguous()}
        if key_mask is not None and isinstance(cache, KVCache):  # a static cache's empty slots are at -1 already
            kwargs["key_mask"] = key_mask[:, :b].contiguous()
        outs.append(layer(x[:, a:b], kv_cache=cache, **kwargs))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("backend", ["math", "chunked", "sdpa"])
@pytest.mark.parametrize("name", CASES)
def test_cached_decoding_equals_the_full_forward(name, backend):
    layer, *_ = _case(name)
    if backend == "sdpa" and name == "softcap":
        pytest.skip("SDPA serves score modifiers only as additive biases")
    if name == "prefix_lm":
        cuts = [4]  # the bidirectional prefix arrives in one piece, then token by token
        cuts += list(range(5, T))
    else:
        cuts = list(range(1, T))
    layer.backend = backend
    x = _x()
    full = layer(x)
    torch.testing.assert_close(_decode(layer, x, cuts, KVCache()), full)
    with torch.no_grad():
        positions = torch.arange(T).expand(B, T)
        torch.testing.assert_close(_decode(layer, x, cuts, StaticKVCache(T), positions), full)


@pytest.mark.parametrize("name", CASES)
def test_a_padded_row_gets_what_it_gets_alone(name):
    """Left padding with explicit positions: each row's modifiers see its own positions (prefix-LM's prefix is
    its first real tokens, not the first slots), in the full forward and through a static cache."""
    layer, *_ = _case(name)
    x = _x()
    pad = 3
    positions = torch.stack([torch.arange(T), torch.arange(T) - pad]).clamp_min(-1)  # row 1: 3 pads, then 0..
    key_mask = positions >= 0
    alone = layer(x[1:, pad:])
    batch = layer(x, positions=positions, key_mask=key_mask)
    torch.testing.assert_close(batch[1, pad:], alone[0])
    torch.testing.assert_close(batch[0], layer(x[:1])[0])
    with torch.no_grad():
        cuts = [pad + 4, *range(pad + 5, T)]
        decoded = _decode(layer, x, cuts, StaticKVCache(T), positions, key_mask)
    torch.testing.assert_close(decoded[1, pad:], alone[0])


def test_a_per_call_document_mask_makes_packed_documents_independent():
    """Two documents packed in one row: each gets what it gets alone (rotary embedding and ALiBi are relative,
    so the second document's offset in the row does not matter once the mask separates them)."""
    layer = _layer(score_mod=alibi(H))
    x = _x(batch=1)
    ids = torch.tensor([[0] * 5 + [1] * (T - 5)])
    packed = layer(x, mask_mod=document_mask(ids))
    torch.testing.assert_close(packed[:, :5], layer(x[:, :5]))
    torch.testing.assert_close(packed[:, 5:], layer(x[:, 5:]))
    mixed = layer(x)  # without the mask, the second document sees the first
    assert not torch.allclose(mixed[:, 5:], layer(x[:, 5:]))


def test_a_per_call_mask_is_anded_with_the_layers():
    layer = _layer(mask_mod=sink_window(1, 3))
    x = _x(batch=1)
    ids = torch.tensor([[0] * 6 + [1] * (T - 6)])
    both = layer(x, mask_mod=document_mask(ids))
    positions = torch.arange(T)[None]
    same_doc_in_window = lambda b, h, i, j: bool(ids[0, i] == ids[0, j]) and (j < 1 or i - j < 3)  # noqa: E731
    torch.testing.assert_close(both, _reference(layer, x, positions, lambda s, b, h, i, j: s, same_doc_in_window,
                                                None))
    # inside a document mask, a window and its sink restart with each document
    own = _layer()(x, mask_mod=document_mask(ids, sink_window(1, 3)))
    torch.testing.assert_close(own[:, 6:], layer(x[:, 6:]))


@settings(max_examples=20, deadline=None)
@given(name=st.sampled_from(sorted(CASES)), cut=st.integers(1, T - 1), pad=st.integers(0, T - 2),
       kv_heads=st.sampled_from([1, 2, 4]), backend=st.sampled_from(["math", "chunked", "auto"]))
def test_property_pieces_padding_and_groups_agree_with_the_full_forward(name, cut, pad, kv_heads, backend):
    kwargs, *_ = CASES[name]
    torch.manual_seed(0)
    layer = MultiHeadAttention(C, C, H, num_kv_heads=kv_heads, rope=True, backend=backend, **kwargs).double().eval()
    x = _x()
    positions = torch.stack([torch.arange(T), torch.arange(T) - pad]).clamp_min(-1)
    key_mask = positions >= 0
    if name == "prefix_lm":
        cut = max(cut, pad + 3)  # the whole prefix in the first piece
    full = layer(x, positions=positions, key_mask=key_mask)
    decoded = _decode(layer, x, [cut] if cut < T else [], KVCache(), positions, key_mask)
    real = key_mask[..., None]  # padded queries see nothing: 0 before out_proj, the same in both
    torch.testing.assert_close(decoded * real, full * real)


def test_trace_records_the_modified_scores_and_weights():
    layer = _layer(score_mod=softcap(0.5), sinks=torch.zeros(H, dtype=torch.float64))
    x = _x()
    with trace(layer) as t:
        layer(x)
    (record,) = t.records
    visible = record.scores > -torch.inf
    assert bool((record.scores[visible].abs() <= 0.5).all())  # capped
    assert float(record.scores[visible].abs().max()) > 0.3  # and not all zero
    sums = record.weights.sum(-1)  # (B, H, T): a sink of logit 0 takes 1 / (1 + sum exp(s)) of each row
    expected = 1 - 1 / (1 + torch.exp(record.scores).sum(-1))
    torch.testing.assert_close(sums, expected)


def test_gradients_reach_the_sinks_and_a_modifier_module():
    class LearnedCap(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cap = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

        def forward(self, score, b, h, q_idx, kv_idx):
            return self.cap * torch.tanh(score / self.cap)

    layer = _layer(score_mod=LearnedCap(), sinks=nn.Parameter(torch.zeros(H, dtype=torch.float64)))
    names = {name for name, _ in layer.named_parameters()}
    assert {"sinks", "score_mod.cap"} <= names
    x = _x()
    grads = {}
    for backend in ("math", "chunked"):
        layer.backend = backend
        layer.zero_grad()
        layer(x).square().sum().backward()
        grads[backend] = (layer.sinks.grad.clone(), layer.score_mod.cap.grad.clone())
        assert bool(grads[backend][0].abs().min() > 0)
    torch.testing.assert_close(grads["chunked"], grads["math"])


@pytest.mark.slow
def test_a_layer_with_modifiers_compiles_whole_and_decodes_with_a_static_cache():
    layer = _layer(score_mod=alibi(H), mask_mod=sink_window(2, 4), sinks=torch.ones(H, dtype=torch.float64))
    x = _x()
    positions = torch.arange(T).expand(B, T)
    with torch.no_grad():
        want = layer(x)
        compiled = torch.compile(layer, fullgraph=True)
        torch.testing.assert_close(compiled(x), want)
        cache = StaticKVCache(T)
        step = torch.compile(lambda xs, pos: layer(xs, positions=pos, kv_cache=cache), fullgraph=True)
        got = torch.cat([step(x[:, i:i + 1], positions[:, i:i + 1].contiguous()) for i in range(T)], 1)
    torch.testing.assert_close(got, want)


def test_bad_components_are_refused_by_name():
    with pytest.raises(TypeError, match=r"score_mod .* must take 5 positional arguments"):
        MultiHeadAttention(C, C, H, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match="mask_mod must be a callable"):
        MultiHeadAttention(C, C, H, mask_mod=3)
    with pytest.raises(ValueError, match=r"sinks must be a floating-point \(num_heads,\) = \(4,\)"):
        MultiHeadAttention(C, C, H, sinks=torch.zeros(3))
    layer = _layer()
    with pytest.raises(TypeError, match=r"mask_mod .* must take 4 positional arguments"):
        layer(_x(), mask_mod=lambda b, h: True)
    with pytest.raises(ValueError, match=r"document_mask.*doc_ids must label positions 0 \.\. 11"):
        layer(_x(), mask_mod=document_mask(torch.zeros(B, 5, dtype=torch.long)))


def test_rope_component_is_untouched_by_modifiers():
    """A layer's RotaryEmbedding is shared as given (a modifier does not replace positions for it)."""
    rope = RotaryEmbedding(C // H)
    layer = MultiHeadAttention(C, C, H, rope=rope, score_mod=alibi(H))
    assert layer.rope is rope


def test_a_kernel_component_without_modifier_keywords_is_refused_for_a_layer_with_modifiers():
    class OldKernel:
        def prepare(self, request):
            return None

        def attention(self, q, k, v, *, causal, key_mask, scale):
            return torch.zeros_like(q)

    plain = _layer()
    plain.backend = OldKernel()
    assert plain(_x()).shape == (B, T, C)  # no modifiers: the old kernel still serves
    layer = _layer(score_mod=alibi(H))
    layer.backend = OldKernel()
    with pytest.raises(TypeError, match=r"OldKernel\.attention lacks score_mod, mask_mod, sinks"):
        layer(_x())


def test_to_torch_refuses_a_layer_with_modifiers_or_sinks():
    for kwargs in (dict(score_mod=alibi(H)), dict(mask_mod=sink_window(1, 4)), dict(sinks=torch.zeros(H))):
        layer = MultiHeadAttention(C, C, H, **kwargs)
        with pytest.raises(ValueError, match=r"torch\.nn\.MultiheadAttention has no equivalent of"):
            layer.to_torch()


def test_a_built_ins_learned_tensors_train_save_and_move_with_the_layer():
    slopes, cap = nn.Parameter(alibi_slopes(H)), nn.Parameter(torch.tensor(3.0))
    layer = MultiHeadAttention(C, C, H, score_mod=alibi(slopes=slopes)).double()
    assert "score_mod_slopes" in layer.state_dict() and layer.score_mod.slopes is layer.score_mod_slopes
    assert layer.score_mod_slopes.dtype == torch.float64  # moved with the layer, still what the modifier reads
    layer(_x()).sum().backward()
    assert layer.score_mod_slopes.grad is not None and bool(layer.score_mod_slopes.grad.abs().min() > 0)
    capped = MultiHeadAttention(C, C, H, score_mod=softcap(cap))
    assert [name for name, _ in capped.named_parameters() if name.startswith("score_mod")] == ["score_mod_cap"]


@pytest.mark.parametrize("make", [lambda: alibi(slopes=nn.Parameter(alibi_slopes(H))),
                                  lambda: softcap(nn.Parameter(torch.tensor(3.0)))], ids=["alibi", "softcap"])
def test_a_modifiers_learned_tensors_are_the_layers_own_through_assign_meta_and_reset(make):
    """The layer registered the caller's Parameter and the modifier kept reading it: load_state_dict(assign=True)
    changed the state dict but not the output (0.51 apart), and a layer built on meta, then to_empty() and
    reset_parameters(), read uninitialised slopes."""
    torch.manual_seed(0)
    trained = MultiHeadAttention(C, C, H, score_mod=make())
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if name.startswith("score_mod_"):
                p.mul_(1.5)  # as training would move them
    fresh = MultiHeadAttention(C, C, H, score_mod=make())
    fresh.load_state_dict(trained.state_dict(), assign=True)
    x = _x().float()
    torch.testing.assert_close(fresh(x), trained(x))
    on_meta = MultiHeadAttention(C, C, H, score_mod=make(), device="meta", dtype=torch.float64)
    assert all(p.device.type == "meta" and p.dtype == torch.float64 for p in on_meta.parameters())
    on_meta.to_empty(device="cpu")
    on_meta.reset_parameters()
    reference = MultiHeadAttention(C, C, H, score_mod=make(), dtype=torch.float64)
    reference.load_state_dict({k: v for k, v in on_meta.state_dict().items() if not k.startswith("score_mod_")},
                              strict=False)
    torch.testing.assert_close(on_meta(_x()), reference(_x()))  # the modifier reads the values it was given
    shared = make()
    tied = nn.ModuleList([MultiHeadAttention(C, C, H, score_mod=shared) for _ in range(2)])
    with torch.no_grad():
        next(p for n, p in tied[0].named_parameters() if n.startswith("score_mod_")).zero_()
    second = next(p for n, p in tied[1].named_parameters() if n.startswith("score_mod_"))
    assert bool((second != 0).all())  # each layer's own copy, as sinks are


def test_sinks_are_the_layers_own_on_its_device_and_reset_to_zero():
    shared = torch.zeros(H)
    layers = nn.ModuleList([MultiHeadAttention(C, C, H, sinks=shared) for _ in range(2)])
    layers.load_state_dict({**layers.state_dict(), "0.sinks": torch.ones(H), "1.sinks": torch.full((H,), 2.0)})
    torch.testing.assert_close(layers[0].sinks, torch.ones(H))  # not tied to layer 1 through `shared`
    meta = MultiHeadAttention(C, C, H, sinks=nn.Parameter(torch.full((H,), 0.5)), device="meta")
    assert meta.sinks.device.type == "meta"
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    torch.testing.assert_close(meta.sinks.detach(), torch.zeros(H))


def test_a_subclass_that_changes_call_is_not_run_through_the_built_ins_fast_paths():
    from attnkit import attention
    from attnkit.functional.modifiers import Alibi, Softcap

    class Doubled(Alibi):
        def __call__(self, s, b, h, q_idx, kv_idx):
            return 2 * super().__call__(s, b, h, q_idx, kv_idx)

    class Bumped(Softcap):
        def __call__(self, s, b, h, q_idx, kv_idx):
            return super().__call__(s, b, h, q_idx, kv_idx) + 0.3 * (q_idx == kv_idx)

    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    for fn in (Doubled(alibi_slopes(2).double()), Bumped(2.0)):
        want = attention(q, k, v, causal=True, score_mod=fn, backend="math")
        for backend in ("chunked", "auto"):
            torch.testing.assert_close(attention(q, k, v, causal=True, score_mod=fn, backend=backend), want)


def test_per_sample_gradients_through_a_score_modifier_on_chunked():
    from attnkit import attention

    q, k, v = (torch.randn(3, 2, 5, 4, dtype=torch.float64) for _ in range(3))

    def grads(backend):
        def loss(a, b, c):  # one sample (H, T, D) at a time, as a batch of one
            return attention(a[None], b[None], c[None], causal=True, score_mod=alibi(2), backend=backend).sum()

        return torch.func.vmap(torch.func.grad(loss))(q, k, v)

    torch.testing.assert_close(grads("chunked"), grads("math"))


def test_an_error_inside_a_modifier_keeps_its_type_and_names_the_modifier():
    from attnkit import attention

    q = torch.randn(1, 2, 4, 4)
    with pytest.raises(TypeError) as caught:
        attention(q, q, q, score_mod=torch.tanh, backend="math")
    assert any("score_mod" in note for note in getattr(caught.value, "__notes__", ["score_mod"]))
    with pytest.raises(ValueError, match="cap must be positive and finite"):
        softcap(torch.tensor(0.0))
