"""Cross-attention: queries from one sequence, keys and values from another; the torch form of attnkit's layers.

``torch.nn.MultiheadAttention`` is a cross-attention in general, so the
builder of that form for both attnkit layers (:func:`torch_multihead`) lives
here, below :mod:`.attention` and :mod:`.convert`, which import it.

Notation (shape comments): B batch, T queries, S context positions, H query
heads, G key/value heads, D head dim, C = H * D (= d_out unless Heads gives D).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .heads import AttentionHeads, Heads, factory_kwargs, positive_int


class CrossAttention(AttentionHeads):
    """Multi-head attention from x (B, T, d_in) to a context (B, S, d_context), as in encoder-decoders.

    Args:
        d_in: size of each query token.
        d_out: size of the output, split into ``num_heads`` heads.
        num_heads: query heads (H), or a :class:`~attnkit.modules.heads.Heads`
            (key/value heads, a head size of its own, the scale of the scores).
        d_context: size of each context token.
        num_kv_heads: key/value heads (G), dividing num_heads; None means num_heads.
        dropout: probability of dropping an attention weight, in training mode only.
        qkv_bias, out_bias: biases of the input and output projections.
        backend: kernel for :func:`attnkit.attention`.
        device, dtype: where and how the parameters are created.

    Parameters: ``q_proj`` (d_in -> C), ``kv_proj`` (d_context -> 2 * G * D;
    rows are keys, then values) and ``out_proj`` (C -> d_out). Not
    causal, no rotary embedding, no KV cache: every query sees the whole
    context, except where ``key_mask`` or ``attn_mask`` hide it.
    """

    def __init__(self, d_in: int, d_out: int, num_heads: int | Heads, *, d_context: int,
                 num_kv_heads: int | None = None,
                 dropout: float = 0.0, qkv_bias: bool = False, out_bias: bool = True, backend: str = "auto",
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        if not isinstance(backend, str):
            raise TypeError(f"CrossAttention's backend must be a backend's name (str), got {type(backend).__name__}; "
                            "kernel components (e.g. ContextParallel) serve MultiHeadAttention")
        factory = factory_kwargs(device, dtype)
        super().__init__(d_in, d_out, num_heads, num_kv_heads=num_kv_heads, causal=False, window=None,
                         dropout=dropout, out_bias=out_bias, backend=backend, factory=factory)
        self.d_context = positive_int("d_context", d_context)
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=qkv_bias, **factory)
        self.kv_proj = nn.Linear(d_context, 2 * self.num_kv_heads * self.head_dim, bias=qkv_bias, **factory)

    def extra_repr(self) -> str:
        return f"{self._heads_repr()}, d_context={self.d_context}, dropout={self.dropout}, backend={self.backend!r}"

    def project(self, x: Tensor, context: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, G, S, D)."""
        q = self.q_proj(x)  # (B, T, d_in) -> (B, T, C)
        k, v = self.kv_proj(context).chunk(2, dim=-1)  # (B, S, d_context) -> 2 x (B, S, GD)
        return self.split(q, self.num_heads), self.split(k, self.num_kv_heads), self.split(v, self.num_kv_heads)

    def forward(self, x: Tensor, context: Tensor, *, key_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, T, d_in) to ``context`` (B, S, d_context).

        Args:
            key_mask: bool (B, S), True where a context position is a real
                token (False = padding).
            attn_mask: bool (True = may attend) or float (added to the
                scores), broadcastable to (B, H, T, S).
            need_weights: also return the weights (B, H, T, S).

        Returns: (B, T, d_out), or (output, weights) with ``need_weights``.
        """
        self.check_x(x)
        self.check_x(context, "context", self.d_context)
        if context.shape[0] != x.shape[0]:
            raise ValueError(f"context has batch size {context.shape[0]} but x has {x.shape[0]}")
        q, k, v = self.project(x, context)
        return self.attend(q, k, v, key_mask=key_mask, attn_mask=attn_mask, need_weights=need_weights)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The same layer as a ``torch.nn.MultiheadAttention`` (see :func:`attnkit.modules.convert.to_torch`)."""
        check_torch_form(self, batch_first)
        biases = (self.q_proj.bias, self.kv_proj.bias)  # both or neither: one qkv_bias flag
        in_bias = None if biases[0] is None or biases[1] is None else torch.cat(biases)  # (E,) + (2E,) -> (3E,)
        return torch_multihead(self, self.q_proj.weight, self.kv_proj.weight, in_bias, kdim=self.d_context,
                               batch_first=batch_first)  # (E, E), (2E, d_context)


