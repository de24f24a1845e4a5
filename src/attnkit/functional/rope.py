"""Rotary position embedding (RoPE), the half-split form of GPT-NeoX and Llama.

Each query and key vector of head_dim D is cut into halves (x1, x2); pair
(x1[m], x2[m]) is rotated by the angle pos * base^(-2m / D). A query at
position i and a key at position j then score q_i . k_j as a function of
their vectors and of j - i alone.

Legend: B batch, H heads, T positions, D head dim.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., D) -> 2 x (..., D/2)
    return torch.cat((-x2, x1), dim=-1)  # -> (..., D)


def _apply(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x (..., T, D) rotated by angles whose cos and sin are (T, D).

    ``signed_sin`` is (-sin, sin) by halves, so that rotate_half(x) * sin is
    x.roll(D/2) * signed_sin: one op instead of a chunk, a negation and a cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for heads of size ``head_dim`` (even).

    There is no length limit and no buffer: angles are computed for the
    positions each call needs, in float64 (float32 on devices without it)
    whatever the input dtype, so half-precision layers keep exact positions.
    ``forward(q, k, offset=n)`` rotates q and k (B, H, T, D) as positions
    n .. n + T - 1, as a KV cache holding n positions needs. ``scaling`` > 1 is
    linear position interpolation: every position is divided by it (a model
    trained with ``rope_scaling={"rope_type": "linear", "factor": scaling}``).
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, scaling: float = 1.0) -> None:
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RotaryEmbedding needs a positive even head_dim, got head_dim={head_dim!r}")
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 1:
            raise ValueError(f"RotaryEmbedding base must be > 1, got base={base!r} (expected a finite number)")
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not (
                math.isfinite(scaling) and scaling > 0):
            raise ValueError(f"RotaryEmbedding scaling must be a finite number > 0, got scaling={scaling!r}")
        self.head_dim, self.base, self.scaling = head_dim, float(base), float(scaling)
        self._last: tuple[tuple[object, ...], tuple[Tensor, Tensor]] | None = None  # see _angles_at
        self._rows: tuple[Any, tuple[object, ...], tuple[Tensor, Tensor]] | None = None  # see _angles_of

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "_last": None, "_rows": None}  # the cache is not part of the module

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of each position's angles, (T, D), both halves alike."""
        compute = torch.float32 if positions.device.type == "mps" else torch.float64
        exponents = torch.arange(0, self.head_dim, 2, dtype=compute, device=positions.device) / self.head_dim
        inv_freq = self.base**-exponents  # (D/2,)
        angles = (positions.to(compute) / self.scaling)[:, None] * inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D/2) -> (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def _signed(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and (-sin, sin) by halves, (T, D), for :func:`_apply`."""
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # (T, D)

    def _angles_at(self, offset: int, length: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[Tensor, Tensor]:
        """:meth:`_signed` for positions offset .. offset + length - 1, remembering the last call's.

        A model whose layers share one RotaryEmbedding computes the angles of
        a decoding step once instead of once per layer.
        """
        if torch.compiler.is_compiling():  # the graph computes them; no Python-side state
            return self._signed(torch.arange(offset, offset + length, device=device), dtype)
        key = (offset, length, dtype, device, torch.is_inference_mode_enabled(), self.head_dim, self.base,
               self.scaling)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        angles = self._signed(torch.arange(offset, offset + length, device=device), dtype)
        self._last = (key, angles)
        return angles

    def _angles_of(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`_signed` at per-row positions (B, T) as (B, 1, T, D), remembered for the same tensor.

        The layers of a model are handed one positions tensor per step: its angles are computed once.
        """
        b, t = positions.shape
        if not torch.compiler.is_compiling():
            last = self._rows
            if last is not None and last[0]() is positions and last[1] == (dtype, self.base, self.scaling):
                return last[2]
        cos, sin = self._signed(positions.reshape(-1), dtype)  # (B * T, D) each
        angles = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)  # (B, 1, T, D): broadcast over heads
        if not torch.compiler.is_compiling():
            self._rows = (weakref.ref(positions), (dtype, self.base, self.scaling), angles)
        return angles

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., T, D) rotated by the angles of ``positions`` (T,)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding(head_dim={self.head_dim}) got vectors of size {x.shape[-1]}")
        return _apply(x, *self._signed(positions, x.dtype))

    def forward(self, q: Tensor, k: Tensor, *, offset: int = 0, positions: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """Rotate q and k (B, *, T, D) as positions offset .. offset + T - 1, or at per-row ``positions`` (B, T)."""
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"q and k must cover the same positions, got T={q.shape[-2]} and {k.shape[-2]}")
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding(head_dim={self.head_dim}) got vectors of size "
                             f"{q.shape[-1]} and {k.shape[-1]}")
        if positions is not None:
            cos, sin = self._angles_of(positions, q.dtype)  # (B, 1, T, D) each
            return _apply(q, cos, sin), _apply(k, cos.to(k.dtype), sin.to(k.dtype))
        cos, sin = self._angles_at(offset, q.shape[-2], q.dtype, q.device)  # (T, D) each
        return _apply(q, cos, sin), _apply(k, cos.to(k.dtype), sin.to(k.dtype))  # .to is free for the same dtype

    def extra_repr(self) -> str:
        scaling = "" if self.scaling == 1 else f", scaling={self.scaling:g}"
        return f"head_dim={self.head_dim}, base={self.base:g}{scaling}"
