"""Keys and values of earlier positions, kept for incremental decoding: the cache protocol and the growing cache.

One cache per attention layer. Pass the same object on each call,
``layer(x_new, kv_cache=cache)``: the layer rotates the new keys (RoPE) at
their positions, hands them to the cache, and attends over what it gets back.

**The protocol** (:class:`Cache`) is all a layer or a model knows of a cache:

- ``next_positions(batch, length, device)``: where a call's tokens go when the
  caller gives no positions: an int n (every row continues at n .. n + T - 1,
  and keys are a plain prefix 0 .. S - 1, so kernels keep the symbolic causal
  band), or positions (B, T) long.
- ``update(k, v, positions)``: store this call's keys and values (B, G, T, D)
  at ``positions`` (B, T), or after what is held when None; return a
  :class:`CachedKeys`: the keys and values to attend to (B, G, S, D) and each
  key's position (B, S) (-1: an empty slot no query sees), or None when key j
  sits at position j of every row. A cache storing a packed form may return
  :class:`PackedKeys` instead, which the layer dequantises (or reads with its
  own kernel: :mod:`attnkit.modules.int8_cache`).
- ``write(k, v, positions)``: ``update`` without its checks, for a model's
  ``step`` (the generation loop and the serving engine, which built the
  caches and checked the inputs at their doors). attnkit's caches check an
  update in ``check(k, v, positions)``, then ``write`` it; a layer called
  alone and a model's ``forward`` call ``update``.
- ``claim(owner) -> checkpoint`` and ``restore(checkpoint)``: the first marks
  the cache as one layer's (another layer writing to it is an error) and
  saves its state; the second undoes everything since. :func:`transaction`
  uses them so that a call that raises leaves every cache as it was (on the
  checked paths only).

Implementations: :class:`KVCache` (contiguous, growing by doubling),
:class:`attnkit.modules.static_cache.StaticKVCache` (preallocated, slot =
position: what ``torch.compile`` captures), :class:`attnkit.modules.int8_cache.Int8KVCache` (int8 codes, read
by an int8 kernel), and the paged cache of :mod:`attnkit.serve`.

Legend: B batch, G key/value heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import Tensor

_MIN_ALLOC = 64


@dataclass(frozen=True)
class CachedKeys:
    """What a cache hands back to the layer."""

    k: Tensor  # (B, G, S, D)
    v: Tensor  # (B, G, S, Dv)
    positions: Tensor | None  # (B, S) long, -1 = empty slot; None: key j is at position j in every row


@runtime_checkable
class PackedKeys(Protocol):
    """What a cache storing a packed form hands back (e.g. :class:`attnkit.modules.int8_cache.Int8Keys`).

    The layer has the cache's own kernel attend (:meth:`attention`) to calls that :meth:`reads_directly`
    says it serves and that need nothing but a visibility mask; for every other call it asks for the keys
    and values dequantised.
    """

    @property
    def positions(self) -> Tensor | None:
        """As :attr:`CachedKeys.positions`."""
        ...

    @property
    def length(self) -> int:
        """S, the positions held."""
        ...

    def dequantized(self, dtype: torch.dtype) -> CachedKeys: ...

    def reads_directly(self, q: Tensor) -> bool:
        """Whether :meth:`attention` serves queries q (B, H, T, D)."""
        ...

    def attention(self, q: Tensor, scale: float, visible: Tensor | None) -> Tensor:
        """softmax(q k^T * scale) v over the held keys: q (B, H, T, D) -> (B, H, T, Dv); ``visible`` bool
        (B, 1, T, S), True = may attend, or None (every key)."""
        ...


@runtime_checkable
class Cache(Protocol):
    """A KV cache as the layer sees it (see the module docstring)."""

    def next_positions(self, batch: int, length: int, device: torch.device) -> int | Tensor: ...

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys | PackedKeys: ...

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys | PackedKeys: ...

    def claim(self, owner: object) -> Any: ...

    def restore(self, checkpoint: Any) -> None: ...


_PROTOCOL = ("next_positions", "update", "claim", "restore")


def check_cache(cache: object, name: str = "kv_cache") -> Cache:
    """``cache`` if it implements :class:`Cache`; else a TypeError naming what it lacks."""
    missing = [m for m in _PROTOCOL if not callable(getattr(cache, m, None))]
    if missing:
        raise TypeError(f"{name} must implement the cache protocol (attnkit.modules.kv_cache.Cache: "
                        f"{', '.join(_PROTOCOL)}); {type(cache).__name__} lacks {', '.join(missing)}")
    return cache  # type: ignore[return-value]


@contextmanager
def transaction(caches: Sequence[Cache], owners: Sequence[object]) -> Iterator[None]:
    """Claim each cache for its owner; if the block raises (or is interrupted), restore them all."""
    checkpoints = [cache.claim(owner) for cache, owner in zip(caches, owners, strict=True)]
    try:
        yield
    except BaseException:
        for cache, checkpoint in zip(caches, checkpoints, strict=True):
            cache.restore(checkpoint)
        raise


STORAGE_DTYPES = (torch.bfloat16, torch.float16)


def check_storage_dtype(dtype: object) -> torch.dtype | None:
    """A cache's storage dtype: None (the layer's own) or one of :data:`STORAGE_DTYPES`; else raise."""
    if dtype is None or dtype in STORAGE_DTYPES:
        return dtype
    known = ", ".join(str(d) for d in STORAGE_DTYPES)
    raise ValueError(f"a cache stores keys and values in None (the layer's dtype) or {known}, got dtype={dtype!r}")


def check_narrowing(stored: torch.dtype | None, k: Tensor, v: Tensor) -> None:
    """Keys and values of one dtype; a cache storing fewer bytes (``stored``) takes float32 ones (or its own)."""
    if k.dtype != v.dtype:
        raise ValueError(f"keys and values must share a dtype, got {k.dtype} and {v.dtype}")
    if stored is not None and k.dtype not in (torch.float32, stored):
        raise ValueError(f"a cache with dtype={stored} stores a float32 layer's keys in fewer bytes, got "
                         f"{k.dtype} keys: use dtype=None (the layer's dtype) with a {k.dtype} model")


def check_positions(positions: object, batch: int, length: int) -> Tensor:
    """Positions must be (B, T) long, >= 0 (or -1: padding) and increasing along a row (padding aside).

    A repeated position is refused like a decreasing one: caches store keys by
    position (StaticKVCache would overwrite the first with the second). A model
    checks its positions once, at its door; its layers read them from the
    step's context and check nothing.
    """
    if not isinstance(positions, Tensor) or positions.dtype != torch.long or tuple(positions.shape) != (batch, length):
        got = f"{positions.dtype} {tuple(positions.shape)}" if isinstance(positions, Tensor) else repr(positions)
        raise ValueError(f"positions must be a torch.long (B, T) = ({batch}, {length}) tensor, got {got}")
    if torch.compiler.is_compiling():
        return positions
    before = positions.cummax(dim=1).values[:, :-1]  # (B, T - 1): the highest position so far
    drops = (positions[:, 1:] >= 0) & (positions[:, 1:] <= before)  # (B, T - 1): not above every earlier one
    if bool((positions < -1).any() | drops.any()):  # one read of the values; details only on failure
        if int(positions.min()) < -1:
            raise ValueError(f"positions must be >= 0 (or -1 to mark padding), got {int(positions.min())}")
        row, t = (int(i) for i in drops.nonzero()[0])
        raise ValueError(f"positions must increase within a row (no decrease, no repeat): row {row} goes from "
                         f"{int(before[row, t])} to {int(positions[row, t + 1])}")
    return positions


class _Ownership:
    """What attnkit's dense caches share: the owner check (one cache, one layer), and ``update`` = ``check``,
    then ``write``."""

    _owner: int | None
    _kind: str

    def check(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for k, v (B, G, T, D) at ``positions`` that this cache cannot store."""
        raise NotImplementedError

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> Any:
        """Store k, v (B, G, T, D) at ``positions`` (B, T; None: after what is held), unchecked; what to attend to."""
        raise NotImplementedError

    def update(self, k: Tensor, v: Tensor, positions: Tensor | None) -> Any:
        """Check, then store k, v (B, G, T, D) at ``positions`` (B, T; None: after what is held); return what
        to attend to: :class:`CachedKeys` (or :class:`PackedKeys` for a packed cache)."""
        self.check(k, v, positions)
        return self.write(k, v, positions)

    def _claim_owner(self, owner: object) -> int | None:
        if self._owner is not None and self._owner != id(owner):
            raise ValueError(f"this {self._kind} already holds the keys of another layer; a model needs one "
                             f"{self._kind} per layer (e.g. [{self._kind}(...) for _ in layers]), or call "
                             "cache.reset() to reuse it")
        before, self._owner = self._owner, id(owner)
        return before