def copy_weight_(target: Tensor, source: Tensor | None) -> None:
    """``target`` overwritten with ``source`` (zeros where None), outside autograd."""
    with torch.no_grad():
        target.copy_(source if source is not None else torch.zeros_like(target))


def check_torch_form(layer: AttentionHeads, batch_first: object) -> None:
    """A ValueError naming what ``torch.nn.MultiheadAttention`` cannot express of ``layer`` (grouped-query
    heads, d_in != d_out, what :meth:`~attnkit.modules.heads.AttentionHeads.torch_problems` names), a
    TypeError for a ``batch_first`` that is not a bool."""
    if layer.num_kv_heads != layer.num_heads:
        raise ValueError(f"torch.nn.MultiheadAttention has no grouped-query heads "
                         f"(num_kv_heads={layer.num_kv_heads} != num_heads={layer.num_heads})")
    if layer.d_in != layer.d_out:
        raise ValueError(f"torch.nn.MultiheadAttention needs d_in == d_out, got {layer.d_in} and {layer.d_out}")
    layer.check_torch_equivalent()  # heads of their own size, a scale of its own, a q/k norm, modifiers
    if not isinstance(batch_first, bool):
        raise TypeError(f"batch_first must be a bool, got {batch_first!r}")


def torch_multihead(layer: AttentionHeads, w_q: Tensor, w_kv: Tensor, in_bias: Tensor | None, *,
                    kdim: int | None, batch_first: bool) -> nn.MultiheadAttention:
    """A ``torch.nn.MultiheadAttention`` holding ``layer``'s weights (on (T, B, E) inputs if not batch_first).

    ``w_q`` (E, E) projects queries, ``w_kv`` (2E, kdim) keys then values,
    ``in_bias`` (3E,) or None their biases; the output projection is
    ``layer.out_proj``. torch's module is a cross-attention in general (its
    queries, keys and values come in apart), so both attnkit layers are built
    here: a self-attention layer passes its fused qkv_proj split in two and
    ``kdim=None``. torch's module has one ``bias`` flag for both projections:
    if only one of attnkit's projections has a bias, the other gets a zero
    bias. Call :func:`check_torch_form` first.
    """
    weight, e = layer.out_proj.weight, layer.d_out
    has_bias = layer.out_proj.bias is not None or in_bias is not None
    m = nn.MultiheadAttention(e, layer.num_heads, dropout=layer.dropout, bias=has_bias, batch_first=batch_first,
                              kdim=kdim, vdim=kdim, device=weight.device, dtype=weight.dtype)
    m.train(layer.training)
    if m._qkv_same_embed_dim:  # torch fuses in_proj_weight when kdim = vdim = embed_dim
        copy_weight_(m.in_proj_weight, torch.cat([w_q, w_kv]))  # (3E, E): rows q, k, v
    else:
        copy_weight_(m.q_proj_weight, w_q)
        copy_weight_(m.k_proj_weight, w_kv[:e])
        copy_weight_(m.v_proj_weight, w_kv[e:])
    if has_bias:
        copy_weight_(m.in_proj_bias, in_bias)
        copy_weight_(m.out_proj.bias, layer.out_proj.bias)
    copy_weight_(m.out_proj.weight, weight)
    return m
