"""Rotary position embedding (RoPE), the half-split form of GPT-NeoX and Llama.

Each query and key vector of head_dim D is cut into halves (x1, x2); pair
(x1[m], x2[m]) is rotated by the angle pos * base^(-2m / D). A query at
position i and a key at position j then score q_i . k_j as a function of
their vectors and of j - i alone.

Legend: B batch, H heads, T positions, D head dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def rotate_half(x: Tensor) -> Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., D) -> 2 x (..., D/2)
    return torch.cat((-x2, x1), dim=-1)  # -> (..., D)


def apply_rotary(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """x (..., T, D) rotated by angles whose cos and signed sin are (T, D) (or broadcast to x), as
    :meth:`RotaryEmbedding.signed_angles` gives them.

    ``signed_sin`` is (-sin, sin) by halves, so that rotate_half(x) * sin is
    x.roll(D/2) * signed_sin: one op instead of a chunk, a negation and a cat.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for heads of size ``head_dim`` (even).

    There is no length limit and no buffer: angles are computed for the
    positions each call needs (a model computes a step's once for all its
    layers: :class:`attnkit.modules.context.StepContext`), in float64 (float32 on devices without it)
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

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin of each position's angles, (T, D), both halves alike."""
        compute = torch.float32 if positions.device.type == "mps" else torch.float64
        exponents = torch.arange(0, self.head_dim, 2, dtype=compute, device=positions.device) / self.head_dim
        inv_freq = self.base**-exponents  # (D/2,)
        angles = (positions.to(compute) / self.scaling)[:, None] * inv_freq[None, :]  # (T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (T, D/2) -> (T, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def signed_angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and (-sin, sin) by halves, (T, D), of ``positions`` (T,), for :func:`apply_rotary`."""
        cos, sin = self.cos_sin(positions, dtype)
        half = self.head_dim // 2
        return cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)  # (T, D)

    def rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., T, D) rotated by the angles of ``positions`` (T,)."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding(head_dim={self.head_dim}) got vectors of size {x.shape[-1]}")
        return apply_rotary(x, *self.signed_angles(positions, x.dtype))

    def forward(self, q: Tensor, k: Tensor, *, offset: int = 0, positions: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
        """Rotate q and k (B, *, T, D) as positions offset .. offset + T - 1, or at per-row ``positions`` (B, T)."""
        if q.shape[-2] != k.shape[-2]:
            raise ValueError(f"q and k must cover the same positions, got T={q.shape[-2]} and {k.shape[-2]}")
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding(head_dim={self.head_dim}) got vectors of size "
                             f"{q.shape[-1]} and {k.shape[-1]}")
        if positions is not None:
            b, t = positions.shape
            cos, sin = self.signed_angles(positions.reshape(-1), q.dtype)  # (B * T, D) each
            cos, sin = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)  # (B, 1, T, D): broadcast over heads
        else:
            cos, sin = self.signed_angles(torch.arange(offset, offset + q.shape[-2], device=q.device), q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos.to(k.dtype), sin.to(k.dtype))  # .to: free if alike

    def extra_repr(self) -> str:
        scaling = "" if self.scaling == 1 else f", scaling={self.scaling:g}"
        return f"head_dim={self.head_dim}, base={self.base:g}{scaling}"
