"""attnkit.MultiHeadAttention against the textbook and an independent reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import MultiHeadAttention
from attnkit import textbook as tb
from attnkit.functional import RotaryEmbedding
from attnkit.functional.norm import QKNorm, RMSNorm
from attnkit.modules.heads import Heads
from tests._reference import reference_attention

BACKENDS = ["math", "sdpa", "chunked"]


def rope_reference(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split rotary embedding as complex multiplication (independent of attnkit)."""
    d = x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2], x[..., d // 2 :]) * torch.polar(
        torch.ones_like(theta), positions.double()[:, None] * theta)
    return torch.cat([z.real, z.imag], dim=-1)


def rms_reference(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()


def layer_reference(layer: MultiHeadAttention, x: torch.Tensor, key_mask=None, attn_mask=None,
                    scale: float | None = None) -> torch.Tensor:
    """The layer's function from its weights: fused rows are queries, then keys, then values; q and k normalised
    per head (an RMSNorm each) before the rotation; scores scaled by ``scale`` (None: 1 / sqrt(D))."""
    b, t, _ = x.shape
    h, g, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    w, bias = layer.qkv_proj.weight.double(), layer.qkv_proj.bias
    y = x.double() @ w.T + (0 if bias is None else bias.double())
    q = y[..., : h * d].reshape(b, t, h, d).transpose(1, 2)
    k = y[..., h * d : (h + g) * d].reshape(b, t, g, d).transpose(1, 2)
    v = y[..., (h + g) * d :].reshape(b, t, g, d).transpose(1, 2)
    if layer.qk_norm is not None:
        q, k = rms_reference(q, layer.qk_norm.q_norm), rms_reference(k, layer.qk_norm.k_norm)
    if layer.rope is not None:
        base = layer.rope.base
        q, k = rope_reference(q, torch.arange(t), base), rope_reference(k, torch.arange(t), base)
    mask = None if key_mask is None else key_mask[:, None, None, :]
    if attn_mask is not None:
        mask = attn_mask if mask is None else mask & attn_mask
    out, _ = reference_attention(q, k, v, mask=mask, causal=layer.causal, window=layer.window, scale=scale)
    out = out.transpose(1, 2).reshape(b, t, h * d) @ layer.out_proj.weight.double().T
    return out if layer.out_proj.bias is None else out + layer.out_proj.bias.double()


@st.composite
def layer_configs(draw):
    """Layers as before, and (own_size) Gemma-like ones: Heads with a head size of its own (H * D != d_out), a
    given scale, a q/k norm and a rotary base of their own."""
    g, r, d = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 6]))
    causal = draw(st.booleans())
    config = dict(
        d_in=draw(st.integers(1, 7)), d_out=g * r * d, num_heads=g * r, num_kv_heads=g, causal=causal,
        qkv_bias=draw(st.booleans()), out_bias=draw(st.booleans()), rope=draw(st.booleans()),
        window=draw(st.one_of(st.none(), st.integers(1, 4))) if causal else None,
    )
    if draw(st.booleans()):
        scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
        config |= dict(d_out=draw(st.integers(1, 9)), num_kv_heads=None,
                       num_heads=Heads(g * r, num_kv_heads=g, head_dim=d, scale=scale),
                       qk_norm=QKNorm(RMSNorm(d, eps=1e-6), RMSNorm(d, eps=1e-6)) if draw(st.booleans()) else None,
                       rope=RotaryEmbedding(d, base=draw(st.sampled_from([1e4, 1e6]))) if config["rope"] else False)
    return config


