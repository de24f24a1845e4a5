"""One attention call, validated once: what every backend receives.

Legend: B batch, H query heads, G key/value heads (H % G == 0), T queries,
S keys, D head dim (queries and keys), Dv value head dim.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnkit.functional import Visibility, block_visibility, combine_masks, key_padding_to_mask, visible_band
from attnkit.functional.modifiers import Band, MaskMod, MaskModifier, ScoreMod, ScoreModifier, and_masks, modifier_name

from .modifiers import (
    MASK_ARGS,
    SCORE_ARGS,
    PresentKeys,
    additive_bias,
    apply_mask_mod,
    check_geometry,
    check_modifier,
    check_sinks,
    index_grid,
    position_ranges,
    positions_grid,
)


@dataclass(frozen=True)
class AttentionCall:
    """Validated inputs of :func:`attnkit.attention`.

    ``mask`` is 4-d and broadcastable to (B, H, T, S): bool with True = may
    attend, or float (in q's dtype) added to the scores; a key mask given to
    :func:`make_call` is already in it, as (B, 1, 1, S). ``causal`` and
    ``window`` describe the bottom-right aligned band, kept symbolic so that
    kernels can skip blocks instead of reading a (T, S) mask.

    ``score_mod`` and ``mask_mod`` are modifiers in FlexAttention's form (see
    :mod:`attnkit.functional.modifiers`); a call with either is *modified*,
    and its kernels read the band as a mask modifier too
    (:meth:`visibility_mod`). ``sinks`` (H,) are learned sink logits.

    ``q_pos`` (B, T) and ``k_pos`` (B, S), long, are explicit positions (a
    layer's, with a KV cache or packed rows): modifiers then receive them as
    q_idx and kv_idx, the causal / window band is aligned by them, and keys
    at -1 are hidden. A call with positions is modified.
    """

    q: Tensor  # (B, H, T, D)
    k: Tensor  # (B, G, S, D)
    v: Tensor  # (B, G, S, Dv)
    mask: Tensor | None
    causal: bool
    window: int | None
    scale: float
    dropout_p: float
    score_mod: ScoreMod | None = None
    mask_mod: MaskMod | None = None
    sinks: Tensor | None = None  # (H,)
    q_pos: Tensor | None = None  # (B, T) long
    k_pos: Tensor | None = None  # (B, S) long, -1 = no key

    @property
    def modified(self) -> bool:
        """Whether a score or mask modifier (or explicit positions) is given."""
        return self.score_mod is not None or self.mask_mod is not None or self.q_pos is not None

    @property
    def num_heads(self) -> int:
        return self.q.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def num_queries(self) -> int:
        return self.q.shape[2]

    @property
    def num_keys(self) -> int:
        return self.k.shape[2]

    @property
    def offset(self) -> int:
        """S - T: query i is aligned with key i + offset."""
        return self.num_keys - self.num_queries

    @property
    def q_positions(self) -> range:
        """The queries' positions, S - T .. S - 1: the last T of the S key positions."""
        return range(self.offset, self.num_keys)

    @property
    def kv_positions(self) -> range:
        return range(self.num_keys)

    def indices(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(b, h, q_idx, kv_idx) of the whole call, as the modifiers receive them (explicit positions if given)."""
        if self.q_pos is not None and self.k_pos is not None:
            return positions_grid(self.num_heads, self.q_pos, self.k_pos)
        return index_grid(self.q.shape[0], self.num_heads, self.q_positions, self.kv_positions, self.q.device)

    def visibility_mod(self) -> MaskMod | None:
        """The causal / window band as a mask modifier, and-ed with ``mask_mod`` (and, with explicit
        positions, with :class:`PresentKeys`): what a modified call hides."""
        parts: list[MaskMod] = [Band(self.window)] if self.causal else []
        parts += [] if self.mask_mod is None else [self.mask_mod]
        parts += [] if self.q_pos is None else [PresentKeys()]
        if len(parts) < 2:
            return parts[0] if parts else None
        return and_masks(*parts)

    def band(self) -> Tensor | None:
        """The causal / window mask (T, S), True = may attend; None if it hides nothing."""
        return visible_band(range(self.num_queries), range(self.num_keys), offset=self.offset,
                            causal=self.causal, window=self.window, device=self.q.device)

    def band_hides_nothing(self) -> bool:
        """Whether causal / window let every query see every key (e.g. one decoding query)."""
        # slices, not ranges: under torch.compile range() fixes the key count, one graph per cache size
        return block_visibility(slice(0, self.num_queries), slice(0, self.num_keys), offset=self.offset,
                                causal=self.causal, window=self.window) is Visibility.ALL

    def dense_mask(self) -> Tensor | None:
        """The explicit mask and the band as one mask broadcastable to (B, H, T, S).

        In a modified call, the mask modifiers too, evaluated on (T, S), and a
        score modifier's additive bias (a call whose score modifier is not
        additive has no dense mask: ValueError).
        """
        if not self.modified:
            return combine_masks(self.mask, self.band())
        idx = self.indices()
        mask = self.mask
        if self.score_mod is not None:
            additive = additive_bias(self.score_mod)
            if additive is None:
                raise ValueError(f"score_mod {modifier_name(self.score_mod)} is not an additive bias: no dense mask "
                                 "expresses it")
            bias = additive.bias(*idx)  # broadcasts to (B, H, T, S)
            if bias is None:
                raise ValueError(f"score_mod {modifier_name(self.score_mod)} returned no bias")
            mask = bias.to(self.q.dtype) if mask is None else combine_masks(mask, bias.to(self.q.dtype))
        visibility = self.visibility_mod()
        return mask if visibility is None else combine_masks(mask, apply_mask_mod(visibility, idx))

    def may_have_empty_rows(self) -> bool:
        """Whether some query might see no key (then its output must be 0)."""
        return (self.mask is not None or self.mask_mod is not None or self.q_pos is not None
                or (self.causal and self.num_queries > self.num_keys))


_UPCAST = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype attnkit's own kernels compute in: float32 for half-precision inputs, else the input's."""
    return torch.float32 if dtype in _UPCAST else dtype


def _check_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-d, got shape {tuple(t.shape)}; expected q (B, H, T, D), "
                         "k (B, G, S, D), v (B, G, S, Dv)")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    return t


