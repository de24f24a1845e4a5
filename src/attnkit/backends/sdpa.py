"""PyTorch's fused ``scaled_dot_product_attention`` (flash / memory-efficient / cuDNN kernels).

What this adapter adds over calling SDPA directly:

- causal alignment is bottom-right (SDPA's ``is_causal`` is top-left, which is
  wrong when T < S): ``is_causal`` is used only where the two agree (T == S),
  a single decoding query needs no mask at all, and other cases get an
  explicit (T, S) band;
- a query with no visible key returns 0 on every PyTorch version and device:
  such rows are opened before the kernel and zeroed after it, so the kernel
  never sees an all-masked row and gradients stay finite;
- a NaN in a query gives NaN in its row, as in the other backends: PyTorch's
  CPU flash kernel (taken when there is no mask) returns 0 there, so on CPU
  the unmasked path checks q for NaN (one read of q; its cost: BENCHMARKS.md,
  "Figures moved from docstrings") and fills the rows;
- grouped-query heads: one decoding query per head is folded into the
  key/value heads (no copy); longer queries expand the key/value heads, faster
  than ``enable_gqa`` on CPU (BENCHMARKS.md);
- modifiers: a mask modifier and an additive score modifier (one with a
  ``bias``, such as ``alibi``) become one dense float mask, when (T, S) is at
  most :data:`DENSE_BAND_LIMIT`; other score modifiers are refused;
- learned sinks: one more key per key/value head, zero key and value, whose
  mask entry is sinks[h]: the same softmax denominator, seen by every query.

Legend: B batch, H query heads, G key/value heads, R = H // G, T queries,
S keys, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.functional import expand_kv
from attnkit.functional.modifiers import modifier_name

from .call import AttentionCall
from .modifiers import additive_bias
from .registry import DENSE_BAND_LIMIT, Backend, register


def _mask_and_flag(call: AttentionCall) -> tuple[Tensor | None, bool]:
    """The attn_mask to pass and whether to pass is_causal=True."""
    t, s = call.q.shape[2], call.k.shape[2]
    if call.modified or call.sinks is not None:
        return call.dense_mask(), False
    if call.band_hides_nothing():  # not causal, or one decoding query with no window: no band at all
        return call.mask, False
    if call.mask is None and call.window is None and call.causal and t == s:
        return None, True  # top-left and bottom-right agree
    return call.dense_mask(), False


def _open_empty_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
    """Let rows with no visible key see every key; return (mask, empty rows (..., T, 1))."""
    if mask.dtype == torch.bool:
        empty = ~mask.any(dim=-1, keepdim=True)
        return mask | empty, empty
    empty = (mask == -torch.inf).all(dim=-1, keepdim=True)
    return mask.masked_fill(empty, 0.0), empty


def _propagate_nan(q: Tensor, out: Tensor) -> Tensor:
    """NaN in the rows of out whose query holds a NaN, as the math and chunked backends give."""
    # under torch.compile or torch.func (vmap), fill unconditionally: no data-dependent branch there
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(q) \
            or bool(q.isnan().any()):
        return out.masked_fill(q.isnan().any(dim=-1, keepdim=True), torch.nan)
    return out


def _sink_key(call: AttentionCall, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(k, v, mask) with one more key: zero key and value, mask entry sinks[h] (float mask (B?, H, T, S + 1))."""
    assert call.sinks is not None
    b, h, t, _ = call.q.shape
    zero = call.k.new_zeros(b, call.num_kv_heads, 1, 1)
    k = torch.cat([call.k, zero.expand(-1, -1, -1, call.k.shape[-1])], dim=2)  # (B, G, S, D) -> (B, G, S + 1, D)
    v = torch.cat([call.v, zero.expand(-1, -1, -1, call.v.shape[-1])], dim=2)  # (B, G, S, Dv) -> (B, G, S + 1, Dv)
    if mask is None:
        mask = call.q.new_zeros(1, 1, t, call.num_keys)
    elif mask.dtype == torch.bool:
        mask = torch.zeros((), dtype=call.q.dtype, device=mask.device).masked_fill(~mask, -torch.inf)
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # a (T, S) band -> (1, 1, T, S)
    mask = mask.expand(mask.shape[0], h, t, call.num_keys)  # (B?, H?, T?, S) -> (B?, H, T, S)
    sink = call.sinks.to(mask.dtype).view(1, h, 1, 1).expand(mask.shape[0], h, t, 1)  # (H,) -> (B?, H, T, 1)
    return k, v, torch.cat([mask, sink], dim=-1)  # (B?, H, T, S + 1)


