"""A KV cache in int8: a quarter of float32's bytes per position, and decoding that reads only those bytes.

    caches = model.new_caches(dtype=torch.int8)       # or generate(..., kv_dtype="int8")
    with torch.inference_mode():
        out = layer(x_new, kv_cache=cache)            # cache = Int8KVCache(), one per layer

At a long context a decoding step reads every cached key and value once per
layer, 4 bytes a number in float32. Here each key is stored as int8 codes
with one bfloat16 scale per (row, key/value head, position), its largest
magnitude / 127: exactly the weight format of PyTorch's
``torch._weight_int8pack_mm``, so the scores of one key/value head's queries
over S keys are one call of that kernel, reading S * D bytes. Values are
stored transposed, (Dv, S), with one scale per position (bfloat16, kept in float32) that
multiplies the probabilities first: ``out = (p * scale) @ codes^T``, the same
kernel again. Storage grows in chunks of :data:`CHUNK` positions, and the
value product reads the whole chunk, with probability 0 past the last key
(the kernel takes contiguous weights only, their inner size a multiple of
16: it returns wrong numbers, or crashes, for others).

:func:`attnkit.backends.int8.int8_attention` runs those kernels
(:meth:`Int8Keys.attention`); the layer calls it for calls
it can serve (:meth:`Int8Keys.reads_directly`): a backend by name, no
modifiers or sinks, no ``attn_mask``, no weights asked for, no dropout, no
trace watching, not under ``torch.compile`` (Inductor cannot lower the
kernel), and few query rows per key/value head (decoding, a draft, or a
prompt of up to ``KERNEL_ROWS / R`` tokens). Masks from
positions, windows and padding (``key_mask`` (B, S)) are applied to its
scores. Every other call attends over the keys and values dequantised to the
query's dtype (:meth:`Int8Keys.dequantized`), by the layer's usual path: the
same stored numbers, read at float32's cost.

Rounding: codes keep each key and value to 1/254 of its largest entry, and
the kernel takes queries and probabilities in bfloat16 and returns bfloat16
scores; a query with no visible key gets 0. On SmolLM2 with int4 weights it
keeps 96.1% of float32's greedy choices (98.4% over a float32 cache), below
the weight forms' 97% bar: an opt-in, faster from a few thousand cached
positions and slower below (BENCHMARKS.md, round eight). It reads every held
key, where a float cache under a sliding window reads only the window: on such
layers (Gemma 3's local ones) it is slower. For inference only: a call whose
keys need gradients is refused.

Legend: B batch, G key/value heads, R query heads per key/value head, H = G * R,
T new positions, S positions held, C positions allocated (>= S), D head dim, Dv
value head dim, N = R * T query rows per key/value head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.backends.int8 import int8_attention

from .kv_cache import CachedKeys, GrowingSlots
from .packed import quantize_rows

CHUNK = 256  # positions per growth of the storage
KERNEL_ROWS = 64  # the most query rows per key/value head (N) that the int8 kernels attend for
ACTIVATIONS = (torch.float32, torch.bfloat16)  # the layer dtypes whose keys this cache takes


@dataclass(frozen=True)
class Int8Keys:
    """What :class:`Int8KVCache` hands the layer: the codes and scales of every position held.

    Views of the cache's storage, valid until its next update.
    """

    k_codes: Tensor  # (B, G, S, D) int8, each (row, head) a contiguous prefix of its (C, D) storage
    k_scale: Tensor  # (B, G, S) bfloat16
    v_codes_t: Tensor  # (B, G, Dv, C) int8: values transposed, the whole allocation
    v_scale: Tensor  # (B, G, S) float32
    positions: Tensor | None  # (B, S) long, -1 = empty slot; None: key j is at position j in every row

    @property
    def length(self) -> int:
        return self.k_codes.shape[2]

    def dequantized(self, dtype: torch.dtype) -> CachedKeys:
        """The keys and values held, as ``dtype`` tensors (B, G, S, D) and (B, G, S, Dv)."""
        k = self.k_codes.float() * self.k_scale.float()[..., None]  # (B, G, S, D) * (B, G, S, 1)
        v = self.v_codes_t[..., : self.length].transpose(2, 3).float() * self.v_scale[..., None]  # (B, G, S, Dv)
        return CachedKeys(k.to(dtype), v.to(dtype), self.positions)

    def reads_directly(self, q: Tensor) -> bool:
        """Whether :meth:`attention` serves queries q (B, H, T, D): on the CPU (the kernel's), a head dim it
        takes (a multiple of 16: others it reads wrongly), few rows per key/value head, and a batch whose
        (row, head) loop costs less than dequantising (short caches of many rows dequantise)."""
        b, h, t, d = q.shape
        g = self.k_codes.shape[1]
        return (q.device.type == "cpu" and d % 16 == 0 and h // g * t <= KERNEL_ROWS
                and self.length >= 128 * (b - 1) and not torch.compiler.is_compiling())

    def attention(self, q: Tensor, scale: float, visible: Tensor | None) -> Tensor:
        """softmax(q k^T * scale) v over the int8 keys and values: q (B, H, T, D) -> (B, H, T, Dv) in q's dtype
        (:func:`attnkit.backends.int8.int8_attention`); ``visible`` bool (B, 1, T, S), True = may attend, or
        None (every key)."""
        return int8_attention(q, self.k_codes, self.k_scale, self.v_codes_t, self.v_scale,
                              scale, visible)


def _grown(old: Tensor | None, shape: tuple[int, ...], dim: int, like: Tensor, dtype: torch.dtype) -> Tensor:
    """Zeroed storage of ``shape`` holding ``old`` at the start of ``dim``."""
    new = like.new_zeros(shape, dtype=dtype)
    if old is not None:
        new.narrow(dim, 0, old.shape[dim]).copy_(old)
    return new


class Int8KVCache(GrowingSlots):
    """A growing store of int8 keys and values (B, G, S, D) for one layer; see the module docstring.

    Args:
        capacity: the most positions it may hold; appending past it raises.
            None (default) grows as needed.

    Used like :class:`attnkit.KVCache` (``len``, ``positions``, ``reset()``,
    ``crop(n)``, explicit positions per row): it takes the keys of a float32
    or bfloat16 layer and stores them in a quarter (or half) of the bytes.
    For inference only (no gradients reach the keys).
    """

    _kind = "Int8KVCache"
    _STORAGE = ("_kc", "_ks", "_vt", "_vs", "_pos", "_top")
    dtype = torch.int8

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
            raise ValueError(f"capacity must be a positive int or None, got capacity={capacity!r}")
        self.capacity = capacity
        self._kc: Tensor | None = None  # (B, G, C, D) int8
        self._ks: Tensor | None = None  # (B, G, C) bfloat16
        self._vt: Tensor | None = None  # (B, G, Dv, C) int8
        self._vs: Tensor | None = None  # (B, G, C) float32
        self._pos: Tensor | None = None  # (B, C) positions once a call gave explicit ones
        self._top: Tensor | None = None  # (B,) the highest position each row holds, with _pos
        self._length = 0
        self._owner: int | None = None

    def __repr__(self) -> str:
        shape = None if self._kc is None else (self._kc.shape[0], self._kc.shape[1], self._length, self._kc.shape[3])
        return f"Int8KVCache(len={self._length}, capacity={self.capacity}, shape={shape})"

    def keys_and_values(self, dtype: torch.dtype = torch.float32) -> CachedKeys | None:
        """The keys and values held, dequantised to ``dtype`` (B, G, S, D), or None before the first update."""
        return None if self._kc is None else self._held().dequantized(dtype)

    def __copy__(self) -> Int8KVCache:
        """An independent cache holding the same positions (storage is copied, never shared)."""
        return self._cloned_into(Int8KVCache(self.capacity))

    def _check(self, k: Tensor, v: Tensor) -> None:
        if k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
            raise ValueError(f"keys and values must be (B, G, T, D) and agree on B, G, T; "
                             f"got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.dtype != v.dtype or k.dtype not in ACTIVATIONS:
            raise ValueError(f"Int8KVCache takes float32 or bfloat16 keys and values of one dtype, got {k.dtype} and "
                             f"{v.dtype}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError("Int8KVCache is for inference: call under torch.no_grad() or torch.inference_mode(), "
                             "or use KVCache, which keeps gradients")
        if self._kc is None or self._vt is None:
            return
        held = (self._kc.shape[0], self._kc.shape[1], self._kc.shape[3], self._vt.shape[2])
        new = (k.shape[0], k.shape[1], k.shape[3], v.shape[3])
        if held != new:
            raise ValueError(f"this cache holds (B, G, D, Dv)={held} but got {new}; "
                             "call cache.reset() before a new sequence")
        if k.device != self._kc.device:
            raise ValueError(f"this cache holds keys on {self._kc.device}, got keys on {k.device}")

    def _reserve(self, needed: int, k: Tensor, v: Tensor, explicit: bool) -> None:
        """Room for ``needed`` slots, in whole chunks (what is held is copied into the larger storage)."""
        allocated = 0 if self._kc is None else self._kc.shape[2]
        if needed > allocated:
            size = -(-needed // CHUNK) * CHUNK  # whole chunks, a capacity aside: the kernel needs C % 16 == 0
            b, g, _, d = k.shape
            self._kc = _grown(self._kc, (b, g, size, d), 2, k, torch.int8)
            self._ks = _grown(self._ks, (b, g, size), 2, k, torch.bfloat16)
            self._vt = _grown(self._vt, (b, g, v.shape[3], size), 3, k, torch.int8)
            self._vs = _grown(self._vs, (b, g, size), 2, k, torch.float32)
            self._pos = None if self._pos is None else _grown(self._pos, (b, size), 1, self._pos, torch.long)
        if explicit and self._pos is None:
            assert self._kc is not None
            self._number_held_slots(self._kc.shape[2], k.shape[0], k.device)

    def write(self, k: Tensor, v: Tensor, positions: Tensor | None) -> Int8Keys:
        """Store k, v (B, G, T, D) in the next slots (at ``positions`` (B, T), or slot = position), unchecked
        (:meth:`update` checks first)."""
        start, t = self._length, k.shape[2]
        self._reserve(self._begin_update(k), k, v, positions is not None)
        assert self._kc is not None and self._ks is not None and self._vt is not None and self._vs is not None
        new = slice(start, start + t)
        if k.shape == v.shape:  # one pass over both: (2, B, G, T, D)
            (k_codes, v_codes), (k_scale, v_scale) = quantize_rows(torch.stack((k, v)), torch.bfloat16)
        else:
            (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k, torch.bfloat16), quantize_rows(v, torch.bfloat16)
        self._kc[:, :, new], self._ks[:, :, new], self._vs[:, :, new] = k_codes, k_scale, v_scale  # (B, G, T[, D])
        self._vt[:, :, :, new] = v_codes.transpose(2, 3)  # (B, G, T, Dv) -> (B, G, Dv, T)
        self._note_positions(start, start + t, positions, k.shape[0], k.device)
        self._length = start + t
        return self._held()

    def _held(self) -> Int8Keys:
        assert self._kc is not None and self._ks is not None and self._vt is not None and self._vs is not None
        s = self._length
        return Int8Keys(self._kc[:, :, :s], self._ks[:, :, :s], self._vt, self._vs[:, :, :s], self.positions)