@given(config=layer_configs(), t=st.integers(1, 8), padded=st.booleans(), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_every_backend_computes_the_layers_function(config, t, padded, seed):
    torch.manual_seed(seed)
    layer = MultiHeadAttention(**config).double()
    if layer.qk_norm is not None:  # weights of ones would hide a norm applied to the wrong tensor
        for weight in layer.qk_norm.parameters():
            torch.nn.init.uniform_(weight, 0.5, 1.5)
    x = torch.randn(2, t, config["d_in"], dtype=torch.float64)
    key_mask = (torch.rand(2, t) > 0.3) if padded else None
    heads = config["num_heads"]
    expected = layer_reference(layer, x, key_mask=key_mask, scale=heads.scale if isinstance(heads, Heads) else None)
    for backend in BACKENDS:
        layer.backend = backend
        torch.testing.assert_close(layer(x, key_mask=key_mask), expected, atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("make", [
    lambda: tb.MultiHeadAttention(5, 6, 40, 0.0, num_heads=3, qkv_bias=True),
    lambda: tb.MultiHeadAttentionWrapper(5, 2, 40, 0.0, num_heads=3),
    lambda: tb.CausalAttention(5, 4, 40, 0.0),
])
def test_from_textbook_is_the_same_function_with_the_same_gradients(make):
    torch.manual_seed(0)
    book = make().double()
    layer = attnkit.from_textbook(book)
    x = torch.randn(2, 40, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 40, book(x).shape[-1], dtype=torch.float64)
    torch.testing.assert_close(layer(x), book(x))
    (gx_layer,) = torch.autograd.grad(layer(x), x, grad)
    (gx_book,) = torch.autograd.grad(book(x), x, grad)
    torch.testing.assert_close(gx_layer, gx_book)
    assert layer(torch.randn(1, 100, 5, dtype=torch.float64)).shape[1] == 100  # no context_length cap


def test_padded_keys_do_not_leak_into_real_tokens():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, causal=False)
    x = torch.randn(2, 6, 8)
    key_mask = torch.tensor([[True] * 6, [True, True, True, True, False, False]])
    out = layer(x, key_mask=key_mask)
    x2 = x.clone()
    x2[1, 4:] = torch.randn(2, 8) * 100  # whatever sits in the padding
    torch.testing.assert_close(layer(x2, key_mask=key_mask)[1, :4], out[1, :4])


def test_all_padding_gives_the_output_bias_and_finite_gradients():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, causal=False)
    x = torch.randn(2, 5, 8, requires_grad=True)
    key_mask = torch.tensor([[True] * 5, [False] * 5])
    out = layer(x, key_mask=key_mask)
    torch.testing.assert_close(out[1], layer.out_proj.bias.expand(5, 8))
    out.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in [x, *layer.parameters()])


def test_need_weights_uses_the_same_function():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 4, num_kv_heads=2, rope=True).eval()
    x = torch.randn(2, 5, 8)
    key_mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out, weights = layer(x, key_mask=key_mask, need_weights=True)
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(out, layer(x, key_mask=key_mask))
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    assert (weights[1, :, :, 3:] == 0).all() and (weights[0].triu(1) == 0).all()


def test_dropout_only_in_training_mode():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 2, dropout=0.5)
    x = torch.randn(2, 6, 8)
    plain = MultiHeadAttention(8, 8, 2)
    plain.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer.eval()(x), plain(x))
    assert (layer.train()(x) - plain(x)).abs().amax() > 1e-3
    layer.backend = "chunked"
    with pytest.raises(ValueError, match=r"backend 'chunked' cannot serve this call: it has no dropout"):
        layer(x)
    torch.testing.assert_close(layer.eval()(x), plain(x))  # chunked is fine once dropout is off


def test_attn_mask_and_key_mask_together():
    torch.manual_seed(0)
    layer = MultiHeadAttention(6, 6, 3, causal=False).double()
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    key_mask = torch.tensor([[True] * 5, [True, True, True, True, False]])
    attn_mask = torch.rand(1, 3, 5, 5) > 0.3
    expected = layer_reference(layer, x, key_mask=key_mask, attn_mask=attn_mask)
    torch.testing.assert_close(layer(x, key_mask=key_mask, attn_mask=attn_mask), expected)
    float_mask = torch.zeros(1, 3, 5, 5, dtype=torch.float64).masked_fill(~attn_mask, -torch.inf)
    torch.testing.assert_close(layer(x, key_mask=key_mask, attn_mask=float_mask), expected)


