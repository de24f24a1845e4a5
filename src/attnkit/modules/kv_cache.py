"""The growing KV cache: one class, whose storage form is a parameter and whose eviction policy is a component.

    KVCache()                                   # the layer's dtype; grows by doubling
    KVCache(4096, dtype=torch.bfloat16)         # up to 4,096 positions in half a float32 layer's bytes
    KVCache(dtype=torch.int8)                   # int8 codes, read by an int8 kernel (see int8_storage.py)
    KVCache(eviction=SinkWindow(sinks=4, window=1020, rope=layer.rope))   # constant memory (StreamingLLM)

The cache keeps the bookkeeping: the slots held, each slot's position once a
call gave explicit ones, the capacity, the layer it belongs to, checkpoints.
Its storage (:mod:`.kv_storage`, picked by ``dtype``) keeps the tensors and
hands back what the layer attends to; an eviction policy
(:class:`~attnkit.modules.sink_window.SinkWindow`) says what to drop before a
call is stored. The protocol it implements is :mod:`.cache_protocol`'s; the
other caches are :class:`~attnkit.modules.static_cache.StaticKVCache` (what
``torch.compile`` captures) and the serving engine's paged pool.

Legend: B batch, G key/value heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .cache_protocol import STORAGE_DTYPES, CachedKeys, PackedKeys, _Ownership, _refuse_repeats, check_storage_dtype
from .int8_storage import Int8Storage
from .kv_storage import FloatStorage, KVStorage
from .sink_window import SinkWindow

KV_DTYPES = (*STORAGE_DTYPES, torch.int8)  # what KVCache(dtype=...) takes besides None


def _check_eviction(eviction: object, capacity: int | None, dtype: torch.dtype | None) -> SinkWindow | None:
    """``eviction`` if a cache of this capacity and storage dtype can evict by it; else raise, naming why."""
    if eviction is None:
        return None
    if isinstance(eviction, type) and issubclass(eviction, SinkWindow):
        raise TypeError(f"eviction takes a {eviction.__name__} instance, got the class itself: give "
                        f"eviction={eviction.__name__}(sinks=..., window=..., rope=layer.rope)")
    if not isinstance(eviction, SinkWindow):
        raise TypeError(f"eviction must be None or a SinkWindow, got {type(eviction).__name__}")
    if capacity is not None:
        raise ValueError(f"a KVCache with eviction={eviction!r} holds what the policy keeps (up to "
                         f"{eviction.capacity} positions): give capacity=None, got capacity={capacity}")
    if dtype is not None:  # float storage rounds once, when stored; a re-rotation would round again
        raise ValueError(f"a KVCache with eviction re-rotates the keys it keeps at every eviction, which dtype={dtype} "
                         "storage would round again each time (an error that grows with the evictions): use "
                         "dtype=None (the layer's dtype) with eviction")
    return eviction


def _check_read_dtype(dtype: object) -> None:
    """The dtype :meth:`KVCache.keys_and_values` hands keys back in: None or a floating torch dtype."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    error = ValueError if isinstance(dtype, torch.dtype) else TypeError
    raise error(f"keys_and_values takes None (as stored) or a floating torch dtype (e.g. torch.float32, "
                f"torch.float64, torch.bfloat16, torch.float16), got dtype={dtype!r}")