def check_qkv(q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    """q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv): floating point, one dtype and device, shapes that fit."""
    q, k, v = _check_tensor("q", q), _check_tensor("k", k), _check_tensor("v", v)
    if not q.dtype == k.dtype == v.dtype and not stored_narrower(q, k, v):
        raise TypeError(f"q, k, v must share a dtype (or k, v one of {', '.join(map(str, _UPCAST))} under float32 "
                        f"q: a cache storing them in fewer bytes), got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    _check_shapes(q, k, v)
    return q, k, v


def stored_narrower(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether k and v are half-precision under float32 q (keys from a cache that stores fewer bytes)."""
    return q.dtype == torch.float32 and k.dtype == v.dtype and k.dtype in _UPCAST


def widened(call: AttentionCall) -> AttentionCall:
    """``call`` with k and v in q's dtype (every backend computes in one dtype)."""
    if call.k.dtype == call.q.dtype:
        return call
    return replace(call, k=call.k.to(call.q.dtype), v=call.v.to(call.q.dtype))


def _check_shapes(q: Tensor, k: Tensor, v: Tensor) -> None:
    (b, h, t, d), (bk, g, s, dk), (bv, gv, sv, _) = q.shape, k.shape, v.shape
    if not b == bk == bv:
        raise ValueError(f"batch sizes differ: q has B={b}, k has {bk}, v has {bv}")
    if (g, s) != (gv, sv):
        raise ValueError(f"k (B, G={g}, S={s}, D) and v (B, G={gv}, S={sv}, Dv) must agree on G and S")
    if d != dk:
        raise ValueError(f"q has head dim D={d} but k has {dk}; they must match")
    if h == 0:
        raise ValueError("q has H=0 heads; attention needs at least one")
    if g == 0 or h % g:
        raise ValueError(f"q has H={h} heads, k and v have G={g}: H must be a multiple of G")
    if d == 0:
        raise ValueError("q and k have head dim D=0; attention needs D >= 1")
    if t == 0 or s == 0:
        raise ValueError(f"attention needs at least one query and one key, got T={t}, S={s}")


def check_mask(mask: object, q: Tensor, num_keys: int, *, name: str = "mask") -> Tensor | None:
    """A valid mask for q (B, H, T, D) and S keys, made 4-d (float masks in q's dtype); else raise.

    ``name`` is the argument's name in the caller's signature, for the error message.
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = may attend) or float (added to the scores), got {mask.dtype}")
    if mask.device != q.device:
        raise ValueError(f"{name} is on {mask.device} but q is on {q.device}")
    b, h, t, _ = q.shape
    full = (b, h, t, num_keys)
    try:
        broadcast_ok = mask.dim() <= 4 and torch.broadcast_shapes(mask.shape, full) == full
    except RuntimeError:
        broadcast_ok = False
    if not broadcast_ok:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, T, S) = {full}")
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # -> 4-d
    return mask if mask.dtype == torch.bool else mask.to(q.dtype)


_CACHED_NOTE = " (S counts cached positions too, where a KV cache holds some)"


def check_key_mask(key_mask: object, q: Tensor, num_keys: int, *, name: str = "key_mask", keys: str = "S",
                   note: str = _CACHED_NOTE) -> Tensor | None:
    """A (B, S) bool key mask (True = real token) as a mask (B, 1, 1, S); else raise.

    ``keys`` is how the caller names the key axis (the ring's shard length
    is n) and ``note`` what the error adds about it.
    """
    if key_mask is None:
        return None
    b = q.shape[0]
    if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool or key_mask.shape != (b, num_keys):
        got = f"{key_mask.dtype} {tuple(key_mask.shape)}" if isinstance(key_mask, Tensor) else repr(key_mask)
        raise ValueError(f"{name} must be a bool (B, {keys}) = ({b}, {num_keys}) tensor, True = real token{note}; "
                         f"got {got}")
    if key_mask.device != q.device:
        raise ValueError(f"{name} is on {key_mask.device} but q is on {q.device}")
    return key_padding_to_mask(key_mask)  # (B, S) -> (B, 1, 1, S)


def _is_number(x: object) -> bool:
    """A real number: int, float, numpy scalar or a one-element tensor; not a bool."""
    if isinstance(x, Tensor):
        return x.numel() == 1 and x.dtype != torch.bool
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and type(x).__name__ != "bool_"


def check_options(*, causal: object, window: object, dropout_p: object, dropout_name: str = "dropout_p") -> None:
    """Check the options a layer fixes at construction (and :func:`attnkit.attention` on each call)."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int, got window={window!r} (the keys each query sees)")
        if not causal:
            raise ValueError(f"window={window} needs causal=True: each query sees its window most recent keys")
    if not _is_number(dropout_p) or not 0 <= float(dropout_p) < 1:  # type: ignore[arg-type]
        raise ValueError(f"{dropout_name}={dropout_p!r} is outside [0, 1)")


def check_scale(scale: object) -> None:
    """None (1 / sqrt(D)) or a positive finite number that needs no gradient; else raise.

    Not re-checked inside a compiled graph: after recompiles dynamo may trace
    a layer's float scale as a symbolic float, which ``math.isfinite`` cannot
    read (a layer checks its scale when it is built: attnkit.modules.heads.Heads).
    """
    if scale is None or torch.compiler.is_compiling():
        return
    if isinstance(scale, Tensor) and scale.requires_grad:
        raise TypeError("scale must be a number, not a tensor that requires grad (its gradient would be lost); "
                        "for a learnable temperature, multiply q by it and pass scale=1.0")
    if not _is_number(scale) or not (math.isfinite(float(scale)) and float(scale) > 0):  # type: ignore[arg-type]
        raise ValueError(f"scale must be a positive finite number or None, got scale={scale!r}")


def make_call(q: object, k: object, v: object, *, mask: object = None, key_mask: object = None,
              causal: object = False, window: object = None, scale: object = None, dropout_p: object = 0.0,
              score_mod: object = None, mask_mod: object = None, sinks: object = None,
              positions: tuple[Tensor, Tensor] | None = None, mask_name: str = "mask") -> AttentionCall:
    """Validate the arguments of :func:`attnkit.attention`; errors name the offending value.

    ``key_mask`` (B, S) and ``mask`` become one 4-d mask, checked here once.
    ``positions``: explicit (queries (B, T), keys (B, S)) positions, long, as
    a layer knows them (see :class:`AttentionCall`); checked by the layer.
    ``mask_name`` is how the caller calls ``mask`` (a layer's ``attn_mask``).
    """
    q, k, v = check_qkv(q, k, v)
    check_options(causal=causal, window=window, dropout_p=dropout_p)
    check_scale(scale)
    num_keys = k.shape[2]
    checked = combine_masks(check_mask(mask, q, num_keys, name=mask_name), check_key_mask(key_mask, q, num_keys))
    call = AttentionCall(
        q, k, v, checked, bool(causal), window,  # type: ignore[arg-type]
        q.shape[-1] ** -0.5 if scale is None else float(scale),  # type: ignore[arg-type]
        float(dropout_p),  # type: ignore[arg-type]
    )
    if score_mod is None and mask_mod is None and sinks is None and positions is None:
        return call
    return _with_modifiers(call, score_mod, mask_mod, sinks, positions)


def _with_modifiers(call: AttentionCall, score_mod: object, mask_mod: object, sinks: object,
                    positions: tuple[Tensor, Tensor] | None) -> AttentionCall:
    """``call`` with its modifiers, sinks and positions, checked: callables of the right signature fitting its
    geometry."""
    check_modifier(score_mod, "score_mod", SCORE_ARGS)
    check_modifier(mask_mod, "mask_mod", MASK_ARGS)
    q_pos, k_pos = _check_call_positions(positions, call)
    built_in = any(isinstance(fn, (ScoreModifier, MaskModifier)) for fn in (score_mod, mask_mod))
    if built_in and (q_pos is None or not torch.compiler.is_compiling()):  # only built-ins check; spans: a host read
        spans = (call.q_positions, call.kv_positions) if q_pos is None or k_pos is None else position_ranges(
            q_pos, k_pos)
        for fn in (score_mod, mask_mod):
            check_geometry(fn, call.q.shape[0], call.num_heads, *spans)
    return AttentionCall(call.q, call.k, call.v, call.mask, call.causal, call.window, call.scale, call.dropout_p,
                         score_mod, mask_mod, check_sinks(sinks, call.q), q_pos, k_pos)  # type: ignore[arg-type]


def _check_call_positions(positions: tuple[Tensor, Tensor] | None, call: AttentionCall
                          ) -> tuple[Tensor, Tensor] | tuple[None, None]:
    """Explicit (queries (B, T), keys (B, S)) positions, long, on q's device; shapes checked."""
    if positions is None:
        return None, None
    q_pos, k_pos = positions
    b, t, s = call.q.shape[0], call.num_queries, call.num_keys
    for name, pos, shape in (("query positions", q_pos, (b, t)), ("key positions", k_pos, (b, s))):
        if not isinstance(pos, Tensor) or pos.dtype != torch.long or tuple(pos.shape) != shape:
            got = f"{pos.dtype} {tuple(pos.shape)}" if isinstance(pos, Tensor) else type(pos).__name__
            raise ValueError(f"{name} must be a torch.long {shape} tensor, got {got}")
        if pos.device != call.q.device:
            raise ValueError(f"{name} are on {pos.device} but q is on {call.q.device}")
    return q_pos, k_pos
