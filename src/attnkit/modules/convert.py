"""Converters between attnkit's MultiHeadAttention and other attention modules.

Each converter copies weights into a new module that computes the same
function, on the same device and dtype, in the same training mode.

Legend: E embed dim, H heads, D head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from attnkit import textbook

from .attention import MultiHeadAttention
from .cross import CrossAttention, copy_weight_


def _copy_in_proj(layer: MultiHeadAttention | CrossAttention, m: nn.MultiheadAttention) -> None:
    """torch's input projections -> attnkit's (fused qkv_proj, or q_proj and kv_proj)."""
    e, bias = m.embed_dim, m.in_proj_bias
    if isinstance(layer, MultiHeadAttention):
        copy_weight_(layer.qkv_proj.weight, m.in_proj_weight)  # (3E, E): rows q, k, v, as in attnkit
        if bias is not None:
            copy_weight_(layer.qkv_proj.bias, bias)
        return
    fused = m._qkv_same_embed_dim
    w_q, w_k, w_v = m.in_proj_weight.chunk(3) if fused else (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
    copy_weight_(layer.q_proj.weight, w_q)
    copy_weight_(layer.kv_proj.weight, torch.cat([w_k, w_v]))  # (2E, kdim)
    if bias is not None:
        copy_weight_(layer.q_proj.bias, bias[:e])
        copy_weight_(layer.kv_proj.bias, bias[e:])


def from_torch(m: nn.MultiheadAttention, *, causal: bool = False, backend: str = "auto",
               cross: bool | None = None) -> MultiHeadAttention | CrossAttention:
    """An attnkit layer computing the same function as ``m``.

    attnkit layers are batch-first: for a module with ``batch_first=False``,
    the attnkit layer computes the same function on inputs transposed from
    (T, B, E) to (B, T, E) (and ``to_torch(batch_first=False)`` gives such a
    module back). Masks flip polarity, because in attnkit True means *may
    attend*::

        out, _ = m(x, x, x, key_padding_mask=pad, attn_mask=blocked)   # torch: True = blocked
        out = layer(x, key_mask=~pad, attn_mask=~blocked)              # attnkit: True = may attend

    A float ``attn_mask`` is additive in both and passes unchanged; ``causal=True``
    replaces torch's ``is_causal=True`` plus a causal ``attn_mask``. A module
    with ``kdim``/``vdim`` set (or any module, with ``cross=True``) becomes a
    :class:`~attnkit.CrossAttention`; call it as ``layer(x, context)`` where
    torch had ``m(x, context, context)``.
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch expects a torch.nn.MultiheadAttention, got {type(m).__name__}")
    if m.bias_k is not None or m.add_zero_attn:
        raise ValueError("add_bias_kv and add_zero_attn have no equivalent in attnkit")
    if m.kdim != m.vdim:
        raise ValueError(f"kdim={m.kdim} and vdim={m.vdim} differ: an attnkit layer attends to one context")
    cross = not m._qkv_same_embed_dim if cross is None else cross
    e, weight = m.embed_dim, m.out_proj.weight
    options = dict(dropout=m.dropout, qkv_bias=m.in_proj_bias is not None, out_bias=m.out_proj.bias is not None,
                   backend=backend, device=weight.device, dtype=weight.dtype)
    layer: MultiHeadAttention | CrossAttention
    if cross:
        if causal:
            raise ValueError("a cross-attention layer is not causal: pass causal=False")
        layer = CrossAttention(e, e, m.num_heads, d_context=m.kdim, **options)
    else:
        layer = MultiHeadAttention(e, e, m.num_heads, causal=causal, **options)
    layer.train(m.training)
    _copy_in_proj(layer, m)
    copy_weight_(layer.out_proj.weight, weight)
    if m.out_proj.bias is not None:
        copy_weight_(layer.out_proj.bias, m.out_proj.bias)
    return layer


def to_torch(layer: MultiHeadAttention | CrossAttention, *, batch_first: bool = True) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention`` computing the same function (on (T, B, E) inputs if not batch_first).

    torch's module has one ``bias`` flag for both projections: if only one of
    attnkit's projections has a bias, the other gets a zero bias. torch's
    module is not causal by itself: call it with ``is_causal=True`` and a
    causal ``attn_mask`` (True = blocked) where the attnkit layer was causal.
    Grouped-query heads, rotary embedding, a sliding window and
    d_in != d_out have no equivalent there and raise. The same as
    ``layer.to_torch(batch_first=...)``.
    """
    if not isinstance(layer, (MultiHeadAttention, CrossAttention)):
        raise TypeError(f"to_torch expects an attnkit MultiHeadAttention or CrossAttention, got {type(layer).__name__}")
    return layer.to_torch(batch_first=batch_first)


def _heads_to_layer(heads: list[textbook.CausalAttention]) -> MultiHeadAttention:
    """Per-head CausalAttention weights stacked into one layer with an identity out_proj."""
    first = heads[0]
    d_out = first.d_out * len(heads)
    layer = MultiHeadAttention(first.d_in, d_out, len(heads), causal=True, dropout=first.dropout.p,
                               qkv_bias=first.W_query.bias is not None)
    layer.to(device=first.W_query.weight.device, dtype=first.W_query.weight.dtype)
    parts = [torch.cat([getattr(h, name).weight for h in heads]) for name in ("W_query", "W_key", "W_value")]
    copy_weight_(layer.qkv_proj.weight, torch.cat(parts))  # 3 x (H*D, d_in) -> (3*H*D, d_in)
    if layer.qkv_proj.bias is not None:
        parts = [torch.cat([getattr(h, name).bias for h in heads]) for name in ("W_query", "W_key", "W_value")]
        copy_weight_(layer.qkv_proj.bias, torch.cat(parts))
    copy_weight_(layer.out_proj.weight, torch.eye(d_out))
    copy_weight_(layer.out_proj.bias, None)
    return layer


def from_textbook(m: nn.Module) -> MultiHeadAttention:
    """An attnkit layer computing the same function as a textbook attention module.

    Accepts :class:`attnkit.textbook.MultiHeadAttention` (weight splits and
    ``out_proj``), :class:`~attnkit.textbook.MultiHeadAttentionWrapper` and a
    single :class:`~attnkit.textbook.CausalAttention` (their heads stacked,
    with an identity ``out_proj``). The result is causal and, unlike the
    textbook classes, has no ``context_length`` limit.
    """
    if isinstance(m, textbook.MultiHeadAttentionWrapper):
        layer = _heads_to_layer(list(m.heads))  # type: ignore[arg-type]
    elif isinstance(m, textbook.CausalAttention):
        layer = _heads_to_layer([m])
    elif isinstance(m, textbook.MultiHeadAttention):
        layer = MultiHeadAttention(m.d_in, m.d_out, m.num_heads, causal=True, dropout=m.dropout.p,
                                   qkv_bias=m.W_query.bias is not None)
        layer.to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        copy_weight_(layer.qkv_proj.weight, torch.cat([m.W_query.weight, m.W_key.weight, m.W_value.weight]))
        if m.W_query.bias is not None:
            copy_weight_(layer.qkv_proj.bias, torch.cat([m.W_query.bias, m.W_key.bias, m.W_value.bias]))
        copy_weight_(layer.out_proj.weight, m.out_proj.weight)
        copy_weight_(layer.out_proj.bias, m.out_proj.bias)
    else:
        raise TypeError("from_textbook expects attnkit.textbook's MultiHeadAttention, "
                        f"MultiHeadAttentionWrapper or CausalAttention, got {type(m).__name__}")
    return layer.train(m.training)
