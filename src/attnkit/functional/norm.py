"""Root-mean-square normalisation, and the per-head norm of queries and keys that some models apply.

    norm = RMSNorm(640, eps=1e-6)                           # over the last dimension, times a learned weight
    qk_norm = QKNorm(RMSNorm(256, eps=1e-6), RMSNorm(256, eps=1e-6))
    layer = attnkit.MultiHeadAttention(..., qk_norm=qk_norm)  # normalises each head's q and k before RoPE

Legend: B batch, H query heads, G key/value heads, T positions, D head dim, C width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension, computed in at least float32.

    The weight multiplies as stored (llama.cpp's files hold Gemma's ``1 + w``
    already). Half-precision inputs are normalised in float32 and cast back
    before the weight, as Llama does.
    """

    def __init__(self, size: int, *, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def reset_parameters(self) -> None:
        """A weight of ones, as built (e.g. after ``to_empty()``)."""
        with torch.no_grad():
            self.weight.fill_(1.0)

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype in (torch.float32, torch.float64):  # (no conversions: each costs a call per layer and step)
            return self.weight * torch.rms_norm(x, x.shape[-1:], eps=self.eps)  # (..., C): one fused op
        h = torch.rms_norm(x.float(), x.shape[-1:], eps=self.eps)  # half precision: normalised in float32
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps:g}"


class QKNorm(nn.Module):
    """A norm of each query head and one of each key head, over the head dim: a layer component.

    ``forward(q, k)`` takes q (B, H, T, D) and k (B, G, T, D) and returns them
    normalised: ``q_norm`` and ``k_norm`` are any modules that map (..., D) to
    (..., D), such as :class:`RMSNorm` (Gemma 3, Qwen 3, OLMo 2 use RMSNorm,
    one weight for queries and one for keys, shared by the heads).
    :class:`attnkit.MultiHeadAttention` applies it after the projection and
    before the rotary embedding.
    """

    def __init__(self, q_norm: nn.Module, k_norm: nn.Module) -> None:
        super().__init__()
        for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)):
            if not isinstance(norm, nn.Module):
                raise TypeError(f"{name} must be an nn.Module (e.g. RMSNorm(head_dim, eps=1e-6)), "
                                f"got {type(norm).__name__}")
        self.q_norm, self.k_norm = q_norm, k_norm

    def forward(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (B, H, T, D), (B, G, T, D): shapes kept
