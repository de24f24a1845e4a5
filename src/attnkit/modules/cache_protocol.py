"""The cache protocol: what a layer and a model know of a KV cache, and the checks attnkit's caches share.

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
  own kernel: :mod:`attnkit.modules.int8_storage`).
- ``write(k, v, positions)``: ``update`` without its checks, for a model's
  ``step`` (the generation loop and the serving engine, which built the
  caches and checked the inputs at their doors). attnkit's caches check an
  update in ``check(k, v, positions)``, then ``write`` it; a layer called
  alone and a model's ``forward`` call ``update``.
- ``claim(owner) -> checkpoint`` and ``restore(checkpoint)``: the first marks
  the cache as one layer's (another layer writing to it is an error) and
  saves its state; the second undoes everything since. :func:`transaction`
  uses them so that a call that raises leaves every cache as it was (on the
  checked paths only: a model's ``step`` never claims).

Implementations: :class:`attnkit.modules.kv_cache.KVCache` (growing; its
storage dtype, float or int8, and its eviction policy, none or a sink window,
are parameters), :class:`attnkit.modules.static_cache.StaticKVCache`
(preallocated, slot = position: what ``torch.compile`` captures), and the
paged cache of :mod:`attnkit.serve`.

Legend: B batch, G key/value heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class CachedKeys:
    """What a cache hands back to the layer."""

    k: Tensor  # (B, G, S, D)
    v: Tensor  # (B, G, S, Dv)
    positions: Tensor | None  # (B, S) long, -1 = empty slot; None: key j is at position j in every row


@runtime_checkable
class PackedKeys(Protocol):
    """What a cache storing a packed form hands back (e.g. :class:`attnkit.modules.int8_storage.Int8Keys`).

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
        raise TypeError(f"{name} must implement the cache protocol (attnkit.modules.cache_protocol.Cache: "
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


STORAGE_DTYPES = (torch.bfloat16, torch.float16)  # the float dtypes a cache may store a float32 layer's keys in


def check_storage_dtype(dtype: object, known: tuple[torch.dtype, ...] = STORAGE_DTYPES) -> torch.dtype | None:
    """A cache's storage dtype: None (the layer's own) or one of ``known``; else raise, naming them."""
    if dtype is None or dtype in known:
        return dtype
    names = ", ".join(str(d) for d in known)
    raise ValueError(f"a cache stores keys and values in None (the layer's dtype) or {names}, got dtype={dtype!r}")


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

    def _check_owner(self, owner: object) -> None:
        """Raise if another layer than ``owner`` holds keys here."""
        if self._owner is not None and self._owner != id(owner):
            raise ValueError(f"this {self._kind} already holds the keys of another layer; a model needs one "
                             f"{self._kind} per layer (e.g. [{self._kind}(...) for _ in layers]), or call "
                             "cache.reset() to reuse it")

    def _claim_owner(self, owner: object) -> int | None:
        """Mark ``owner`` as the writer (or raise: :meth:`_check_owner`); return the owner before."""
        self._check_owner(owner)
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
