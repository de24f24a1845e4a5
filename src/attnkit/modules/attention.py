"""The production multi-head self-attention layer.

Notation (shape comments): B batch, T queries, S keys (T + cached positions),
H query heads, G key/value heads, D head dim, C = H * D (= d_out unless
:class:`Heads` gives D).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from attnkit.backends import AttentionCall, observed
from attnkit.backends.kernel import Kernel, KernelRequest, check_kernel
from attnkit.backends.modifiers import MASK_ARGS, SCORE_ARGS, check_modifier
from attnkit.functional import RotaryEmbedding, position_mask
from attnkit.functional.modifiers import MaskMod, ScoreMod, and_masks, modifier_name
from attnkit.functional.rope import apply_rotary

from .cache_protocol import Cache, CachedKeys, PackedKeys, check_cache, check_positions, transaction
from .context import StepContext
from .cross import check_torch_form, torch_multihead
from .heads import AttentionHeads, Heads, Modifiers, factory_kwargs


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


def _check_qk_norm(qk_norm: object) -> nn.Module | None:
    """An nn.Module whose forward takes (q, k); a single norm (forward(x)) is refused with what to wrap it in."""
    if qk_norm is None:
        return None
    if not isinstance(qk_norm, nn.Module) or _positional_arity(qk_norm.forward) < 2:
        raise TypeError(f"qk_norm must be an nn.Module whose forward(q, k) returns (q, k), such as "
                        f"attnkit.functional.QKNorm(q_norm, k_norm) (one norm for each); got "
                        f"{type(qk_norm).__name__}")
    return qk_norm


def _positional_arity(fn: object) -> int:
    """How many positional arguments ``fn`` accepts (a large number for *args)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 2  # no signature to read: let the call decide
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _bind_learned_after_load(layer: MultiHeadAttention, _: object) -> None:
    """``load_state_dict``'s post-hook: ``assign=True`` replaced the layer's parameter objects."""
    layer._bind_learned()


