"""Argument checks for the textbook classes.

The textbook package imports nothing else from attnkit, so it keeps its own
small set of checks. Each error names the offending value and what was
expected; none is a bare ``assert`` (which ``python -O`` would strip).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` if it is a positive int, else raise naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {name}={value}")
    return value


def check_dropout(p: object) -> float:
    """Return ``p`` as a float if it lies in [0, 1)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {type(p).__name__} {p!r}")
    if not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout={p} is outside [0, 1): it is the probability of dropping a weight")
    return float(p)


def check_divisible(d_out: int, num_heads: int) -> int:
    """Return the head dimension ``d_out // num_heads``; it must be exact."""
    if d_out % num_heads != 0:
        raise ValueError(
            f"d_out={d_out} is not divisible by num_heads={num_heads}: "
            "each head gets d_out // num_heads dimensions"
        )
    return d_out // num_heads


def check_input(x: object, d_in: int, context_length: int | None = None, *, like: Tensor | None = None,
                finite: bool | None = None) -> Tensor:
    """Validate an input of shape (num_tokens, d_in) or (b, num_tokens, d_in).

    Args:
        like: a parameter of the layer: x must have its dtype and device (else
            torch's bare "mat1 and mat2 must have the same dtype" comes later).
        finite: whether to check that every value is finite, a full pass over
            x that on an accelerator waits for the device. None (the layers'
            default) checks on the CPU only, where the pass costs no sync and
            is small beside the projections; True checks everywhere (the
            walkthrough); False never.

    Returns ``x`` with a batch dimension: (b, num_tokens, d_in).
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x must have shape (num_tokens, d_in={d_in}) or (batch, num_tokens, d_in={d_in}), "
            f"got {x.dim()}-d shape {tuple(x.shape)}"
        )
    if x.shape[-1] != d_in:
        raise ValueError(
            f"x has last dimension {x.shape[-1]}, expected d_in={d_in} (x shape {tuple(x.shape)})"
        )
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if like is not None and not _autocast(x):  # under autocast, torch casts for itself
        _check_like(x, like)
    num_tokens = x.shape[-2]
    if num_tokens == 0:
        raise ValueError("x has no tokens (num_tokens=0)")
    if context_length is not None and num_tokens > context_length:
        raise ValueError(
            f"x has num_tokens={num_tokens} but this layer was built with "
            f"context_length={context_length}: its causal mask covers at most "
            f"{context_length} tokens (build it with a larger context_length)"
        )
    if finite or (finite is None and x.device.type == "cpu"):
        _check_finite(x)
    return x if x.dim() == 3 else x.unsqueeze(0)  # (T, d_in) -> (1, T, d_in)


def _autocast(x: Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type autocast does not know (meta)
        return False


def _check_like(x: Tensor, like: Tensor) -> None:
    if x.dtype != like.dtype:
        raise TypeError(
            f"x has dtype {x.dtype} but this layer's weights are {like.dtype}: convert one to match "
            f"(x.to({like.dtype}) or layer.to({x.dtype}))"
        )
    if x.device != like.device:
        raise ValueError(f"x is on {x.device} but this layer's weights are on {like.device}: move one to the other")


def _check_finite(x: Tensor) -> None:
    if x.device.type != "meta" and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"x contains {bad} non-finite value(s) (nan or inf); embeddings must be finite")
