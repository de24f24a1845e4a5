"""One attention signature, several kernels.

:func:`attention` validates its inputs once (:func:`make_call`) and hands them
to a backend (:func:`run`):

- ``"math"``: explicit scores and softmax, the reference; can return weights
  and every intermediate (:func:`math_intermediates`);
- ``"sdpa"``: PyTorch's fused ``scaled_dot_product_attention`` kernels;
- ``"chunked"``: pure PyTorch online softmax over key blocks with a
  recomputing backward; never materialises (T, S);
- ``"auto"``: math when weights are asked for; chunked when SDPA would need
  a dense mask built from the causal / window band (or from modifiers) of
  more than :data:`DENSE_BAND_LIMIT` (query, key) pairs; otherwise the first
  of :data:`AUTO_ORDER` that can serve the call (SDPA, unless a score
  modifier is more than an additive bias).

Score and mask modifiers take FlexAttention's form (``score_mod(score, b, h,
q_idx, kv_idx)``, ``mask_mod(b, h, q_idx, kv_idx)``, global positions); the
built-ins are in :mod:`attnkit.functional.modifiers`.

A layer's ``backend`` may also be a kernel component (:mod:`.kernel`), such
as the ring of :class:`attnkit.distributed.ContextParallel`, in place of a name.

While an observer is active (:func:`observe`, used by :func:`attnkit.trace`),
every call runs the math backend and the observer receives its intermediates:
whoever calls :func:`attention` (an attnkit layer, a decoder, a Hugging Face
model running on attnkit) is traced the same way.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head dim.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import Tensor

from attnkit.functional.modifiers import MaskMod, ScoreMod

from . import chunked, math, sdpa  # noqa: F401  (each registers itself)
from .call import AttentionCall, check_mask, check_options, make_call, widened
from .kernel import Kernel, KernelRequest, check_kernel
from .math import Intermediates, math_intermediates
from .registry import AUTO_ORDER, BACKENDS, DENSE_BAND_LIMIT, Backend, check_backend, choose, register

Observer = Callable[[AttentionCall, Intermediates], None]
# (thread id, observer) pairs. A plain list, not a ContextVar: torch.compile traces a read of it
# (and guards on it being empty), so compiled layers stay whole graphs while nothing observes.
_OBSERVERS: list[tuple[int, Observer]] = []


@contextmanager
def observe(observer: Observer) -> Iterator[None]:
    """Call ``observer(call, intermediates)`` on every :func:`attention` call in this block.

    Observers nest (each one sees every call) and see only calls made in the
    thread that opened the block. While one is active, calls run the math backend.
    """
    entry = (threading.get_ident(), observer)
    _OBSERVERS.append(entry)
    try:
        yield
    finally:
        _OBSERVERS.remove(entry)


def observed() -> bool:
    """Whether an observer (:func:`observe`) watches this thread's attention calls."""
    return bool(_OBSERVERS) and bool(_active())


def _active() -> list[Observer]:
    me = threading.get_ident()
    return [observer for thread, observer in _OBSERVERS if thread == me]


