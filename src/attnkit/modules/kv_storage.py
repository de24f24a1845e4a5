"""How a :class:`~attnkit.modules.kv_cache.KVCache` keeps its keys and values: the storage protocol, and float
storage.

The cache does the bookkeeping (the slots held, their positions, the
capacity, the layer it belongs to, eviction); its storage keeps the tensors
in a form of its own and hands back what the layer attends to. Two forms,
picked by the cache's ``dtype``: :class:`FloatStorage` here (the layer's
dtype, or 16 bits under a float32 layer) and
:class:`attnkit.modules.int8_storage.Int8Storage` (int8 codes, read by an
int8 kernel).

Legend: B batch, G key/value heads, T new positions, S slots held, C slots allocated (>= S), D head dim, Dv value
head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import Tensor

from .cache_protocol import CachedKeys, PackedKeys, check_narrowing

_MIN_ALLOC = 64  # the fewest slots a growing float storage allocates


class KVStorage(Protocol):
    """Keys and values of slots 0 .. C - 1 in some form (the cache knows how many it holds)."""

    allocated: int  # C: 0 before the first :meth:`grow`

    def check(self, k: Tensor, v: Tensor) -> None:
        """Raise a ValueError for keys and values (B, G, T, D) it cannot take: their dtype, or another shape,
        dtype or device than what it holds."""
        ...

    def size_for(self, needed: int, capacity: int | None) -> int:
        """The slots to allocate when ``needed`` do not fit (``capacity``: the cache's bound, or None)."""
        ...

    def grow(self, size: int, held: int, k: Tensor, v: Tensor) -> None:
        """Allocate ``size`` slots shaped for k, v (B, G, T, D), keeping what the first ``held`` hold."""
        ...

    def put(self, start: int, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys | PackedKeys:
        """Write k, v (B, G, T, D) into slots start .. start + T - 1 (allocated); return slots 0 .. start + T - 1
        to attend to, with ``positions`` (B, S) (None: slot j holds position j)."""
        ...

    def held(self, length: int, positions: Tensor | None) -> CachedKeys | PackedKeys:
        """Slots 0 .. length - 1, as :meth:`put` returns them."""
        ...

    def dims(self) -> tuple[int, int, int, int] | None:
        """(B, G, D, Dv) of what it holds; None before the first :meth:`grow`."""
        ...

    def tensors(self) -> tuple[Tensor | None, ...]:
        """Every tensor it holds (for checkpoints and copies)."""
        ...

    def set_tensors(self, tensors: Sequence[Tensor | None]) -> None:
        """Hold ``tensors`` (as :meth:`tensors` gave them, or all None: empty)."""
        ...


def check_dims(held: tuple[int, int, int, int] | None, k: Tensor, v: Tensor) -> None:
    """k, v (B, G, T, D) must agree with the (B, G, D, Dv) a storage holds (None: it holds nothing)."""
    new = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
    if held is not None and held != new:
        raise ValueError(f"this cache holds (B, G, D, Dv)={held} but got {new}; call cache.reset() before a new "
                         "sequence")


class FloatStorage:
    """Keys (B, G, C, D) and values (B, G, C, Dv) as float tensors: the layer's dtype, or ``dtype``.

    ``dtype`` None keeps the dtype of the keys it is given; bfloat16 or
    float16 stores a float32 layer's keys in half the bytes (rounded once,
    when stored). Held keys are constants: gradients reach only those of the
    call that :meth:`put` returns them to.
    """

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype
        self.k: Tensor | None = None  # (B, G, C, D)
        self.v: Tensor | None = None  # (B, G, C, Dv)
        self.allocated = 0

    def check(self, k: Tensor, v: Tensor) -> None:
        check_narrowing(self.dtype, k, v)
        if self.k is None or self.v is None:
            return
        check_dims(self.dims(), k, v)
        if (self.dtype or k.dtype, k.device) != (self.k.dtype, self.k.device):
            raise ValueError(f"this cache holds {self.k.dtype} on {self.k.device}, got {k.dtype} on {k.device}")

    def size_for(self, needed: int, capacity: int | None) -> int:
        """The capacity when there is one (allocated once), else double what is allocated (or ``needed``)."""
        return capacity if capacity is not None else max(_MIN_ALLOC, needed, 2 * self.allocated)

    def _empty(self, size: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Uninitialised keys (B, G, size, D) and values (B, G, size, Dv) in the stored dtype."""
        b, g, _, d = k.shape
        stored = self.dtype or k.dtype
        return k.new_empty(b, g, size, d, dtype=stored), v.new_empty(b, g, size, v.shape[3], dtype=stored)

    def grow(self, size: int, held: int, k: Tensor, v: Tensor) -> None:
        new_k, new_v = self._empty(size, k, v)
        if self.k is not None and self.v is not None:
            new_k[:, :, :held] = self.k[:, :, :held]
            new_v[:, :, :held] = self.v[:, :, :held]
        self.set_tensors((new_k, new_v))

    def drop(self, first: int, count: int, held: int, size: int, rotate: Callable[[Tensor], Tensor], k: Tensor,
             v: Tensor) -> None:
        """New storage of ``size`` slots: slots 0 .. first - 1 as they were, then slots first + count .. held - 1
        moved ``count`` places left, their keys passed through ``rotate`` (an eviction's re-rotation).

        New tensors, not a move in place, so that a checkpoint's tensors stay as they were.
        """
        assert self.k is not None and self.v is not None
        new_k, new_v = self._empty(size, k, v)
        kept = slice(first + count, held)
        new_k[:, :, :first], new_v[:, :, :first] = self.k[:, :, :first], self.v[:, :, :first]
        new_k[:, :, first : held - count] = rotate(self.k[:, :, kept])  # (B, G, held - first - count, D)
        new_v[:, :, first : held - count] = self.v[:, :, kept]
        self.set_tensors((new_k, new_v))

    def put(self, start: int, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        assert self.k is not None and self.v is not None  # the cache grew it first
        end = start + k.shape[2]
        grad = torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)
        self.k[:, :, start:end] = k.detach() if grad else k  # held keys are constants
        self.v[:, :, start:end] = v.detach() if grad else v
        if grad:
            # keep autograd's path to this call's keys and values (earlier ones are constants)
            k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # rounded as stored (differentiable)
            return CachedKeys(torch.cat([self.k[:, :, :start], k], dim=2),  # (B, G, S - T, D) + (B, G, T, D)
                              torch.cat([self.v[:, :, :start], v], dim=2), positions)
        return CachedKeys(self.k[:, :, :end], self.v[:, :, :end], positions)  # (B, G, S, D)

    def held(self, length: int, positions: Tensor | None) -> CachedKeys:
        assert self.k is not None and self.v is not None
        return CachedKeys(self.k[:, :, :length], self.v[:, :, :length], positions)  # (B, G, S, D)

    def dims(self) -> tuple[int, int, int, int] | None:
        if self.k is None or self.v is None:
            return None
        return (self.k.shape[0], self.k.shape[1], self.k.shape[3], self.v.shape[3])

    def tensors(self) -> tuple[Tensor | None, ...]:
        return (self.k, self.v)

    def set_tensors(self, tensors: Sequence[Tensor | None]) -> None:
        self.k, self.v = tensors
        self.allocated = 0 if self.k is None else self.k.shape[2]