def test_grouped_and_multi_query_projection_sizes():
    """Multi-query: one key/value head serves every query head (a wrong head mapping changes the values)."""
    assert MultiHeadAttention(16, 16, 4, num_kv_heads=2).qkv_proj.out_features == (4 + 2 * 2) * 4
    torch.manual_seed(0)
    mqa = MultiHeadAttention(16, 16, 4, num_kv_heads=1).double()
    assert mqa.qkv_proj.out_features == (4 + 2) * 4
    full = MultiHeadAttention(16, 16, 4).double()  # the same layer with its key/value head copied to all four
    with torch.no_grad():
        q, k, v = mqa.qkv_proj.weight.split([16, 4, 4])
        full.qkv_proj.weight.copy_(torch.cat([q, k.repeat(4, 1), v.repeat(4, 1)]))
        full.out_proj.load_state_dict(mqa.out_proj.state_dict())
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(mqa(x), full(x), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(backend="chunked", dropout=0.1), r"backend 'chunked' cannot serve this layer: it has no dropout"),
    (dict(rope=True, causal=False, window=None, num_heads=0), r"num_heads must be a positive int"),
])
def test_configurations_that_fail_on_every_call_fail_at_construction(kwargs, message):
    args = dict(d_in=8, d_out=8, num_heads=2) | kwargs
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**args)


def test_a_bad_attn_mask_is_reported_as_attn_mask():
    layer = MultiHeadAttention(8, 8, 2)
    with pytest.raises(ValueError, match=r"^attn_mask of shape \(5, 6\) does not broadcast"):
        layer(torch.randn(1, 5, 8), attn_mask=torch.ones(5, 6, dtype=torch.bool))


def test_numpy_dropout_is_accepted():
    layer = MultiHeadAttention(8, 8, 2, dropout=np.float32(0.25))
    assert layer.dropout == pytest.approx(0.25)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_torchscript_fails_at_once_naming_torch_compile():
    with pytest.raises(TypeError, match=r"does not support TorchScript .* use torch.compile"):
        torch.jit.script(MultiHeadAttention(8, 8, 2))


def test_integer_input_is_named_as_such():
    with pytest.raises(TypeError, match=r"x must be floating point, got dtype torch.int64"):
        MultiHeadAttention(8, 8, 2)(torch.ones(1, 3, 8, dtype=torch.long))


class _PlacingKernel:
    """A kernel component that places the tokens at ``start``, ``start + 2``, ``start + 4``, ... (as a shard's
    tokens sit apart) and attends with the math backend; it records what the layer asked of it."""

    def __init__(self, start: int | None) -> None:
        self.start, self.requests, self.calls = start, [], 0

    def prepare(self, request):
        self.requests.append(request)
        if self.start is None:
            return None
        return (self.start + 2 * torch.arange(request.length, device=request.device)).expand(request.batch, -1)

    def attention(self, q, k, v, *, causal, key_mask, scale):
        self.calls += 1
        return attnkit.attention(q, k, v, causal=causal, key_mask=key_mask, scale=scale, backend="math")


def test_a_kernel_component_runs_the_same_projection_rope_and_head_merge():
    """The ring's old second code path redid projection, RoPE and head merging: a kernel component now gets q, k, v
    rotated at the positions its prepare() gave, and its output is merged by the layer's one path."""
    torch.manual_seed(0)
    plain = MultiHeadAttention(8, 8, 2, num_kv_heads=1, rope=True).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    key_mask = torch.tensor([[True] * 5, [False] + [True] * 4])
    placed = (3 + 2 * torch.arange(5)).expand(2, 5)
    for start, expected in ((3, plain(x, key_mask=key_mask, positions=placed)), (None, plain(x, key_mask=key_mask))):
        kernel = _PlacingKernel(start)
        plain.backend = kernel
        torch.testing.assert_close(plain(x, key_mask=key_mask), expected, atol=1e-12, rtol=1e-12)
        plain.backend = "auto"
        assert kernel.calls == 1
        assert kernel.requests == [attnkit.backends.KernelRequest(
            batch=2, length=5, device=x.device, causal=True, window=None, dropout_p=0.0, given=())]
    assert not torch.allclose(plain(x, positions=placed), plain(x))  # the placed positions did change RoPE