def run(call: AttentionCall, *, backend: str = "auto", return_weights: bool = False
        ) -> Tensor | tuple[Tensor, Tensor]:
    """Run a validated call (see :func:`make_call`) on ``backend``; the second half of :func:`attention`."""
    if not isinstance(return_weights, bool):
        raise TypeError(f"return_weights must be a bool, got {return_weights!r}")
    chosen = choose(backend, call, return_weights=return_weights)
    observers = _active() if _OBSERVERS else None
    call = widened(call)  # half-precision keys under float32 queries (a cache storing fewer bytes): float32 copies
    if observers:
        steps = math_intermediates(call)
        for observer in observers:
            observer(call, steps)
        return (steps.out, steps.weights.to(call.q.dtype)) if return_weights else steps.out
    if return_weights:
        assert chosen.run_with_weights is not None  # choose() guarantees it
        return chosen.run_with_weights(call)
    return chosen.run(call)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    key_mask: Tensor | None = None,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    sinks: Tensor | None = None,
    backend: str = "auto",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Scaled dot-product attention: softmax(q k^T * scale + mask) v.

    Args:
        q: queries (B, H, T, D).
        k: keys (B, G, S, D), with H a multiple of G: query head h uses
            key/value head h // (H // G) (grouped-query attention; G = 1 is
            multi-query attention).
        v: values (B, G, S, Dv). q, k and v share a dtype, except that
            float32 queries may read bfloat16 or float16 keys and values (a
            cache storing them in fewer bytes), over float32 copies of them.
        mask: bool, True = may attend (the one convention in attnkit), or
            float, added to the scores (-inf blocks). Broadcastable to
            (B, H, T, S), e.g. (T, S) for a pattern shared by the batch.
        key_mask: bool (B, S), True = a real key, False = padding: the common
            padding form, the same as ``mask=key_mask[:, None, None, :]``.
            Both may be given; a key is then visible only if both allow it.
        causal: queries are the last T of the S positions, aligned
            bottom-right: query i sees keys 0 .. S - T + i.
        window: with ``causal``, query i sees only its ``window`` most recent
            keys, itself included.
        scale: multiplies the scores; default 1 / sqrt(D).
        dropout_p: probability of dropping a weight. Applied whenever > 0:
            pass 0 in evaluation (``MultiHeadAttention`` does this for you).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, as
            FlexAttention's: applied to the scaled scores before any mask.
            The indices are long tensors that broadcast against the scores:
            b (B, 1, 1, 1), h (1, H, 1, 1), q_idx (1, 1, T, 1), kv_idx
            (1, 1, 1, S), in global positions (keys 0 .. S - 1, queries the
            last T of them, S - T .. S - 1, as ``causal`` aligns them). It
            must return floating-point scores of the same shape. Tensors it
            closes over that require grad (learned slopes) get gradients.
            Keep it pure: kernels call it per block, again in the backward,
            and once on a (B, H, 1, 1) probe to find those tensors.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = may
            attend; and-ed with ``mask``, ``key_mask``, ``causal`` and
            ``window`` (which become mask modifiers themselves then).
            Built-ins: :mod:`attnkit.functional.modifiers`.
        sinks: (H,) learned sink logits, one per query head (gpt-oss): each
            row's softmax denominator gains exp(sinks[h]), as if a key with
            that score and value 0 were visible to every query; rows then sum
            to less than 1, and a query with no visible key still gets 0.
        backend: "auto", "math", "sdpa", "chunked", or a registered name.
        return_weights: also return the attention weights (B, H, T, S), taken
            after softmax and before dropout (math backend only).

    Returns:
        out (B, H, T, Dv), or (out, weights) with ``return_weights=True``. A
        query with no visible key gets output 0, weights 0 and finite
        gradients, in every backend (modifiers and sinks included). A NaN in a query gives NaN in its row in
        every backend (SDPA's CPU kernel alone would return 0 there; attnkit's
        adapter propagates it). A NaN in k or v may spread further than the
        rows that see it (0 x NaN is NaN), and how far differs by backend:
        a mask does not hide a NaN key or value.
    """
    call = make_call(q, k, v, mask=mask, key_mask=key_mask, causal=causal, window=window, scale=scale,
                     dropout_p=dropout_p, score_mod=score_mod, mask_mod=mask_mod, sinks=sinks)
    return run(call, backend=backend, return_weights=return_weights)


__all__ = [
    "AUTO_ORDER", "BACKENDS", "DENSE_BAND_LIMIT", "AttentionCall", "Backend", "Intermediates", "Kernel",
    "KernelRequest", "Observer", "attention", "check_backend", "check_kernel", "check_mask", "check_options",
    "choose", "make_call", "math_intermediates", "observe", "register", "run",
]
