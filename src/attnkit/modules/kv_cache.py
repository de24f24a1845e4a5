"""Keys and values of earlier positions, kept for incremental decoding.

One :class:`KVCache` per attention layer. Pass the same object on each call,
``layer(x_new, kv_cache=cache)``: the layer appends the new positions' keys
and values (after rotary embedding) and attends over everything held.

Storage is preallocated and grows by doubling (or is fixed by ``capacity``),
so a decoding step writes only its own positions instead of copying the
whole cache as ``torch.cat`` would.

Legend: B batch, G key/value heads, S positions held, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MIN_ALLOC = 64


class KVCache:
    """A growing store of keys and values (B, G, S, D) for one layer.

    Args:
        capacity: the most positions it may hold; appending past it raises.
            None (default) grows as needed.

    ``len(cache)`` is the number of positions held; ``cache.keys`` and
    ``cache.values`` are views of them. ``reset()`` empties it for a new
    sequence (same batch size or a new one); ``crop(n)`` rewinds it to its
    first n positions. Held keys and values are constants: gradients reach
    only those of the current call.

    A cache belongs to the first layer that writes to it (a model uses one
    cache per layer); another layer writing to it is an error, until
    ``reset()``. A cache filled under ``torch.inference_mode()`` may be used
    outside it: its storage is then copied once into ordinary tensors.
    """

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got capacity={capacity!r}")
        self.capacity = capacity
        self._k: Tensor | None = None
        self._v: Tensor | None = None
        self._length = 0
        self._owner: int | None = None  # id() of the layer that writes to this cache

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        shape = None if self._k is None else (self._k.shape[0], self._k.shape[1], self._length, self._k.shape[3])
        return f"KVCache(len={self._length}, capacity={self.capacity}, shape={shape})"

    @property
    def keys(self) -> Tensor | None:
        """The keys held, (B, G, S, D), or None before the first append."""
        return None if self._k is None else self._k[:, :, : self._length]

    @property
    def values(self) -> Tensor | None:
        """The values held, (B, G, S, Dv), or None before the first append."""
        return None if self._v is None else self._v[:, :, : self._length]

    def __getstate__(self) -> dict[str, object]:
        """Copies and pickles belong to no layer yet (the original's layer is not theirs)."""
        return {**self.__dict__, "_owner": None}

    def __copy__(self) -> KVCache:
        """An independent cache holding the same positions (storage is copied, never shared)."""
        twin = KVCache(self.capacity)
        if self._k is not None and self._v is not None:
            twin._k, twin._v = self._k.clone(), self._v.clone()
        twin._length = self._length
        return twin

    def reset(self) -> None:
        """Forget every position and the layer it belonged to (keeps no storage)."""
        self._k = self._v = None
        self._length = 0
        self._owner = None

    def claim(self, layer: object) -> tuple[int, int | None, Tensor | None, Tensor | None]:
        """Mark ``layer`` as this cache's writer (or raise if another layer is); return a checkpoint.

        :meth:`restore` with the checkpoint undoes everything a call did,
        so a layer call that raises leaves the cache as it was.
        """
        if self._owner is not None and self._owner != id(layer):
            raise ValueError(f"this KVCache already holds the keys of another layer ({self._length} positions); "
                             "a model needs one KVCache per layer (e.g. [KVCache() for _ in layers]), "
                             "or call cache.reset() to reuse it for a new sequence")
        checkpoint = (self._length, self._owner, self._k, self._v)
        self._owner = id(layer)
        return checkpoint

    def restore(self, checkpoint: tuple[int, int | None, Tensor | None, Tensor | None]) -> None:
        """Go back to the state :meth:`claim` saved (positions past it are forgotten)."""
        self._length, self._owner, self._k, self._v = checkpoint

    def crop(self, length: int) -> None:
        """Keep only the first ``length`` positions (to rewind, e.g. after a rejected draft).

        Storage is reused: positions past ``length`` are overwritten by the next append,
        so views taken from :attr:`keys` / :attr:`values` before a crop change with it
        (clone them to keep them).
        """
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._length:
            raise ValueError(f"crop length must be an int in [0, {self._length}], got {length!r}")
        self._length = length

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, G, T, D) and agree on B, G, T; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if self._k is None or self._v is None:
            return
        held, new = (self._k.shape[0], self._k.shape[1], self._k.shape[3], self._v.shape[3]), (
            k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if held != new:
            raise ValueError(f"this cache holds (B, G, D, Dv)={held} but got {new}; "
                             "call cache.reset() before a new sequence")
        if (k.dtype, k.device) != (self._k.dtype, self._k.device):
            raise ValueError(f"this cache holds {self._k.dtype} on {self._k.device}, got {k.dtype} on {k.device}")

    def _reserve(self, needed: int, k: Tensor, v: Tensor) -> None:
        """Make room for ``needed`` positions, copying what is held into larger storage."""
        allocated = 0 if self._k is None else self._k.shape[2]
        if needed <= allocated:
            return
        size = self.capacity if self.capacity is not None else max(_MIN_ALLOC, needed, 2 * allocated)
        b, g, _, d = k.shape
        new_k = k.new_empty(b, g, size, d)
        new_v = v.new_empty(b, g, size, v.shape[3])
        if self._k is not None and self._v is not None:
            new_k[:, :, : self._length] = self._k[:, :, : self._length]
            new_v[:, :, : self._length] = self._v[:, :, : self._length]
        self._k, self._v = new_k, new_v

    def _leave_inference_mode(self) -> None:
        """Storage made under ``torch.inference_mode()`` cannot be written outside it: copy it once."""
        if torch.compiler.is_compiling() or self._k is None or self._v is None:
            return
        if self._k.is_inference() and not torch.is_inference_mode_enabled():
            self._k, self._v = self._k.clone(), self._v.clone()

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, G, T, D) after the positions held; return all keys and values held."""
        self._check(k, v)
        self._leave_inference_mode()
        needed = self._length + k.shape[2]
        if self.capacity is not None and needed > self.capacity:
            raise ValueError(f"KVCache capacity {self.capacity} exceeded: it holds {self._length} "
                             f"positions and {k.shape[2]} more were appended")
        self._reserve(needed, k, v)
        assert self._k is not None and self._v is not None  # _reserve allocated them
        start, self._length = self._length, needed
        self._k[:, :, start:needed] = k.detach()
        self._v[:, :, start:needed] = v.detach()
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # keep autograd's path to this call's keys and values (earlier ones are constants)
            return (torch.cat([self._k[:, :, :start], k], dim=2),  # (B, G, S - T, D) + (B, G, T, D)
                    torch.cat([self._v[:, :, :start], v], dim=2))
        return self._k[:, :, :needed], self._v[:, :, :needed]