class MultiHeadAttention(AttentionHeads):
    """Multi-head self-attention with a fused projection, GQA, RoPE, windows and a KV cache.

    Args:
        d_in: size of each input token.
        d_out: size of the output, split into ``num_heads`` heads of
            ``head_dim = d_out // num_heads``.
        num_heads: query heads (H), or a :class:`Heads` that also gives the
            key/value heads, a head size of its own (``out_proj`` then maps
            H * head_dim to d_out) and the scale of the scores.
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
        qk_norm: a component that normalises each head's queries and keys
            after the projection, before the rotary embedding:
            ``qk_norm(q, k) -> (q, k)``, e.g.
            :class:`~attnkit.functional.norm.QKNorm` of two RMSNorms (Gemma 3).
        score_mod: a score modifier in FlexAttention's form,
            ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (e.g.
            ``alibi(H)``, ``softcap(50.0)`` from
            :mod:`attnkit.functional.modifiers`), applied on every call at the
            tokens' true positions: what a KV cache holds and explicit
            ``positions`` included, so cached decoding gives what the full
            forward gives. An ``nn.Module`` modifier is registered as a
            submodule (its parameters train and save with the layer).
        mask_mod: a mask modifier, ``mask_mod(b, h, q_idx, kv_idx) -> bool``
            (True = may attend; e.g. ``prefix_lm(n)``, ``sink_window(4, 1024)``),
            and-ed with ``causal`` / ``window`` and with any ``mask_mod`` given
            to :meth:`forward`.
        sinks: sink logits (H,), one per query head, in every softmax
            denominator (gpt-oss): an ``nn.Parameter`` trains with the layer
            (:meth:`reset_parameters` sets it to 0), another tensor is a fixed
            buffer; either is the layer's own copy, on its device and dtype.
            A built-in modifier's ``nn.Parameter`` (``alibi(slopes=...)``,
            ``softcap(cap)``) becomes the layer's own copy too, registered as
            ``score_mod_slopes`` etc.: it trains, saves, loads (``assign=True``
            included), moves and resets (to the value given) with the layer.
        backend: kernel for :func:`attnkit.attention` ("auto", "sdpa",
            "chunked", "math"; asking for weights uses "math" under "auto"),
            or a kernel component (:mod:`attnkit.backends.kernel`) such as
            :class:`attnkit.distributed.ContextParallel`, which runs the
            layer on a shard of the sequence (ring attention).
        device, dtype: where and how the parameters are created, as for
            ``nn.Linear`` (``device="meta"``, then ``to_empty()`` and
            :meth:`reset_parameters`, builds a large model without memory).

    Parameters: one fused ``qkv_proj`` (d_in -> (H + 2G) * D; rows are
    queries, then keys, then values), ``out_proj`` (H * D -> d_out) and those
    of ``qk_norm``. There is no length limit and no (T, T) buffer. For
    attention to another sequence, see :class:`attnkit.CrossAttention`.
    TorchScript is not supported; ``torch.compile`` is.
    """

    def __init__(self, d_in: int, d_out: int, num_heads: int | Heads, *, num_kv_heads: int | None = None,
                 causal: bool = True, dropout: float = 0.0, qkv_bias: bool = False, out_bias: bool = True,
                 rope: bool | RotaryEmbedding = False, window: int | None = None, qk_norm: nn.Module | None = None,
                 score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None, sinks: Tensor | None = None,
                 backend: str | Kernel = "auto", device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        factory = factory_kwargs(device, dtype)
        super().__init__(d_in, d_out, num_heads, num_kv_heads=num_kv_heads, causal=causal, window=window,
                         dropout=dropout, out_bias=out_bias, backend=backend, factory=factory)
        self.rope = _make_rope(rope, self.head_dim)
        self.qk_norm = _check_qk_norm(qk_norm)
        check_modifier(score_mod, "score_mod", SCORE_ARGS)
        check_modifier(mask_mod, "mask_mod", MASK_ARGS)
        self._learned: dict[str, tuple[str, str, Tensor]] = {}  # parameter -> (modifier, attribute, initial value)
        self.score_mod = self._own_learned("score_mod", score_mod, factory)  # an nn.Module: a submodule
        self.mask_mod = self._own_learned("mask_mod", mask_mod, factory)
        self.register_load_state_dict_post_hook(_bind_learned_after_load)
        self.sinks: Tensor | None
        if isinstance(sinks, nn.Parameter):  # learned: trains with the layer, made where its parameters are
            self.sinks = nn.Parameter(_check_layer_sinks(sinks, self.num_heads).detach().to(**factory))
        elif sinks is not None:  # fixed: a buffer of the layer's own (state_dict, .to())
            self.register_buffer("sinks", _check_layer_sinks(sinks, self.num_heads).detach().to(**factory).clone())
        else:
            self.sinks = None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(d_in, q_size + 2 * kv_size, bias=qkv_bias, **factory)
        self._sizes = (q_size, kv_size, kv_size)
        self._width = q_size + 2 * kv_size

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        mods = "".join(f", {name}={modifier_name(fn)}" for name, fn in (("score_mod", self.score_mod),
                                                                          ("mask_mod", self.mask_mod))
                       if fn is not None and not isinstance(fn, nn.Module))
        sinks = "" if self.sinks is None else f", sinks=({self.num_heads},)"
        return (f"{self._heads_repr()}, causal={self.causal}{window}{mods}{sinks}, dropout={self.dropout}, "
                f"backend={self.backend!r}")

    def _own_learned(self, name: str, fn: Any, factory: dict[str, Any]) -> Any:
        """``fn``, or where it holds ``nn.Parameter``s (``alibi(slopes=nn.Parameter(...))``, a learned
        ``softcap``) a copy of it whose parameters are the layer's own, made as sinks are (on the layer's
        device and dtype) and registered as ``{name}_{attribute}``. (Registering the caller's objects
        left the modifier reading them after ``load_state_dict(assign=True)`` replaced the layer's, and
        garbage after ``device="meta"``, ``to_empty()`` and :meth:`reset_parameters`.)"""
        if fn is None or isinstance(fn, nn.Module) or not hasattr(fn, "__dict__"):
            return fn
        learned = {a: v for a, v in vars(fn).items() if isinstance(v, nn.Parameter)}
        if not learned:
            return fn
        own = copy.copy(fn)
        for attribute, value in learned.items():
            key = f"{name}_{attribute}"
            self.register_parameter(key, nn.Parameter(value.detach().to(**factory).clone()))
            self._learned[key] = (name, attribute, value.detach().clone())
            object.__setattr__(own, attribute, getattr(self, key))
        return own

    def _bind_learned(self) -> None:
        """Point the modifiers' learned attributes at the layer's parameters (which ``load_state_dict(...,
        assign=True)`` and ``swap_tensors`` conversions replace)."""
        for key, (name, attribute, _) in self._learned.items():
            fn = getattr(self, name, None)
            if fn is not None and getattr(fn, attribute) is not getattr(self, key):
                object.__setattr__(fn, attribute, getattr(self, key))

    def _apply(self, fn: Any, recurse: bool = True) -> MultiHeadAttention:
        super()._apply(fn, recurse)
        self._bind_learned()
        return self

    def reset_parameters(self) -> None:
        """Re-initialise the projections and components as the constructor does; learned sinks to 0 and a
        modifier's learned parameters to the values it was given."""
        super().reset_parameters()
        with torch.no_grad():
            if isinstance(self.sinks, nn.Parameter):
                self.sinks.zero_()
            for key, (_, _, initial) in self._learned.items():
                getattr(self, key).copy_(initial)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries (B, H, T, D), keys and values (B, G, T, D): q and k normalised by ``qk_norm``, not rotated."""
        qkv = self.qkv_proj(x)  # (B, T, d_in) -> (B, T, (H+2G)D)
        if qkv.shape[-1] != self._width or qkv.dtype != x.dtype:
            self._refuse_projection(qkv, x)
        q, k, v = qkv.split(self._sizes, dim=-1)  # (B, T, (H+2G)D) -> 3 parts
        q, k, v = self.split(q, self.num_heads), self.split(k, self.num_kv_heads), self.split(v, self.num_kv_heads)
        if self.qk_norm is not None:
            shapes = q.shape, k.shape
            q, k = self.qk_norm(q, k)  # per head, over D: (B, H, T, D), (B, G, T, D)
            if (q.shape, k.shape) != shapes:
                raise ValueError(f"qk_norm must return q and k in their shapes {tuple(shapes[0])} and "
                                 f"{tuple(shapes[1])}, got {tuple(q.shape)} and {tuple(k.shape)}")
        return q, k, v

    def forward(self, x: Tensor, *, positions: Tensor | None = None, key_mask: Tensor | None = None,
                attn_mask: Tensor | None = None, kv_cache: Cache | None = None, need_weights: bool = False,
                mask_mod: MaskMod | None = None, context: StepContext | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """Attend from x (B, T, d_in) to itself (and to what ``kv_cache`` holds).

        Args:
            positions: long (B, T), each token's position: rotary embedding
                rotates each row at its own positions, and the causal band
                (and window) is aligned by them, so rows at different
                positions each get what they would get alone. None: 0 .. T - 1,
                or after what the cache holds (or where a kernel component
                such as ContextParallel places this shard's tokens).
            key_mask: bool (B, S), True where a key is a real token (False =
                padding). With a KV cache, S counts the cached positions too.
            attn_mask: bool (True = may attend) or float (added to the
                scores), broadcastable to (B, H, T, S).
            kv_cache: a cache for this layer (:class:`KVCache`,
                :class:`StaticKVCache`, or anything implementing the protocol of
                :mod:`attnkit.modules.cache_protocol`); the new keys and values are
                stored in it and attention covers all it holds. A call that
                raises leaves the cache as it was.
            need_weights: also return the weights (B, H, T, S).
            mask_mod: a mask modifier for this call alone (e.g. a
                ``document_mask`` of packed sequences), and-ed with the
                layer's; it reads the same positions as the layer's modifiers.
            context: a step of a model that checked its inputs
                (:class:`~attnkit.modules.context.StepContext`): positions,
                padding, angles and band come from it and nothing is checked
                here (only ``x`` and ``kv_cache`` are read besides it).

        Returns: (B, T, d_out), or (output, weights) with ``need_weights``.
        """
        if context is not None:
            return self._step(x, context, kv_cache)
        if isinstance(self.backend, str):
            mods = self._checked(x, mask_mod)
        else:  # the kernel checks the call (on every rank) and may place its tokens
            mods, failure = None, None
            try:
                mods = self._checked(x, mask_mod)
            except (TypeError, ValueError) as err:  # told to the kernel: a ring's other ranks would wait on this one
                failure = err
            check_kernel(self.backend, modifiers=mods is not None)  # also when set after construction
            request = self._request(x, positions, attn_mask, kv_cache, need_weights, failure)
            placed = self.backend.prepare(request)
            if failure is not None:
                raise failure
            positions = positions if placed is None else placed
        b, t, _ = x.shape
        if positions is not None:
            positions = check_positions(positions, b, t)
        q, k, v = self.project(x)
        if kv_cache is None:
            q, k = self._rotate(q, k, 0 if positions is None else positions)
            return self._attend(q, CachedKeys(k, v, positions), 0 if positions is None else positions,
                                key_mask, attn_mask, need_weights, mods)
        cache = check_cache(kv_cache)
        with transaction([cache], [self]):
            at = cache.next_positions(b, t, x.device) if positions is None else positions  # int: a plain prefix
            q, k = self._rotate(q, k, at)
            keys = cache.update(k, v, at if isinstance(at, Tensor) else None)  # (B, G, S, D)
            return self._attend(q, keys, at, key_mask, attn_mask, need_weights, mods)

    def _refuse_projection(self, qkv: Tensor, x: Tensor) -> None:
        raise ValueError(f"qkv_proj ({type(self.qkv_proj).__name__}) gave {qkv.dtype} (..., {qkv.shape[-1]}) "
                         f"for {x.dtype} input; the layer needs {x.dtype} (..., {self._width})")

    def _step(self, x: Tensor, ctx: StepContext, cache: Cache | None) -> Tensor:
        """One step of a checked model: project, rotate at the step's positions, store, attend. No checks."""
        if not isinstance(self.backend, str):  # a kernel component places and checks its own calls
            return self.forward(x, positions=ctx.positions, key_mask=ctx.key_mask, kv_cache=cache)  # type: ignore
        b, t, _ = x.shape
        h, g, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (B, T, d_in) -> (B, T, (H+2G)D)
        if qkv.shape[-1] != self._width or qkv.dtype != x.dtype:  # a module swap the layer cannot run
            self._refuse_projection(qkv, x)
        q, k, v = qkv[..., : h * d], qkv[..., h * d : (h + g) * d], qkv[..., (h + g) * d :]  # 3 parts
        q = q.view(b, t, h, d).transpose(1, 2)  # (B, T, H * D) -> (B, H, T, D)
        k = k.view(b, t, g, d).transpose(1, 2)  # (B, T, G * D) -> (B, G, T, D)
        v = v.view(b, t, g, d).transpose(1, 2)
        if self.qk_norm is not None:
            q, k = self.qk_norm(q, k)  # per head, over D
        if self.rope is not None:
            cos, sin = ctx.angles(self.rope, t, q.dtype, q.device)  # (T, D) or (B, 1, T, D)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            keys: CachedKeys | PackedKeys = CachedKeys(k, v, ctx.positions)
        else:  # a model's forward checks what its caller's caches are handed; its step writes raw
            keys = (cache.update if ctx.check_caches else cache.write)(k, v, ctx.positions)
        plain = self.window is None and self.score_mod is None and self.mask_mod is None and self.sinks is None
        if not (plain and type(keys) is CachedKeys):  # windows trim keys, modifiers read positions, packed keys
            at = ctx.offset if ctx.positions is None else ctx.positions
            return self._attend(q, keys, at, ctx.key_mask, None, False, self._modifiers(None))  # type: ignore
        aligned = ctx.positions is None and keys.positions is None  # a plain prefix: the kernel aligns the band
        mask = None if aligned and ctx.key_mask is None else ctx.mask(keys.positions, keys.k.shape[2],
                                                                      causal=self.causal)  # (B, 1, T?, S)
        call = AttentionCall(q, keys.k, keys.v, mask, self.causal and aligned, None, self.scale,
                             self.dropout if self.training else 0.0)
        return self.merge(ctx.kernel(self.backend, call)(call))  # (B, H, T, D) -> (B, T, d_out)

    def _modifiers(self, mask_mod: MaskMod | None) -> Modifiers | None:
        """The layer's modifiers and sinks, with this call's mask modifier and-ed in; None if there are none."""
        if mask_mod is None and self.score_mod is None and self.mask_mod is None and self.sinks is None:
            return None  # the common case, once per layer and step
        if mask_mod is not None and self.mask_mod is not None:
            mask_mod = and_masks(self.mask_mod, mask_mod)
        mods = Modifiers(self.score_mod, self.mask_mod if mask_mod is None else mask_mod, self.sinks)
        return None if mods.empty else mods

    def _checked(self, x: object, mask_mod: MaskMod | None) -> Modifiers | None:
        """Check ``x`` and the call's ``mask_mod``; the call's modifiers (None: none)."""
        self.check_x(x)
        check_modifier(mask_mod, "mask_mod", MASK_ARGS)
        return self._modifiers(mask_mod)

    def _request(self, x: Tensor, positions: object, attn_mask: object, kv_cache: object,
                 need_weights: object, failure: Exception | None = None) -> KernelRequest:
        """This call, described to a kernel component before anything is computed (``failure``: why the
        layer's own checks refused it; then ``x`` may be anything)."""
        given = {"positions": positions is not None, "kv_cache": kv_cache is not None,
                 "attn_mask": attn_mask is not None, "need_weights": need_weights is not False}
        sized = isinstance(x, Tensor) and x.dim() == 3
        return KernelRequest(batch=x.shape[0] if sized else 0, length=x.shape[1] if sized else 0,
                             device=x.device if isinstance(x, Tensor) else self.activation.device,
                             causal=self.causal, window=self.window, dropout_p=self.dropout if self.training else 0.0,
                             given=tuple(name for name, was_given in given.items() if was_given),
                             problem=None if failure is None else str(failure))

    def _rotate(self, q: Tensor, k: Tensor, positions: int | Tensor) -> tuple[Tensor, Tensor]:
        """q (B, H, T, D) and k (B, G, T, D) rotated at offset .. offset + T - 1, or at positions (B, T)."""
        if self.rope is None:
            return q, k
        if isinstance(positions, int):
            return self.rope(q, k, offset=positions)
        return self.rope(q, k, positions=positions)  # each row at its own positions

    def _attend(self, q: Tensor, keys: CachedKeys | PackedKeys, positions: int | Tensor, key_mask: Tensor | None,
                attn_mask: Tensor | None, need_weights: bool, mods: Modifiers | None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """Attention over what the cache handed back; the band from positions when they are explicit.

        A kernel component attends by the positions its ``prepare`` gave (it knows the band itself).
        With a sliding window, keys no query may see (all but the last window
        of a long cache) are left out before attention instead of masked, so a
        decoding step reads window keys, not the whole cache (unless weights
        over every key are asked for, or under torch.compile with explicit
        positions, where finding them would synchronise). With modifiers,
        every key stays (they read positions) and explicit positions go to
        :func:`attnkit.attention` itself, which aligns the band by them.
        Keys a cache holds packed (:class:`~attnkit.modules.cache_protocol.PackedKeys`)
        are read by the cache's own kernel where it serves the call, else dequantised.
        """
        if not isinstance(keys, CachedKeys):
            if self._reads_packed(q, keys, key_mask, attn_mask, need_weights, mods):
                visible = self._visible(q, keys, positions, key_mask)  # (B, 1, T, S) or None
                return self.merge(keys.attention(q, self.scale, visible))  # (B, H, T, D) -> (B, T, d_out)
            keys = keys.dequantized(q.dtype)
        if not isinstance(self.backend, str):
            return self.attend_with(self.backend, q, keys.k, keys.v, key_mask=key_mask, modifiers=mods)
        b, _, t, _ = q.shape
        k, v, s = keys.k, keys.v, keys.k.shape[2]
        modified = mods is not None and mods.modified
        plain_keys = key_mask is None or (isinstance(key_mask, Tensor) and key_mask.shape == (b, s))
        trim = self.causal and attn_mask is None and not need_weights and plain_keys and not modified
        w = self.window if trim else None  # the window whose hidden keys may be left out
        if keys.positions is None and not isinstance(positions, Tensor):  # a plain prefix: the symbolic band
            if w is not None and s > w + t - 1:  # keys before the last window + T - 1 are hidden from every query
                first = s - (w + t - 1)
                k, v, key_mask = k[:, :, first:], v[:, :, first:], _keys_from(key_mask, first)  # (B, G, S', D)
            return self.attend(q, k, v, key_mask=key_mask, attn_mask=attn_mask, need_weights=need_weights,
                               modifiers=mods)
        q_pos, k_pos = _explicit_positions(q, positions, keys.positions, s)  # (B, T), (B, S)
        if modified:  # the modifiers and the band read the positions themselves
            return self.attend(q, k, v, key_mask=key_mask, attn_mask=attn_mask, need_weights=need_weights,
                               modifiers=mods, positions=(q_pos, k_pos))
        band = position_mask(q_pos, k_pos, causal=self.causal, window=self.window)  # (B, 1, T, S)
        # compiling first: s > 2 * w on a symbolic key count would split the compiled step's graph in two
        if not torch.compiler.is_compiling() and w is not None and s > 2 * w:
            first = int(band.any(dim=(0, 1, 2)).int().argmax())  # the first key any query may see (one sync)
            k, v, band, key_mask = k[:, :, first:], v[:, :, first:], band[..., first:], _keys_from(key_mask, first)
        return self.attend(q, k, v, key_mask=key_mask, attn_mask=attn_mask, need_weights=need_weights, band=band,
                           modifiers=mods)

    def _reads_packed(self, q: Tensor, keys: PackedKeys, key_mask: Tensor | None, attn_mask: Tensor | None,
                      need_weights: bool, mods: Modifiers | None) -> bool:
        """Whether the cache's kernel serves this call: a backend by name, nothing but positions, a window and
        padding to apply, no trace watching, and a call its kernel is made for (``keys.reads_directly``)."""
        plain_keys = key_mask is None or (isinstance(key_mask, Tensor) and key_mask.dtype == torch.bool
                                          and key_mask.shape == (q.shape[0], keys.length))
        return (isinstance(self.backend, str) and mods is None and attn_mask is None and not need_weights
                and plain_keys and not (self.training and self.dropout > 0) and not observed()
                and keys.reads_directly(q))

    def _visible(self, q: Tensor, keys: PackedKeys, positions: int | Tensor,
                 key_mask: Tensor | None) -> Tensor | None:
        """Which held key each query may see, bool (B, 1, T, S), from the band and padding; None: every key."""
        t, s = q.shape[2], keys.length
        prefix = keys.positions is None and not isinstance(positions, Tensor)
        if prefix and key_mask is None and self.window is None and (t == 1 or not self.causal):
            return None  # the last query of a plain prefix sees every key
        q_pos, k_pos = _explicit_positions(q, positions, keys.positions, s)  # (B, T), (B, S)
        visible = position_mask(q_pos, k_pos, causal=self.causal, window=self.window)  # (B, 1, T, S)
        return visible if key_mask is None else visible & key_mask[:, None, None, :]  # (B, 1, T, S)

    def torch_problems(self) -> list[str]:
        """What ``torch.nn.MultiheadAttention`` cannot express of this layer (beyond what the converter checks)."""
        norm = [] if self.qk_norm is None else [f"a norm of queries and keys ({type(self.qk_norm).__name__})"]
        mods = [f"a {name} ({modifier_name(fn)})" for name, fn in (("score_mod", self.score_mod),
                                                                  ("mask_mod", self.mask_mod)) if fn is not None]
        sinks = [] if self.sinks is None else ["learned sinks"]
        return super().torch_problems() + norm + mods + sinks

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The same layer as a ``torch.nn.MultiheadAttention`` (see :func:`attnkit.modules.convert.to_torch`)."""
        if self.rope is not None or self.window is not None:
            raise ValueError("torch.nn.MultiheadAttention has no rotary embedding or sliding window")
        check_torch_form(self, batch_first)
        e = self.d_out
        w_q, w_kv = self.qkv_proj.weight.split([e, 2 * e])  # (3E, E) -> (E, E), (2E, E)
        return torch_multihead(self, w_q, w_kv, self.qkv_proj.bias, kdim=None, batch_first=batch_first)


def _check_layer_sinks(sinks: object, num_heads: int) -> Tensor:
    """A floating-point (H,) tensor: one sink logit per query head."""
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point() or tuple(sinks.shape) != (num_heads,):
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a floating-point (num_heads,) = ({num_heads},) tensor (an nn.Parameter to "
                         f"learn them), one logit per query head; got {got}")
    return sinks


def _explicit_positions(q: Tensor, positions: int | Tensor, key_positions: Tensor | None,
                        s: int) -> tuple[Tensor, Tensor]:
    """The queries' positions (B, T) and the keys' (B, S): given, or a plain prefix spelled out (queries from
    the offset ``positions``, key j at position j)."""
    b, _, t, _ = q.shape
    q_pos = positions if isinstance(positions, Tensor) else (positions + torch.arange(t, device=q.device)).expand(
        b, t)  # (B, T)
    k_pos = key_positions if key_positions is not None else torch.arange(s, device=q.device).expand(b, s)  # (B, S)
    return q_pos, k_pos


def _keys_from(key_mask: Tensor | None, first: int) -> Tensor | None:
    """key_mask (B, S) without its first ``first`` keys: (B, S - first)."""
    return None if key_mask is None else key_mask[:, first:]
