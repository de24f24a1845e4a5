"""One attention signature, several kernels.

:func:`attention` validates its inputs once and hands them to a backend:

- ``"math"``: explicit scores and softmax, the reference; can return weights;
- ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` kernels;
- ``"chunked"``: pure PyTorch online softmax over key blocks with a
  recomputing backward; never materialises (T, S);
- ``"auto"``: math when weights are asked for, else the first of
  :data:`AUTO_ORDER` that can serve the call.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

from torch import Tensor

from . import chunked, math, sdpa  # noqa: F401  (each registers itself)
from .call import AttentionCall, make_call
from .registry import AUTO_ORDER, BACKENDS, Backend, choose, register


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    backend: str = "auto",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: softmax(q k^T * scale + mask) v.

    Args:
        q: queries (B, H, T, D).
        k: keys (B, G, S, D), with H a multiple of G: query head h uses
            key/value head h // (H // G) (grouped-query attention; G = 1 is
            multi-query attention).
        v: values (B, G, S, Dv).
        mask: bool, True = may attend (the one convention in attnkit), or
            float, added to the scores (-inf blocks). Broadcastable to
            (B, H, T, S), e.g. (B, 1, 1, S) for padded keys.
        causal: queries are the last T of the S positions, aligned
            bottom-right: query i sees keys 0 .. S - T + i.
        window: with ``causal``, query i sees only its ``window`` most recent
            keys, itself included.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: probability of dropping a weight. Applied whenever > 0:
            pass 0 in evaluation (``MultiHeadAttention`` does this for you).
        backend: "auto", "math", "sdpa", "chunked", or a registered name.
        return_weights: also return the attention weights (B, H, T, S), taken
            after softmax and before dropout (math backend only).

    Returns:
        out (B, H, T, Dv), or (out, weights) with ``return_weights=True``. A
        query with no visible key gets output 0, weights 0 and finite
        gradients, in every backend.
    """
    call = make_call(q, k, v, mask=mask, causal=causal, window=window, scale=scale, dropout_p=dropout_p)
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {return_weights!r}")
    chosen = choose(backend, call, return_weights=return_weights)
    if return_weights:
        assert chosen.run_with_weights is not None  # choose() guarantees it
        return chosen.run_with_weights(call)
    return chosen.run(call)


__all__ = ["AUTO_ORDER", "BACKENDS", "AttentionCall", "Backend", "attention", "choose", "make_call", "register"]