def test_a_kernel_component_is_told_every_option_it_would_not_see():
    """A kernel that cannot honour an attention mask, a cache, weights, positions, a window or dropout must hear
    of them in prepare() (the ring refuses them there, on every rank)."""
    layer = MultiHeadAttention(8, 8, 2, window=3, dropout=0.25, backend=_PlacingKernel(None)).train()
    kernel = layer.backend
    x = torch.randn(1, 4, 8)
    layer(x, positions=torch.arange(4).expand(1, 4), attn_mask=torch.ones(4, 4, dtype=torch.bool),
          kv_cache=attnkit.KVCache())
    request = kernel.requests[-1]
    assert request.given == ("positions", "kv_cache", "attn_mask")
    assert (request.window, request.dropout_p) == (3, 0.25)
    layer.eval()
    layer(x, need_weights=True)
    assert kernel.requests[-1].given == ("need_weights",) and kernel.requests[-1].dropout_p == 0.0


def test_a_backend_that_is_neither_a_name_nor_a_kernel_is_refused_naming_what_it_lacks():
    class HalfKernel:
        def prepare(self, request):
            return None

    with pytest.raises(TypeError, match=r"a kernel component with methods prepare and attention .*; HalfKernel "
                                        r"lacks attention"):
        MultiHeadAttention(8, 8, 2, backend=HalfKernel())  # type: ignore[arg-type]
    layer = MultiHeadAttention(8, 8, 2)
    layer.backend = HalfKernel()  # set after construction: refused at the call, before anything is computed
    with pytest.raises(TypeError, match=r"HalfKernel lacks attention"):
        layer(torch.randn(1, 2, 8))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'parallel'"):  # removed: see CHANGELOG.md
        MultiHeadAttention(8, 8, 2)(torch.randn(1, 2, 8), parallel=_PlacingKernel(None))  # type: ignore[call-arg]


def test_heads_of_their_own_size_project_to_d_out():
    """Gemma 3 270M's layer: 4 query heads of 256 over 1 key/value head, in and out of a 640-wide model."""
    layer = MultiHeadAttention(640, 640, Heads(4, num_kv_heads=1, head_dim=256), out_bias=False)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.scale) == (4, 1, 256, 1 / 16)
    assert (layer.qkv_proj.in_features, layer.qkv_proj.out_features) == (640, (4 + 2) * 256)
    assert (layer.out_proj.in_features, layer.out_proj.out_features) == (1024, 640)
    assert layer(torch.randn(2, 3, 640)).shape == (2, 3, 640)
    assert layer.heads == Heads(4, 1, 256, 1 / 16)  # every default filled in
    assert "head_dim=256" in repr(layer) and "scale" not in repr(layer)  # 1/sqrt(256) is the default


def test_a_scale_of_its_own_reaches_every_kernel_and_the_weights():
    """The scale must reach the backends, a kernel component and the returned weights alike."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, Heads(2, head_dim=4, scale=0.9)).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    expected = layer_reference(layer, x, scale=0.9)
    assert not torch.allclose(expected, layer_reference(layer, x))  # 0.9 is not the default 1/sqrt(4)
    q, k, v = layer.project(x)
    _, expected_weights = reference_attention(q, k, v, causal=True, scale=0.9)
    for backend in BACKENDS:
        layer.backend = backend
        torch.testing.assert_close(layer(x), expected)
    layer.backend = "auto"
    out, weights = layer(x, need_weights=True)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(weights, expected_weights)
    kernel = _PlacingKernel(None)
    layer.backend = kernel
    torch.testing.assert_close(layer(x), expected)
    assert kernel.calls == 1 and "scale=0.9" in repr(layer)


def test_the_qk_norm_is_applied_per_head_before_the_rotation():
    """Normalising after the rotation, or over all heads at once, gives other queries: the reference normalises
    each head's D dimensions, then rotates."""
    torch.manual_seed(0)
    norm = QKNorm(RMSNorm(4, eps=1e-6), RMSNorm(4, eps=1e-6))
    for weight in norm.parameters():
        torch.nn.init.uniform_(weight, 0.5, 1.5)
    layer = MultiHeadAttention(8, 6, Heads(3, num_kv_heads=1, head_dim=4), rope=True, qk_norm=norm).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(layer(x), layer_reference(layer, x), atol=1e-12, rtol=1e-12)
    unweighted = MultiHeadAttention(8, 6, Heads(3, num_kv_heads=1, head_dim=4),
                                    qk_norm=QKNorm(RMSNorm(4, eps=0.0), RMSNorm(4, eps=0.0))).double()
    q, k, _ = unweighted.project(x)
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 3, 5, dtype=torch.float64))  # each head: RMS 1
    torch.testing.assert_close(k.pow(2).mean(-1), torch.ones(2, 1, 5, dtype=torch.float64))