class KVCache(_Ownership):
    """A growing store of keys and values (B, G, S, D) for one layer.

    Args:
        capacity: the most positions it may hold; appending past it raises.
            None (default) grows as needed.
        dtype: the form keys and values are stored in: None (default) keeps
            the layer's dtype; ``torch.bfloat16`` or ``torch.float16`` under
            float32 layers halves the cache's memory, so twice the context (or
            batch) fits (attention reads the rounded keys and values, in
            float32). float16 holds magnitudes up to 65,504 (larger ones become
            inf, unchecked); bfloat16 keeps float32's range with fewer digits.
            ``torch.int8``: int8 codes and one scale per vector, a quarter of
            float32's bytes, read by an int8 kernel while decoding (float32 or
            bfloat16 layers, inference only: :mod:`attnkit.modules.int8_storage`).
            Only None with eviction.
        eviction: None (default: every position is kept) or a
            :class:`~attnkit.modules.sink_window.SinkWindow`: attention sinks
            and a recent window in constant memory. The cache then assigns
            positions itself (none may be given) and takes no ``capacity``
            and no ``dtype``: each eviction re-rotates the kept keys, which
            16-bit or int8 storage would round again every time. It cannot
            be cropped (an eviction cannot be undone).

    ``len(cache)`` is the number of slots held (the same for every row);
    ``cache.keys`` and ``cache.values`` are views of them (float storage;
    int8 storage gives float32 copies, and ``keys_and_values(dtype)`` any
    dtype). While every call gives no positions, slot j holds position j (the
    fast path); explicit positions (B, T) are stored per row, so rows may sit
    at different positions (``cache.positions``). ``reset()`` empties it for
    a new sequence; ``crop(n)`` rewinds it to its first n slots (without
    eviction). Held keys and values are constants: gradients reach only those
    of the current call. A cache filled under ``torch.inference_mode()`` may be
    used outside it (its storage is then copied once into ordinary tensors).
    """

    _kind = "KVCache"

    def __init__(self, capacity: int | None = None, *, dtype: torch.dtype | None = None,
                 eviction: SinkWindow | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got capacity={capacity!r}")
        self.capacity = capacity
        self.dtype = check_storage_dtype(dtype, KV_DTYPES)
        self.eviction = _check_eviction(eviction, capacity, self.dtype)
        self._store: KVStorage = Int8Storage() if self.dtype == torch.int8 else FloatStorage(self.dtype)
        self._pos: Tensor | None = None  # (B, allocated) positions once a call gave explicit ones
        self._top: Tensor | None = None  # (B,) the highest position each row holds, with _pos
        self._length = 0
        self._dropped = 0  # slots the eviction policy dropped since the last reset
        self._owner: int | None = None

    def __repr__(self) -> str:
        dims = self._store.dims()
        shape = None if dims is None else (dims[0], dims[1], self._length, dims[2])
        stored = "" if self.dtype is None else f", dtype={self.dtype}"
        evicts = "" if self.eviction is None else f", eviction={self.eviction!r}, seen={self.seen}"
        capacity = self.capacity if self.eviction is None else self.eviction.capacity
        return f"KVCache(len={self._length}, capacity={capacity}, shape={shape}{stored}{evicts})"

    def __len__(self) -> int:
        return self._length

    @property
    def allocated(self) -> int:
        """The slots its storage holds room for (>= ``len(cache)``)."""
        return self._store.allocated

    @property
    def seen(self) -> int:
        """The tokens stored since the last :meth:`reset`: ``len(cache)`` plus what an eviction policy dropped."""
        return self._length + self._dropped

    @property
    def positions(self) -> Tensor | None:
        """Each held slot's position (B, S), or None while slot j holds position j."""
        return None if self._pos is None else self._pos[:, : self._length]

    def keys_and_values(self, dtype: torch.dtype | None = None) -> CachedKeys | None:
        """The keys (B, G, S, D) and values (B, G, S, Dv) held and their positions, as ``dtype``, a floating torch
        dtype (None: as stored, float32 from int8 storage); None before the first update."""
        _check_read_dtype(dtype)
        if self._store.allocated == 0:
            return None
        held = self._store.held(self._length, self.positions)
        if not isinstance(held, CachedKeys):
            return held.dequantized(dtype or torch.float32)
        return held if dtype is None else CachedKeys(held.k.to(dtype), held.v.to(dtype), held.positions)

    @property
    def keys(self) -> Tensor | None:
        """The keys held, (B, G, S, D), or None before the first append."""
        held = self.keys_and_values()
        return None if held is None else held.k

    @property
    def values(self) -> Tensor | None:
        """The values held, (B, G, S, Dv), or None before the first append."""
        held = self.keys_and_values()
        return None if held is None else held.v

    def _tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor it holds: its storage's, then the positions (for checkpoints and copies)."""
        return (*self._store.tensors(), self._pos, self._top)

    def _set_tensors(self, tensors: Sequence[Tensor | None]) -> None:
        """Hold ``tensors`` (as :meth:`_tensors` gave them)."""
        *stored, self._pos, self._top = tensors
        self._store.set_tensors(stored)

    def __copy__(self) -> KVCache:
        """An independent cache holding the same positions (storage is copied, never shared)."""
        twin = KVCache(self.capacity, dtype=self.dtype, eviction=self.eviction)
        twin._set_tensors([None if x is None else x.clone() for x in self._tensors()])
        twin._length, twin._dropped = self._length, self._dropped
        return twin

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles belong to no layer yet (the original's layer is not theirs)."""
        return {**self.__dict__, "_owner": None}

    def reset(self) -> None:
        """Forget every position and the layer it belonged to (keeps no storage)."""
        self._set_tensors([None] * len(self._tensors()))
        self._length = self._dropped = 0
        self._owner = None

    def claim(self, owner: object) -> tuple[Any, ...]:
        """Mark ``owner`` as this cache's writer (or raise if another layer is); return a checkpoint.

        Growth and eviction write new storage and an append writes past what is
        held, so the checkpoint's tensors stay valid: :meth:`restore` only puts them back.
        """
        self._check_owner(owner)  # another layer's cache: say so first (its rope may well be the same)
        if self.eviction is not None:
            self.eviction.check_owner(owner)
        before = self._claim_owner(owner)
        return (self._length, self._dropped, before, *self._tensors())

    def restore(self, checkpoint: tuple[Any, ...]) -> None:
        """Go back to the state :meth:`claim` saved (positions stored and evicted since are undone)."""
        self._length, self._dropped, self._owner, *held = checkpoint
        self._set_tensors(held)

    def _leave_inference_mode(self) -> None:
        """Storage made under ``torch.inference_mode()`` cannot be written outside it: copy it once."""
        held = self._tensors()
        if any(x is not None and x.is_inference() for x in held):  # positions may come later than keys
            self._set_tensors([None if x is None else x.clone() for x in held])

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` slots (to rewind, e.g. after a rejected draft).

        Storage is reused: slots past ``length`` are overwritten by the next update,
        so views of the held keys and values taken before a crop change with it.
        A cache with eviction refuses: a crop cannot bring back what an eviction
        dropped, nor undo the re-rotation of what it kept.
        """
        if self.eviction is not None:
            raise ValueError(f"a KVCache with eviction={self.eviction!r} cannot be cropped: an eviction cannot be "
                             "undone (the keys it dropped are gone and those it kept were moved and re-rotated), so a "
                             "cropped cache would differ from one that never saw the calls; reset() it and feed the "
                             "tokens again")
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"crop length must be an int in [0, {self._length}], got {length!r}")
        self._length = length
        if self._pos is not None:
            self._top = self._pos[:, :length].amax(dim=1) if length else None

    def next_positions(self, batch: int, length: int, device: torch.device) -> int | Tensor:
        """``len(cache)`` while slots are positions (after this call's eviction, with one); else each row's last
        position + 1 onwards (B, T)."""
        if self.eviction is not None:
            return self._length - self.eviction.evicted_before(self._length, length)
        if self._pos is None or self._length == 0:
            return self._length
        last = self._pos[:, : self._length].amax(dim=1, keepdim=True)  # (B, 1)
        return last + 1 + torch.arange(length, device=last.device)  # (B, T)

    def check(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for k, v (B, G, T, D) at ``positions`` that this cache cannot store: their shapes,
        dtype and device (against what it holds), the capacity, positions that repeat what it holds, and what
        its eviction policy refuses."""
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, G, T, D) and agree on B, G, T; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        self._store.check(k, v)
        if self.eviction is not None:
            self.eviction.check(k, positions)
        elif self.capacity is not None and self._length + k.shape[2] > self.capacity:
            raise ValueError(f"KVCache capacity {self.capacity} exceeded: it holds {self._length} "
                             f"positions and {k.shape[2]} more were appended")
        if positions is not None and self._length:  # new positions come after every position a row holds
            _refuse_repeats(self._top if self._top is not None else torch.full(
                (k.shape[0],), self._length - 1, device=k.device), positions)

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys | PackedKeys:
        """Store k, v (B, G, T, D) in the next slots (at ``positions`` (B, T), or slot = position), unchecked
        (:meth:`update` checks first); return what to attend to."""
        if not torch.compiler.is_compiling() and not torch.is_inference_mode_enabled():  # dynamo: that order
            self._leave_inference_mode()
        if self.eviction is not None:
            self._evict(k, v)
        start = self._length
        needed = start + k.shape[2]
        assert self.capacity is None or needed <= self.capacity, f"KVCache capacity {self.capacity} exceeded"
        if needed > self._store.allocated or (positions is not None and self._pos is None):
            self._reserve(needed, k, v, positions is not None)
        self._length = needed
        if self._pos is not None:
            self._note_positions(start, needed, positions, k)
        return self._store.put(start, k, v, None if self._pos is None else self._pos[:, :needed])

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, G, T, D) after the slots held; return all keys and values held (B, G, S, D) (int8
        storage: dequantised to k's dtype)."""
        keys = self.update(k, v, None)
        held = keys if isinstance(keys, CachedKeys) else keys.dequantized(k.dtype)
        return held.k, held.v

    def _evict(self, k: Tensor, v: Tensor) -> None:
        """Drop the slots the eviction policy evicts before k, v (B, G, T, D) are stored, re-rotating the keys
        that move."""
        policy = self.eviction
        assert policy is not None and isinstance(self._store, FloatStorage)  # only dtype=None takes eviction
        count = policy.evicted_before(self._length, k.shape[2])
        if not count:
            return
        kept = self._length - count
        self._store.drop(policy.sinks, count, self._length, max(policy.capacity, kept + k.shape[2]),
                         lambda keys: policy.shifted(keys, count), k, v)
        self._length, self._dropped = kept, self._dropped + count

    def _reserve(self, needed: int, k: Tensor, v: Tensor, explicit: bool) -> None:
        """Make room for ``needed`` slots (what is held is copied into the larger storage); with the first
        explicit positions, start keeping each slot's."""
        if needed > self._store.allocated:
            size = max(self.eviction.capacity, needed) if self.eviction is not None else self._store.size_for(
                needed, self.capacity)
            self._store.grow(size, self._length, k, v)
            if self._pos is not None:
                new_pos = self._pos.new_empty(k.shape[0], size)  # (B, size)
                new_pos[:, : self._length] = self._pos[:, : self._length]
                self._pos = new_pos
        if explicit and self._pos is None:  # the slots so far held positions 0 .. n - 1
            self._pos = torch.arange(self._store.allocated, device=k.device).expand(k.shape[0], -1).clone()
            self._top = torch.full((k.shape[0],), self._length - 1, device=k.device) if self._length else None

    def _note_positions(self, start: int, end: int, positions: Tensor | None, k: Tensor) -> None:
        """Record the positions of slots start .. end - 1 (B, T); None: slot = position."""
        assert self._pos is not None
        written = torch.arange(start, end, device=k.device).expand(k.shape[0], -1) if positions is None \
            else positions  # (B, T)
        self._pos[:, start:end] = written
        top = written.amax(dim=1)  # (B,)
        self._top = top if self._top is None else torch.maximum(self._top, top)