def _refuse_repeats(last: Tensor, positions: Tensor) -> None:
    """New positions must come after ``last`` (B,), the highest position each row holds (-1: none)."""
    if torch.compiler.is_compiling():
        return
    first = positions.masked_fill(positions < 0, 2**62).amin(dim=1)  # (B,), padding aside
    if bool((first <= last).any()):  # one read of the values; details only on failure
        row = int((first <= last).nonzero()[0])
        raise ValueError(f"positions repeat what the cache holds: row {row} holds positions up to {int(last[row])} "
                         f"but this call starts at {int(first[row])}")


G = TypeVar("G", bound="GrowingSlots")


class GrowingSlots(_Ownership):
    """What the growing caches share (:class:`KVCache`, :class:`~attnkit.modules.int8_cache.Int8KVCache`):
    slots 0 .. len - 1 held, and once a call gave explicit positions, each slot's position.

    A subclass names the tensors it holds in ``_STORAGE`` (``_pos`` and ``_top`` among them), sets
    ``_length`` and ``capacity``, checks a call's keys in ``_check``, and calls :meth:`_begin_update` before
    it stores them and :meth:`_note_positions` after; claim / restore / reset / copy and leaving inference
    mode then work on all of its tensors.
    """

    _STORAGE: tuple[str, ...]  # the attributes holding its tensors (each a Tensor or None)
    _length: int
    capacity: int | None
    _pos: Tensor | None  # (B, allocated) positions once a call gave explicit ones
    _top: Tensor | None  # (B,) the highest position each row holds, with _pos

    def _storage(self) -> tuple[Tensor | None, ...]:
        return tuple(getattr(self, name) for name in self._STORAGE)

    def _set_storage(self, tensors: Sequence[Tensor | None]) -> None:
        for name, tensor in zip(self._STORAGE, tensors, strict=True):
            setattr(self, name, tensor)

    def _cloned_into(self, twin: G) -> G:
        """``twin`` (a new, empty cache of this kind) holding copies of this cache's tensors and length."""
        twin._set_storage([None if x is None else x.clone() for x in self._storage()])
        twin._length = self._length
        return twin

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles belong to no layer yet (the original's layer is not theirs)."""
        return {**self.__dict__, "_owner": None}

    def reset(self) -> None:
        """Forget every position and the layer it belonged to (keeps no storage)."""
        self._set_storage([None] * len(self._STORAGE))
        self._length = 0
        self._owner = None

    def claim(self, owner: object) -> tuple[Any, ...]:
        """Mark ``owner`` as this cache's writer (or raise if another layer is); return a checkpoint."""
        before = self._claim_owner(owner)
        return (self._length, before, *self._storage())

    def restore(self, checkpoint: tuple[Any, ...]) -> None:
        """Go back to the state :meth:`claim` saved (positions past it are forgotten)."""
        self._length, self._owner, *held = checkpoint
        self._set_storage(held)

    def _leave_inference_mode(self) -> None:
        """Storage made under ``torch.inference_mode()`` cannot be written outside it: copy it once."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():  # dynamo cannot trace the second
            return
        held = self._storage()
        if any(x is not None and x.is_inference() for x in held):  # positions may come later than keys
            self._set_storage([None if x is None else x.clone() for x in held])

    def __len__(self) -> int:
        return self._length

    @property
    def positions(self) -> Tensor | None:
        """Each held slot's position (B, S), or None while slot j holds position j."""
        return None if self._pos is None else self._pos[:, : self._length]

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` slots (to rewind, e.g. after a rejected draft).

        Storage is reused: slots past ``length`` are overwritten by the next update,
        so views of the held keys and values taken before a crop change with it.
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"crop length must be an int in [0, {self._length}], got {length!r}")
        self._length = length
        if self._pos is not None:
            self._top = self._pos[:, :length].amax(dim=1) if length else None

    def next_positions(self, batch: int, length: int, device: torch.device) -> int | Tensor:
        """``len(cache)`` while slots are positions; else each row's last position + 1 onwards (B, T)."""
        if self._pos is None or self._length == 0:
            return self._length
        last = self._pos[:, : self._length].amax(dim=1, keepdim=True)  # (B, 1)
        return last + 1 + torch.arange(length, device=last.device)  # (B, T)

    def check(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for k, v (B, G, T, D) at ``positions`` that this cache cannot store: their shapes
        and dtype (``_check``), the capacity, positions that repeat what it holds."""
        self._check(k, v)
        if self.capacity is not None and self._length + k.shape[2] > self.capacity:
            raise ValueError(f"{type(self).__name__} capacity {self.capacity} exceeded: it holds {self._length} "
                             f"positions and {k.shape[2]} more were appended")
        self._check_after(positions, k.shape[0], k.device)

    def _begin_update(self, k: Tensor) -> int:
        """The slots held once k (B, G, T, D) is stored (:meth:`check` checked the capacity)."""
        self._leave_inference_mode()
        needed = self._length + k.shape[2]
        assert self.capacity is None or needed <= self.capacity, f"{self._kind} capacity {self.capacity} exceeded"
        return needed

    def _check(self, k: Tensor, v: Tensor) -> None:
        """Raise for keys and values this cache cannot store (each cache checks against its own storage)."""
        raise NotImplementedError

    def _number_held_slots(self, allocated: int, batch: int, device: torch.device) -> None:
        """The first explicit positions: the slots so far held positions 0 .. n - 1."""
        self._pos = torch.arange(allocated, device=device).expand(batch, -1).clone()  # (B, allocated)
        self._top = torch.full((batch,), self._length - 1, device=device) if self._length else None

    def _check_after(self, positions: Tensor | None, batch: int, device: torch.device) -> None:
        """New positions (B, T) must come after every position a row holds."""
        if positions is not None and self._length:
            _refuse_repeats(self._top if self._top is not None else torch.full(
                (batch,), self._length - 1, device=device), positions)

    def _note_positions(self, start: int, end: int, positions: Tensor | None, batch: int,
                        device: torch.device) -> None:
        """Record the positions of slots start .. end - 1 (once positions are kept)."""
        if self._pos is None:
            return
        written = torch.arange(start, end, device=device).expand(batch, -1) if positions is None \
            else positions  # (B, T)
        self._pos[:, start:end] = written
        top = written.amax(dim=1)  # (B,)
        self._top = top if self._top is None else torch.maximum(self._top, top)


class KVCache(GrowingSlots):
    """A growing store of keys and values (B, G, S, D) for one layer.

    Args:
        capacity: the most positions it may hold; appending past it raises.
            None (default) grows as needed.
        dtype: the dtype keys and values are stored in: None (default) keeps
            the layer's; ``torch.bfloat16`` or ``torch.float16`` under float32
            layers halves the cache's memory, so twice the context (or batch)
            fits (attention reads the rounded keys and values, in float32).
            float16 holds magnitudes up to 65,504 (larger ones become inf,
            unchecked); bfloat16 keeps float32's range with fewer digits.

    ``len(cache)`` is the number of slots held (the same for every row);
    ``cache.keys`` and ``cache.values`` are views of them. While every call
    gives no positions, slot j holds position j (the fast path); explicit
    positions (B, T) are stored per row, so rows may sit at different
    positions (``cache.positions``). ``reset()`` empties it for a new
    sequence; ``crop(n)`` rewinds it to its first n slots. Held keys and
    values are constants: gradients reach only those of the current call.
    A cache filled under ``torch.inference_mode()`` may be used outside it
    (its storage is then copied once into ordinary tensors).
    """

    _kind = "KVCache"
    _STORAGE = ("_k", "_v", "_pos", "_top")

    def __init__(self, capacity: int | None = None, *, dtype: torch.dtype | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got capacity={capacity!r}")
        self.capacity = capacity
        self.dtype = check_storage_dtype(dtype)
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._pos: Tensor | None = None  # (B, allocated) positions once a call gave explicit ones
        self._top: Tensor | None = None  # (B,) the highest position each row holds, with _pos
        self._length = 0
        self._owner: int | None = None

    def __repr__(self) -> str:
        shape = None if self._k is None else (self._k.shape[0], self._k.shape[1], self._length, self._k.shape[3])
        stored = "" if self.dtype is None else f", dtype={self.dtype}"
        return f"KVCache(len={self._length}, capacity={self.capacity}, shape={shape}{stored})"

    @property
    def keys(self) -> Tensor | None:
        """The keys held, (B, G, S, D), or None before the first append."""
        return None if self._k is None else self._k[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """The values held, (B, G, S, Dv), or None before the first append."""
        return None if self._v is None else self._v[:, :, : self._length]

    def __copy__(self) -> KVCache:
        """An independent cache holding the same positions (storage is copied, never shared)."""
        return self._cloned_into(KVCache(self.capacity, dtype=self.dtype))

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, G, T, D) and agree on B, G, T; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        check_narrowing(self.dtype, k, v)
        if self._k is None or self._v is None:
            return
        held, new = (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3]), (
            k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if held != new:
            raise ValueError(f"this cache holds (B, G, D, Dv)={held} but got {new}; "
                             "call cache.reset() before a new sequence")
        if (self.dtype or k.dtype, k.device) != (self._k.dtype, self._k.device):
            raise ValueError(f"this cache holds {self._k.dtype} on {self._k.device}, got {k.dtype} on {k.device}")

    def _reserve(self, needed: int, k: Tensor, v: Tensor, explicit: bool) -> None:
        """Make room for ``needed`` slots, copying what is held into larger storage."""
        allocated = 0 if self._k is None else self._k.shape[2]
        if needed > allocated:
            size = self.capacity if self.capacity is not None else max(_MIN_ALLOC, needed, 2 * allocated)
            b, g, _, d = k.shape
            stored = self.dtype or k.dtype
            new_k, new_v = k.new_empty(b, g, size, d, dtype=stored), v.new_empty(b, g, size, v.shape[3], dtype=stored)
            new_pos = None if self._pos is None else self._pos.new_empty(b, size)
            if self._k is not None and self._v is not None:
                new_k[:, :, : self._length] = self._k[:, :, : self._length]
                new_v[:, :, : self._length] = self._v[:, :, : self._length]
            if self._pos is not None and new_pos is not None:
                new_pos[:, : self._length] = self._pos[:, : self._length]
            self._k, self._v, self._pos = new_k, new_v, new_pos
        if explicit and self._pos is None:
            assert self._k is not None
            self._number_held_slots(self._k.shape[2], k.shape[0], k.device)

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        """Store k, v (B, G, T, D) in the next slots (at ``positions`` (B, T), or slot = position), unchecked
        (:meth:`update` checks first)."""
        self._leave_inference_mode()
        needed = self._length + k.shape[2]
        assert self.capacity is None or needed <= self.capacity, f"KVCache capacity {self.capacity} exceeded"
        if self._k is None or needed > self._k.shape[2] or (positions is not None and self._pos is None):
            self._reserve(needed, k, v, positions is not None)
        assert self._k is not None and self._v is not None  # _reserve allocated them
        start, self._length = self._length, needed
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        self._k[:, :, start:needed] = k.detach() if grad else k  # held keys are constants
        self._v[:, :, start:needed] = v.detach() if grad else v
        if self._pos is not None:
            self._note_positions(start, needed, positions, k.shape[0], k.device)
        held = None if self._pos is None else self._pos[:, :needed]  # (B, S)
        if grad:
            # keep autograd's path to this call's keys and values (earlier ones are constants)
            k, v = k.to(self._k.dtype), v.to(self._v.dtype)  # rounded as stored (differentiable)
            return CachedKeys(torch.cat([self._k[:, :, :start], k], dim=2),  # (B, G, S - T, D) + (B, G, T, D)
                              torch.cat([self._v[:, :, :start], v], dim=2), held)
        return CachedKeys(self._k[:, :, :needed], self._v[:, :, :needed], held)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, G, T, D) after the slots held; return all keys and values held."""
        keys = self.update(k, v, None)
        return keys.k, keys.v