def sdpa_attention(call: AttentionCall) -> Tensor:
    q, k, v = call.q, call.k, call.v
    mask, is_causal = _mask_and_flag(call)
    if call.sinks is not None:
        k, v, mask = _sink_key(call, mask)
    empty = None
    if mask is not None and call.may_have_empty_rows():
        mask, empty = _open_empty_rows(mask)
    b, h, t, _ = q.shape
    g = call.num_kv_heads
    fold = g != h and t == 1 and (mask is None or mask.shape[1] == 1)
    if fold:
        q = q.reshape(b, g, h // g, q.shape[-1])  # (B, H, 1, D) -> (B, G, R, D): R rows per kv head
    elif g != h:
        k, v = expand_kv(k, h), expand_kv(v, h)  # (B, G, S, D) -> (B, H, S, D)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=call.dropout_p,
                                         is_causal=is_causal, scale=call.scale)
    if fold:
        out = out.reshape(b, h, 1, out.shape[-1])  # (B, G, R, Dv) -> (B, H, 1, Dv)
    if mask is None and q.device.type == "cpu":
        out = _propagate_nan(call.q, out)
    return out if empty is None else out.masked_fill(empty, 0.0)


def sdpa_plan(call: AttentionCall) -> Callable[[AttentionCall], Tensor]:
    """:func:`sdpa_attention` for every call of a step shaped like ``call``, its choices made once: the mask
    and is_causal flag (the step's calls share ``call.mask``: a model's StepContext builds it once), folding
    the query heads, the rows that see no key (opened, then zeroed) and whether to look for NaN queries.
    Calls with modifiers, sinks or dropout keep the full adapter."""
    if call.modified or call.sinks is not None or call.dropout_p > 0:
        return sdpa_attention
    mask, is_causal = _mask_and_flag(call)
    always_fill = torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(call.q)
    empty = None
    if mask is not None and call.may_have_empty_rows():
        mask, empty = _open_empty_rows(mask)
        if not always_fill and not bool(empty.any()):  # one read for the step
            empty = None
    b, h, t, _ = call.q.shape
    g = call.num_kv_heads
    fold = g != h and t == 1 and (mask is None or mask.shape[1] == 1)
    expand = g != h and not fold
    watch_nan = mask is None and call.q.device.type == "cpu"

    def run(c: AttentionCall) -> Tensor:
        q, k, v = c.q, c.k, c.v
        if fold:
            q = q.reshape(b, g, h // g, q.shape[-1])  # (B, H, 1, D) -> (B, G, R, D): R rows per kv head
        elif expand:
            k, v = expand_kv(k, h), expand_kv(v, h)  # (B, G, S, D) -> (B, H, S, D)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=c.scale)
        if fold:
            out = out.reshape(b, h, 1, out.shape[-1])  # (B, G, R, Dv) -> (B, H, 1, Dv)
        if watch_nan and (always_fill or bool(c.q.isnan().any())):
            out = out.masked_fill(c.q.isnan().any(dim=-1, keepdim=True), torch.nan)
        return out if empty is None else out.masked_fill(empty, 0.0)

    return run


def _why_not(call: AttentionCall) -> str | None:
    if call.score_mod is not None and additive_bias(call.score_mod) is None:
        return (f"it applies a score_mod only as an additive bias (a ScoreModifier with a bias, such as alibi), "
                f"and {modifier_name(call.score_mod)} is not one; use 'chunked' or 'math'")
    pairs = call.num_queries * call.num_keys
    if (call.modified or call.sinks is not None) and pairs > DENSE_BAND_LIMIT:
        return (f"its modifiers or sinks would need a dense (T, S) = ({call.num_queries}, {call.num_keys}) mask, more "
                f"than DENSE_BAND_LIMIT = {DENSE_BAND_LIMIT} pairs; use 'chunked'")
    return None


register(Backend(name="sdpa", run=sdpa_attention, why_not=_why_not, plan=sdpa_plan))
