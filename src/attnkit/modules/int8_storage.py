"""KV cache storage in int8: a quarter of float32's bytes per position, and decoding that reads only those bytes.

    caches = model.new_caches(dtype=torch.int8)       # or generate(..., kv_dtype="int8")
    with torch.inference_mode():
        out = layer(x_new, kv_cache=cache)            # cache = KVCache(dtype=torch.int8), one per layer

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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.backends.int8 import int8_attention

from .cache_protocol import CachedKeys
from .kv_storage import check_dims
from .packed import quantize_rows

CHUNK = 256  # positions per growth of the storage
KERNEL_ROWS = 64  # the most query rows per key/value head (N) that the int8 kernels attend for
ACTIVATIONS = (torch.float32, torch.bfloat16)  # the layer dtypes whose keys this cache takes


@dataclass(frozen=True)
class Int8Keys:
    """What a :class:`~attnkit.modules.kv_cache.KVCache` in int8 hands the layer: the codes and scales of every
    position held.

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


class Int8Storage:
    """Keys and values as int8 codes and scales, for a :class:`~attnkit.modules.kv_cache.KVCache` with
    ``dtype=torch.int8``; see the module docstring.

    It takes the keys of a float32 or bfloat16 layer and stores them in a
    quarter (or half) of the bytes, growing a chunk at a time. For inference
    only (keys that need gradients are refused).
    """

    def __init__(self) -> None:
        self.kc: Tensor | None = None  # (B, G, C, D) int8
        self.ks: Tensor | None = None  # (B, G, C) bfloat16
        self.vt: Tensor | None = None  # (B, G, Dv, C) int8
        self.vs: Tensor | None = None  # (B, G, C) float32
        self.allocated = 0

    def check(self, k: Tensor, v: Tensor) -> None:
        if k.dtype != v.dtype or k.dtype not in ACTIVATIONS:
            raise ValueError(f"KVCache(dtype=torch.int8) takes float32 or bfloat16 keys and values of one dtype, got "
                             f"{k.dtype} and {v.dtype}")
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise ValueError("KVCache(dtype=torch.int8) is for inference: call under torch.no_grad() or "
                             "torch.inference_mode(), or store floats (dtype None, bfloat16 or float16), which keep "
                             "gradients")
        if self.kc is None:
            return
        check_dims(self.dims(), k, v)
        if k.device != self.kc.device:
            raise ValueError(f"this cache holds keys on {self.kc.device}, got keys on {k.device}")

    def size_for(self, needed: int, capacity: int | None) -> int:
        """Whole chunks, a capacity aside: the kernel needs C % 16 == 0, and the value product reads all C."""
        return -(-needed // CHUNK) * CHUNK

    def grow(self, size: int, held: int, k: Tensor, v: Tensor) -> None:
        b, g, _, d = k.shape
        self.kc = _grown(self.kc, (b, g, size, d), 2, k, torch.int8)
        self.ks = _grown(self.ks, (b, g, size), 2, k, torch.bfloat16)
        self.vt = _grown(self.vt, (b, g, v.shape[3], size), 3, k, torch.int8)
        self.vs = _grown(self.vs, (b, g, size), 2, k, torch.float32)
        self.allocated = size

    def put(self, start: int, k: Tensor, v: Tensor, positions: Tensor | None) -> Int8Keys:
        assert self.kc is not None and self.ks is not None and self.vt is not None and self.vs is not None
        new = slice(start, start + k.shape[2])
        if k.shape == v.shape:  # one pass over both: (2, B, G, T, D)
            (k_codes, v_codes), (k_scale, v_scale) = quantize_rows(torch.stack((k, v)), torch.bfloat16)
        else:
            (k_codes, k_scale), (v_codes, v_scale) = quantize_rows(k, torch.bfloat16), quantize_rows(v, torch.bfloat16)
        self.kc[:, :, new], self.ks[:, :, new], self.vs[:, :, new] = k_codes, k_scale, v_scale  # (B, G, T[, D])
        self.vt[:, :, :, new] = v_codes.transpose(2, 3)  # (B, G, T, Dv) -> (B, G, Dv, T)
        return self.held(start + k.shape[2], positions)

    def held(self, length: int, positions: Tensor | None) -> Int8Keys:
        assert self.kc is not None and self.ks is not None and self.vt is not None and self.vs is not None
        return Int8Keys(self.kc[:, :, :length], self.ks[:, :, :length], self.vt, self.vs[:, :, :length], positions)

    def dims(self) -> tuple[int, int, int, int] | None:
        if self.kc is None or self.vt is None:
            return None
        return (self.kc.shape[0], self.kc.shape[1], self.kc.shape[3], self.vt.shape[2])

    def tensors(self) -> tuple[Tensor | None, ...]:
        return (self.kc, self.ks, self.vt, self.vs)

    def set_tensors(self, tensors: Sequence[Tensor | None]) -> None:
        self.kc, self.ks, self.vt, self.vs = tensors
        self.allocated = 0 if self.kc is None else self.kc.shape[2]
