"""A constant-memory KV cache for endless generation: attention sinks and a recent window (StreamingLLM).

Xiao et al. (2023), "Efficient Streaming Language Models with Attention
Sinks": a model trained on a finite context keeps its perplexity far past
that context when every query sees the first few tokens (the *sinks*, where
softmax parks the weight no other key claims) and a window of recent tokens,
the middle being forgotten. Positions are those *inside the cache*: the sinks
sit at 0 .. sinks - 1 and the window right after them, so no query ever sees
a distance longer than the cache, whatever the number of tokens generated.

attnkit's layer rotates a key (RoPE) at its position before handing it to
the cache, so when the oldest ``e`` window keys are evicted the ones left
move ``e`` places to the left and are rotated by ``-e`` (rotations compose:
R(p - e) = R(-e) R(p)). Eviction happens a chunk at a time, so the window is
re-rotated once per ``chunk`` tokens, not at every token. Keys stay
contiguous ``[sinks | window]``: the cache hands back a plain prefix
(positions None, :meth:`SinkCache.next_positions` an int) and every kernel
keeps its fast path.

    caches = [SinkCache(sinks=4, window=1020, rope=block.attention.rope) for block in model.layers]
    model.generate(ids, cache="sink:4,1020", max_new_tokens=20_000)   # the same, built by the loop

Legend: B batch, G key/value heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from attnkit.functional import RotaryEmbedding

from .kv_cache import CachedKeys, _Ownership


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SinkCache {name} must be an int >= 1, got {name}={value!r}")
    return value


class SinkCache(_Ownership):
    """Keys and values of one layer: the first ``sinks`` tokens and a recent window, the middle evicted.

    Args:
        sinks: the first tokens, kept for good (in-cache positions 0 .. sinks - 1).
        window: every query sees at least its ``window`` most recent tokens,
            itself included, besides the sinks.
        rope: the layer's rotary embedding (``layer.rope``), used to rotate the
            keys left in the window back to their new positions after an
            eviction; None for a layer without one (then only the order of the
            keys moves). Required, so that forgetting it is not silent.
        chunk: window keys evicted at once (the re-rotation cost is paid once
            per ``chunk`` tokens).

    Each call's queries see the sinks and between ``window`` and ``window +
    chunk - 1`` recent tokens (more for a call of more than ``chunk`` tokens,
    which sees all the tokens of the call). The cache holds at most
    :attr:`capacity` = ``sinks + window + chunk - 1`` keys while calls bring at
    most ``chunk`` tokens; a longer call (a long prompt in one piece) is stored
    whole and the next call shrinks the cache back. Generation feeds a long
    prompt in pieces for that reason (:mod:`attnkit.models.generation`).

    Positions are assigned by the cache (a plain prefix): explicit positions,
    and so rows at different positions (left padding), are refused; what reads
    positions (the causal band, a layer's score or mask modifiers) reads these
    in-cache positions. ``len(cache)``
    is the number of keys held, ``cache.seen`` the number of tokens stored
    since the last :meth:`reset`; ``cache.keys`` / ``cache.values`` are views
    of what is held. Held keys are constants: gradients reach only those of
    the current call.
    """

    _kind = "SinkCache"

    def __init__(self, *, sinks: int = 4, window: int = 1020, rope: RotaryEmbedding | None, chunk: int = 64) -> None:
        self.sinks, self.window, self.chunk = _count("sinks", sinks), _count("window", window), _count("chunk", chunk)
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"SinkCache rope must be the layer's RotaryEmbedding (layer.rope) or None for a layer "
                            f"without one, got {type(rope).__name__}")
        self.rope = rope
        self._k: Tensor | None = None  # (B, G, allocated, D)
        self._v: Tensor | None = None  # (B, G, allocated, Dv)
        self._length = 0
        self.seen = 0
        self._owner: int | None = None

    @property
    def capacity(self) -> int:
        """The most keys held while every call brings at most ``chunk`` tokens."""
        return self.sinks + self.window + self.chunk - 1

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (f"SinkCache(sinks={self.sinks}, window={self.window}, chunk={self.chunk}, len={self._length}, "
                f"seen={self.seen})")

    @property
    def keys(self) -> Tensor | None:
        """The keys held (B, G, S, D), rotated at their in-cache positions 0 .. S - 1; None before the first call."""
        return None if self._k is None else self._k[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """The values held (B, G, S, Dv); None before the first call."""
        return None if self._v is None else self._v[:, :, : self._length]

    @property
    def allocated(self) -> int:
        """Slots of storage held (keys and values each): :attr:`capacity` once full, unless a longer call came."""
        return 0 if self._k is None else self._k.shape[2]

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles belong to no layer yet."""
        return {**self.__dict__, "_owner": None}

    def reset(self) -> None:
        """Forget every token and the layer the cache belonged to (keeps no storage)."""
        self._k = self._v = None
        self._length = self.seen = 0
        self._owner = None

    def claim(self, owner: object) -> tuple[Any, ...]:
        """Mark ``owner`` as this cache's writer (or raise if another layer is); return a checkpoint.

        An eviction writes new storage and an append writes past what is held,
        so the checkpoint's tensors stay valid: :meth:`restore` only puts them back.
        """
        layers_rope = getattr(owner, "rope", self.rope)  # a layer has one (None without rotary embeddings)
        if layers_rope is not self.rope:  # an eviction would rotate the keys by another rotation, silently
            raise ValueError(f"this SinkCache rotates evicted keys with {self.rope!r} but the layer writing to it "
                             f"({type(owner).__name__}) rotates them with {layers_rope!r}: build the cache with "
                             "rope=layer.rope (None only for a layer without rotary embeddings)")
        before = self._claim_owner(owner)
        return (self._length, self.seen, before, self._k, self._v)

    def restore(self, checkpoint: tuple[Any, ...]) -> None:
        """Go back to the state :meth:`claim` saved (evictions and appends since are undone)."""
        self._length, self.seen, self._owner, self._k, self._v = checkpoint

    def evicted_before(self, length: int) -> int:
        """How many window keys a call of ``length`` tokens evicts first (0 while there is room).

        A call evicts when the window would pass ``window + chunk - 1`` keys,
        keeping the ``window - 1`` most recent, so that the call's first query
        still sees ``window`` tokens.
        """
        in_window = max(self._length - self.sinks, 0)
        if in_window + length <= self.window + self.chunk - 1:
            return 0
        return max(in_window - (self.window - 1), 0)

    def next_positions(self, batch: int, length: int, device: torch.device) -> int:
        """Where a call of ``length`` tokens starts: after what is held once this call's eviction is done."""
        return self._length - self.evicted_before(length)

    def check(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for k, v (B, G, T, D) this cache cannot take: explicit positions, another shape,
        dtype or device, keys of another head size than its rotary embedding's."""
        if positions is not None:
            raise ValueError("SinkCache assigns positions inside the cache (sinks at 0 .. sinks - 1, the window "
                             "right after), so it takes no explicit positions: call the layer without positions "
                             "(every row at the same position: no left padding); use KVCache for rows at "
                             "different positions")
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, G, T, D) and agree on B, G, T; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if self.rope is not None and k.shape[3] != self.rope.head_dim:
            raise ValueError(f"SinkCache rope has head_dim={self.rope.head_dim} but the keys have D={k.shape[3]}: "
                             "give the cache its own layer's rotary embedding")
        if self._k is None or self._v is None:
            return
        held, new = (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3]), (
            k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if held != new:
            raise ValueError(f"this SinkCache holds (B, G, D, Dv)={held} but got {new}; "
                             "call cache.reset() before a new sequence")
        if (k.dtype, k.device) != (self._k.dtype, self._k.device):
            raise ValueError(f"this SinkCache holds {self._k.dtype} on {self._k.device}, "
                             f"got {k.dtype} on {k.device}")

    def _storage(self, size: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Empty keys and values (B, G, size, D), (B, G, size, Dv) of k's and v's dtype and device."""
        b, g, _, d = k.shape
        return k.new_empty(b, g, size, d), v.new_empty(b, g, size, v.shape[3])

    def _shifted(self, keys: Tensor, by: int) -> Tensor:
        """Window keys (B, G, n, D) moved ``by`` places left: rotated by -by (rotations compose)."""
        if self.rope is None:
            return keys
        compute = torch.promote_types(keys.dtype, torch.float32)  # half precision would round once per chunk
        moved = self.rope.rotate(keys.to(compute), torch.tensor([-by], device=keys.device))  # (B, G, n, D)
        return moved.to(keys.dtype)

    def _evict(self, evicted: int, needed: int, k: Tensor, v: Tensor) -> None:
        """New storage of the sinks and the window without its ``evicted`` oldest keys, re-rotated.

        New storage, not an in-place shift, so that a checkpoint's tensors stay as they were.
        """
        assert self._k is not None and self._v is not None
        s, kept = self.sinks, self._length - self.sinks - evicted
        new_k, new_v = self._storage(max(self.capacity, needed), k, v)
        new_k[:, :, :s], new_v[:, :, :s] = self._k[:, :, :s], self._v[:, :, :s]
        new_k[:, :, s : s + kept] = self._shifted(self._k[:, :, s + evicted : s + evicted + kept], evicted)
        new_v[:, :, s : s + kept] = self._v[:, :, s + evicted : s + evicted + kept]
        self._k, self._v, self._length = new_k, new_v, s + kept

    def _reserve(self, needed: int, k: Tensor, v: Tensor) -> None:
        """Room for ``needed`` keys: :attr:`capacity` slots at first, more only for a call longer than a chunk."""
        if needed <= self.allocated:
            return
        new_k, new_v = self._storage(max(self.capacity, needed), k, v)
        if self._k is not None and self._v is not None:
            new_k[:, :, : self._length] = self._k[:, :, : self._length]
            new_v[:, :, : self._length] = self._v[:, :, : self._length]
        self._k, self._v = new_k, new_v

    def _leave_inference_mode(self) -> None:
        """Storage made under ``torch.inference_mode()`` cannot be written outside it: copy it once."""
        if self._k is not None and self._v is not None and self._k.is_inference() and (
                not torch.is_inference_mode_enabled()):
            self._k, self._v = self._k.clone(), self._v.clone()

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        """Evict if this call needs room, then store k, v (B, G, T, D) after what is held; return all held.

        ``k`` must have been rotated at :meth:`next_positions` (the layer does so). Unchecked (:meth:`update`
        checks first).
        """
        self._leave_inference_mode()
        t = k.shape[2]
        evicted = self.evicted_before(t)
        if evicted:
            self._evict(evicted, self._length - evicted + t, k, v)
        else:
            self._reserve(self._length + t, k, v)
        assert self._k is not None and self._v is not None
        start = self._length
        self._k[:, :, start : start + t] = k.detach()
        self._v[:, :, start : start + t] = v.detach()
        self._length, self.seen = start + t, self.seen + t
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # keep autograd's path to this call's keys and values (held ones are constants)
            return CachedKeys(torch.cat([self._k[:, :, :start], k], dim=2),  # (B, G, S - T, D) + (B, G, T, D)
                              torch.cat([self._v[:, :, :start], v], dim=2), None)
        return CachedKeys(self._k[:, :, : self._length], self._v[:, :, : self._length], None)  # (B, G, S, D)
