"""The production multi-head attention layer.

Notation (shape comments): B batch, T queries, S keys (T + cached positions,
or the context's length), H query heads, G key/value heads, D head dim,
C = H * D = d_out.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnkit.backends import BACKENDS, attention
from attnkit.backends.call import check_mask
from attnkit.functional import RotaryEmbedding, combine_masks, key_padding_to_mask

from .kv_cache import KVCache


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
    return value


def _check_config(d_in: int, d_out: int, num_heads: int, num_kv_heads: int | None, dropout: float,
                  window: int | None, causal: bool, backend: str, d_context: int | None) -> None:
    for name, value in (("d_in", d_in), ("d_out", d_out), ("num_heads", num_heads)):
        _positive_int(name, value)
    if d_out % num_heads:
        raise ValueError(f"d_out={d_out} is not divisible by num_heads={num_heads}")
    if num_kv_heads is not None and num_heads % _positive_int("num_kv_heads", num_kv_heads):
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout={dropout!r} is outside [0, 1)")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        _positive_int("window", window)
        if not causal:
            raise ValueError(f"window={window} needs causal=True: each query sees its window most recent keys")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from: auto, {', '.join(BACKENDS)}")
    if d_context is not None:
        _positive_int("d_context", d_context)
        if causal:
            raise ValueError("a cross-attention layer (d_context set) is not causal: pass causal=False")


def _make_rope(rope: bool | RotaryEmbedding, head_dim: int) -> RotaryEmbedding | None:
    if isinstance(rope, RotaryEmbedding):
        if rope.head_dim != head_dim:
            raise ValueError(f"rope has head_dim={rope.head_dim} but this layer's head_dim is {head_dim}")
        return rope
    if not isinstance(rope, bool):
        raise TypeError(f"rope must be a bool or a RotaryEmbedding, got {type(rope).__name__}")
    if rope and head_dim % 2:
        raise ValueError(f"rope=True needs an even head_dim, got head_dim={head_dim}")
    return RotaryEmbedding(head_dim) if rope else None


class MultiHeadAttention(nn.Module):
    """Multi-head attention with fused projections, GQA, RoPE, windows and a KV cache.

    Args:
        d_in: size of each input token.
        d_out: size of the output, split into ``num_heads`` heads of
            ``head_dim = d_out // num_heads``.
        num_heads: query heads (H).
        num_kv_heads: key/value heads (G), dividing num_heads; None means
            num_heads (multi-head), 1 gives multi-query attention. Query head
            h uses key/value head h // (H // G).
        causal: each query sees only keys at or before its position
            (bottom-right aligned when a KV cache holds earlier positions).
        dropout: probability of dropping an attention weight, in training
            mode only.
        qkv_bias, out_bias: biases of the input and output projections.
        rope: True for rotary position embedding (base 10000, half-split as in
            Llama and GPT-NeoX), or a :class:`~attnkit.RotaryEmbedding`.
        window: with causal, each query sees only its ``window`` most recent
            keys, itself included (sliding-window attention).
        backend: kernel for :func:`attnkit.attention` ("auto", "sdpa",
            "chunked", "math"). Asking for weights uses "math" under "auto".
        d_context: size of a separate context's tokens; makes this a
            cross-attention layer (not causal) with ``q_proj`` and ``kv_proj``.

    Parameters: a self-attention layer has one fused ``qkv_proj`` (d_in ->
    (H + 2G) * D; rows are queries, then keys, then values) and ``out_proj``
    (d_out -> d_out). There is no length limit and no (T, T) buffer.
    """

    qkv_proj: nn.Linear | None
    q_proj: nn.Linear | None
    kv_proj: nn.Linear | None

    def __init__(self, d_in: int, d_out: int, num_heads: int, *, num_kv_heads: int | None = None,
                 causal: bool = True, dropout: float = 0.0, qkv_bias: bool = False, out_bias: bool = True,
                 rope: bool | RotaryEmbedding = False, window: int | None = None, backend: str = "auto",
                 d_context: int | None = None) -> None:
        super().__init__()
        _check_config(d_in, d_out, num_heads, num_kv_heads, dropout, window, causal, backend, d_context)
        self.d_in, self.d_out, self.num_heads = d_in, d_out, num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = d_out // num_heads
        self.causal, self.window, self.dropout, self.backend = causal, window, float(dropout), backend
        self.d_context = d_context
        q_size, kv_size = num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if d_context is None:
            self.qkv_proj = nn.Linear(d_in, q_size + 2 * kv_size, bias=qkv_bias)
            self.q_proj = self.kv_proj = None
        else:
            self.qkv_proj = None
            self.q_proj = nn.Linear(d_in, q_size, bias=qkv_bias)
            self.kv_proj = nn.Linear(d_context, 2 * kv_size, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out, bias=out_bias)
        self.rope = _make_rope(rope, self.head_dim)
        self._observer: Any = None  # set by attnkit.trace while tracing

    def extra_repr(self) -> str:
        parts = [f"d_in={self.d_in}, d_out={self.d_out}, num_heads={self.num_heads}",
                 f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, causal={self.causal}"]
        if self.window is not None:
            parts.append(f"window={self.window}")
        if self.d_context is not None:
            parts.append(f"d_context={self.d_context}")
        return ", ".join([*parts, f"dropout={self.dropout}, backend={self.backend!r}"])

    def _check_inputs(self, x: object, context: object, kv_cache: object) -> None:
        weight = self.out_proj.weight
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.d_in or x.shape[1] == 0:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a (B, T, d_in={self.d_in}) tensor with T >= 1, got {shape}")
        if (x.dtype, x.device) != (weight.dtype, weight.device):
            raise ValueError(f"x is {x.dtype} on {x.device} but the layer's weights are {weight.dtype} on "
                             f"{weight.device}; move one to the other (e.g. layer.to(x.dtype))")
        if kv_cache is not None and not isinstance(kv_cache, KVCache):
            raise TypeError(f"kv_cache must be an attnkit.KVCache, got {type(kv_cache).__name__}")
        if context is None:
            if self.d_context is not None:
                raise ValueError(f"this is a cross-attention layer (d_context={self.d_context}): pass context")
            return
        self._check_context(x, context, kv_cache)

    def _check_context(self, x: Tensor, context: object, kv_cache: object) -> None:
        width = self.d_in if self.d_context is None else self.d_context
        if not isinstance(context, Tensor) or context.dim() != 3 or context.shape[-1] != width:
            shape = tuple(context.shape) if isinstance(context, Tensor) else type(context).__name__
            raise ValueError(f"context must be a (B, S, {width}) tensor, got {shape}")
        if context.shape[0] != x.shape[0] or context.dtype != x.dtype or context.device != x.device:
            raise ValueError(f"context {tuple(context.shape)} {context.dtype} on {context.device} must match "
                             f"x {tuple(x.shape)} {x.dtype} on {x.device} in batch size, dtype and device")
        if self.causal:
            raise ValueError("this layer is causal self-attention; build it with causal=False to attend "
                             "to a context")
        if self.rope is not None or kv_cache is not None:
            raise ValueError("rotary embedding and kv_cache are for self-attention, not for a context")

    def project(self, x: Tensor, context: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, G, S, D), before rotary embedding."""
        b, t, _ = x.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if context is None:
            assert self.qkv_proj is not None  # only self-attention layers run without a context
            q, k, v = self.qkv_proj(x).split((q_size, kv_size, kv_size), dim=-1)  # (B, T, (H+2G)D) -> 3 parts
        elif self.qkv_proj is not None:  # a self-attention layer's weights, split for a context
            w, bias = self.qkv_proj.weight, self.qkv_proj.bias
            q = F.linear(x, w[:q_size], None if bias is None else bias[:q_size])  # (B, T, C)
            kv = F.linear(context, w[q_size:], None if bias is None else bias[q_size:])  # (B, S, 2GD)
            k, v = kv.split(kv_size, dim=-1)
        else:
            assert self.q_proj is not None and self.kv_proj is not None  # a cross-attention layer
            q = self.q_proj(x)  # (B, T, d_in) -> (B, T, C)
            k, v = self.kv_proj(context).split(kv_size, dim=-1)  # (B, S, d_context) -> 2 x (B, S, GD)
        s = k.shape[1]
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, T, C) -> (B, H, T, D)
        k = k.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, S, GD) -> (B, G, S, D)
        v = v.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def _mask(self, key_mask: object, attn_mask: object, q: Tensor, num_keys: int) -> Tensor | None:
        """key_mask (B, S) and attn_mask as one mask for attention(), True = may attend."""
        if key_mask is not None:
            b = q.shape[0]
            if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or key_mask.shape != (b, num_keys):
                got = (key_mask.dtype, tuple(key_mask.shape)) if isinstance(key_mask, Tensor) else key_mask
                raise ValueError(f"key_mask must be a bool (B, S) = ({b}, {num_keys}) tensor, True = real "
                                 f"token (S counts cached positions too); got {got}")
            key_mask = key_padding_to_mask(key_mask.to(q.device))  # (B, S) -> (B, 1, 1, S)
        attn_mask = check_mask(attn_mask, q, num_keys)
        return combine_masks(attn_mask, key_mask)

    def forward(self, x: Tensor, context: Tensor | None = None, *, key_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, kv_cache: KVCache | None = None,
                need_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, T, d_in) to itself, or to ``context`` (B, S, d_context).

        Args:
            key_mask: bool (B, S), True where a key is a real token (False =
                padding). With a KV cache, S counts the cached positions too.
            attn_mask: bool (True = may attend) or float (added to the
                scores), broadcastable to (B, H, T, S).
            kv_cache: a :class:`KVCache` for this layer; the new keys and
                values are appended to it and attention covers all it holds.
            need_weights: also return the weights (B, H, T, S).

        Returns: (B, T, d_out), or (output, weights) with ``need_weights``.
        """
        self._check_inputs(x, context, kv_cache)
        if not isinstance(need_weights, bool):
            raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
        b, t, _ = x.shape
        q, k, v = self.project(x, context)
        cached = 0 if kv_cache is None else len(kv_cache)
        mask = self._mask(key_mask, attn_mask, q, cached + k.shape[2])  # checked before the cache grows
        if self.rope is not None:
            q, k = self.rope(q, k, offset=cached)
        if kv_cache is not None:
            k, v = kv_cache.append(k, v)  # -> (B, G, S, D), S = cached + T
        dropout_p = self.dropout if self.training else 0.0
        if self._observer is not None:  # attnkit.trace: the math backend, every intermediate recorded
            out, weights = self._observer(self, q, k, v, mask, dropout_p)
        elif need_weights:
            out, weights = attention(q, k, v, mask=mask, causal=self.causal, window=self.window,
                                     dropout_p=dropout_p, backend=self.backend, return_weights=True)
        else:
            weights = None
            out = attention(q, k, v, mask=mask, causal=self.causal, window=self.window,
                            dropout_p=dropout_p, backend=self.backend)
        out = out.transpose(1, 2).reshape(b, t, self.d_out)  # (B, H, T, D) -> (B, T, H, D) -> (B, T, C)
        out = self.out_proj(out)  # (B, T, C) -> (B, T, d_out)
        return (out, weights) if need_weights else out

    def to_torch(self) -> nn.MultiheadAttention:
        """The same layer as a ``torch.nn.MultiheadAttention`` (see :func:`attnkit.modules.convert.to_torch`)."""
        from .convert import to_torch

        return to_torch(self)
