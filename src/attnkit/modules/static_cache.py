"""A preallocated KV cache, slot = position: the shapes of a decoding step never change, so ``torch.compile``
captures one graph for every step (and, with :meth:`StaticKVCache.mark_capacity_dynamic`, every capacity).

Legend: B batch, G key/value heads, T new positions, D head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .cache_protocol import CachedKeys, _Ownership, _refuse_repeats, check_narrowing, check_storage_dtype
from .kv_cache import KVCache


class StaticKVCache(_Ownership):
    """Preallocated keys and values for one layer: position p is stored in slot p (``torch.compile`` friendly).

    Args:
        capacity: positions 0 .. capacity - 1 fit; storage (B, G, capacity, D)
            is allocated at the first call.
        dtype: the storage dtype, as for :class:`KVCache`.

    Every call attends over all ``capacity`` slots (and one more, where
    padding, position -1, is written and never seen) with a mask from each
    slot's position (-1 while empty), so the shapes of a decoding step never
    change and one compiled graph serves every step. Rows may sit at
    different positions. For inference only (no gradients reach the keys).
    """

    _kind = "StaticKVCache"

    def __init__(self, capacity: int, *, dtype: torch.dtype | None = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got capacity={capacity!r}")
        self.capacity = capacity
        self.dtype = check_storage_dtype(dtype)
        self.k: Tensor | None = None  # (B, G, capacity, D)
        self.v: Tensor | None = None
        self.positions: Tensor | None = None  # (B, capacity + 1) long, -1 = empty; the last slot takes padding
        self._owner: int | None = None

    def __repr__(self) -> str:
        shape = None if self.k is None else tuple(self.k.shape)
        stored = "" if self.dtype is None else f", dtype={self.dtype}"
        return f"StaticKVCache(capacity={self.capacity}, shape={shape}{stored})"

    def reset(self) -> None:
        """Forget every position (keeps the storage) and the layer it belonged to."""
        if self.positions is not None:
            self.positions.fill_(-1)
        self._owner = None

    def claim(self, owner: object) -> tuple[Any, ...]:
        before = self._claim_owner(owner)
        return (before, None if self.positions is None else self.positions.clone())

    def restore(self, checkpoint: tuple[Any, ...]) -> None:
        self._owner, positions = checkpoint
        if positions is None:
            self.k = self.v = self.positions = None
        elif self.positions is not None:
            self.positions.copy_(positions)  # slots written since are empty again

    def next_positions(self, batch: int, length: int, device: torch.device) -> int | Tensor:
        if self.positions is None:
            return 0
        last = self.positions.amax(dim=1, keepdim=True)  # (B, 1), -1 when empty
        return last + 1 + torch.arange(length, device=last.device)  # (B, T)

    def continue_from(self, held: KVCache, positions: Tensor) -> None:
        """Take what the growing cache ``held`` holds, at ``positions`` (B, T), and the layer it belongs to, and
        mark the capacity dynamic: what a compiled decoding step continues from after an eager prefill (its first
        call finds the cache claimed, where a first claim in the graph compiled it twice, and one graph serves
        every capacity)."""
        if held.keys is None or held.values is None:
            raise ValueError("continue_from() takes a KVCache that holds keys; this one is empty")
        self.update(held.keys, held.values, positions)  # (B, G, T, D) into slots at (B, T)
        self._owner = held._owner
        self.mark_capacity_dynamic()

    def mark_capacity_dynamic(self) -> None:
        """Tell ``torch.compile`` the capacity may change from call to call: one graph then serves caches of
        every capacity (each capacity compiled a graph of its own: tens of seconds a chat turn)."""
        for tensor, dim in ((self.k, 2), (self.v, 2), (self.positions, 1)):
            if tensor is not None:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def _allocate(self, k: Tensor, v: Tensor) -> None:
        b, g, _, d = k.shape
        with torch.inference_mode(False):
            stored = self.dtype or k.dtype
            self.k = k.new_zeros(b, g, self.capacity + 1, d, dtype=stored)
            self.v = v.new_zeros(b, g, self.capacity + 1, v.shape[3], dtype=stored)
            self.positions = torch.full((b, self.capacity + 1), -1, dtype=torch.long, device=k.device)
        if k.is_cuda:  # written in place by a CUDA graph's replays: its address must not change between them
            for tensor in (self.k, self.v, self.positions):
                torch._dynamo.mark_static_address(tensor)

    def _after_held(self, k: Tensor) -> Tensor:
        """The positions (B, T) of k (B, G, T, D) when the caller gives none: right after what each row holds."""
        at = self.next_positions(k.shape[0], k.shape[2], k.device)
        return torch.arange(k.shape[2], device=k.device).expand(k.shape[0], -1) if isinstance(at, int) else at

    def check(self, k: Tensor, v: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for k, v (B, G, T, D) at ``positions`` (B, T; None: after what is held) that this
        cache cannot store: gradients, another shape, dtype or device, a position past the capacity, a repeat."""
        check_narrowing(self.dtype, k, v)
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError("StaticKVCache is for inference: call under torch.no_grad() or "
                             "torch.inference_mode(), or use KVCache, which keeps gradients")
        positions = self._after_held(k) if positions is None else positions  # (B, T)
        if self.k is None or self.v is None or self.positions is None:  # empty: the first call allocates
            if not torch.compiler.is_compiling() and int(positions.max()) >= self.capacity:
                raise ValueError(f"StaticKVCache capacity {self.capacity} exceeded: position {int(positions.max())}")
            return
        if (k.shape[0], k.shape[1], k.shape[3], self.dtype or k.dtype, k.device) != (
                self.k.shape[0], self.k.shape[1], self.k.shape[3], self.k.dtype, self.k.device):
            held = (self.k.shape[0], self.k.shape[1], self.k.shape[3])
            raise ValueError(f"this cache holds (B, G, D)={held} "
                             f"{self.k.dtype} on {self.k.device}, got {tuple(k.shape)} {k.dtype} on {k.device}")
        if torch.compiler.is_compiling():  # no Python check on a traced value: an assert inside the graph instead
            torch._assert_async((positions < self.positions.shape[1] - 1).all(),
                                "StaticKVCache capacity exceeded: a position reached the cache's capacity "
                                "(positions 0 .. capacity - 1 fit): allocate a larger cache")
            return
        if int(positions.max()) >= self.capacity:
            raise ValueError(f"StaticKVCache capacity {self.capacity} exceeded: position {int(positions.max())}")
        _refuse_repeats(self.positions.amax(dim=1), positions)

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> CachedKeys:
        """Write k, v (B, G, T, D) into the slots ``positions`` (B, T); return every slot and its position.

        A -1 position (padding) is written to a spare slot that no query sees. Unchecked (:meth:`update`
        checks first).
        """
        if self.k is None:
            self._allocate(k, v)
        positions = self._after_held(k) if positions is None else positions  # (B, T)
        assert self.k is not None and self.v is not None and self.positions is not None
        rows = torch.arange(k.shape[0], device=k.device)[:, None]  # (B, 1)
        spare = self.k.shape[2] - 1  # = capacity, read from the storage: one compiled graph serves every capacity
        slots = positions.masked_fill(positions < 0, spare)  # (B, T): padding goes to the spare slot
        self.k[rows, :, slots] = k.transpose(1, 2).to(self.k.dtype)  # (B, G, T, D) -> (B, T, G, D) into slots (B, T)
        self.v[rows, :, slots] = v.transpose(1, 2).to(self.v.dtype)
        self.positions[rows, slots] = positions  # the spare slot stays -1
        return CachedKeys(self.k, self.v, self.positions)