def test_a_layer_with_a_qk_norm_built_on_meta_resets_its_norm_too():
    layer = MultiHeadAttention(8, 8, Heads(2, head_dim=6), qk_norm=QKNorm(RMSNorm(6, eps=1e-6),
                                                                           RMSNorm(6, eps=1e-6)), device="meta")
    layer = layer.to_empty(device="cpu")
    for weight in layer.qk_norm.parameters():
        weight.data.fill_(float("nan"))
    layer.reset_parameters()
    torch.testing.assert_close(layer.qk_norm.q_norm.weight, torch.ones(6))
    assert torch.isfinite(layer(torch.randn(1, 3, 8))).all()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: MultiHeadAttention(8, 8, Heads(2, num_kv_heads=1), num_kv_heads=1),
     r"num_kv_heads=1 given beside Heads\(.*give it once, inside Heads"),
    (lambda: MultiHeadAttention(8, 10, 4), r"d_out=10 is not divisible by num_heads=4 \(or give head_dim"),
    (lambda: Heads(2, head_dim=0), r"head_dim must be a positive int, got head_dim=0"),
    (lambda: Heads(2, scale=0.0), r"scale must be a finite number > 0 .*got scale=0.0"),
    (lambda: Heads(4, num_kv_heads=3), r"num_heads=4 is not a multiple of num_kv_heads=3"),
    (lambda: MultiHeadAttention(8, 8, Heads(2, head_dim=6), rope=RotaryEmbedding(4)),
     r"rope has head_dim=4 but this layer's head_dim is 6"),
    (lambda: MultiHeadAttention(8, 8, 2, qk_norm=torch.nn.functional.normalize),
     r"qk_norm must be an nn.Module whose forward\(q, k\) returns \(q, k\)"),
])
def test_bad_heads_are_refused_by_name(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize(("layer", "problem"), [
    (MultiHeadAttention(8, 8, Heads(2, head_dim=6)), r"heads of their own size \(num_heads \* head_dim = 2 \* 6"),
    (MultiHeadAttention(8, 8, Heads(2, scale=0.1)), r"a scale of its own \(scale=0.1"),
    (MultiHeadAttention(8, 8, 2, qk_norm=QKNorm(RMSNorm(4, eps=1e-6), RMSNorm(4, eps=1e-6))),
     r"a norm of queries and keys \(QKNorm\)"),
    (attnkit.CrossAttention(8, 8, Heads(2, head_dim=3), d_context=8), r"heads of their own size"),
])
def test_to_torch_refuses_what_torch_cannot_express(layer, problem):
    """torch.nn.MultiheadAttention would silently compute another function (no norm, 1/sqrt(D) scale)."""
    with pytest.raises(ValueError, match=r"torch.nn.MultiheadAttention has no equivalent of " + problem):
        layer.to_torch()


def test_a_qk_norm_that_changes_the_heads_or_takes_one_argument_is_refused() -> None:
    """A component that cut the heads would attend over fewer dimensions with the old scale: refused by shape."""
    import torch as _torch

    from attnkit import Heads
    from attnkit.functional import RMSNorm

    class Cut(_torch.nn.Module):
        def forward(self, q: _torch.Tensor, k: _torch.Tensor) -> tuple[_torch.Tensor, _torch.Tensor]:
            return q[..., :3], k[..., :3]

    layer = MultiHeadAttention(16, 16, Heads(4, head_dim=6), qk_norm=Cut())
    with pytest.raises(ValueError, match=r"qk_norm must return q and k in their shapes \(1, 4, 3, 6\) and "
                                         r"\(1, 4, 3, 6\), got \(1, 4, 3, 3\) and \(1, 4, 3, 3\)"):
        layer(_torch.randn(1, 3, 16))
    with pytest.raises(TypeError, match=r"forward\(q, k\).*QKNorm\(q_norm, k_norm\).*got RMSNorm"):
        MultiHeadAttention(16, 16, Heads(4, head_dim=6), qk_norm=RMSNorm(6, eps=1e-6))
