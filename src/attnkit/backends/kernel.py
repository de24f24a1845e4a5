"""Kernel components: an attention kernel handed to a layer as an object instead of a backend's name.

A layer's ``backend`` is either the name of a registered backend ("auto",
"sdpa", ...) or a component that implements :class:`Kernel`, such as
:class:`attnkit.distributed.ContextParallel` (ring attention over a sharded
sequence). Either way the layer projects, rotates and merges heads in one
code path; only the attention in the middle differs. A call to the layer then:

1. describes itself to ``kernel.prepare(request)`` before it computes anything:
   the kernel raises if it cannot serve the call (a distributed kernel raises
   the same error on every rank) and may say where the tokens sit (positions
   (B, T), e.g. a shard's global positions), which rotary embedding uses;
2. projects x and rotates q and k at these positions;
3. calls ``kernel.attention(q, k, v, causal=..., key_mask=..., scale=...)``;
4. merges the heads of its result and applies ``out_proj``.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head
dim, Dv value head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@dataclass(frozen=True)
class KernelRequest:
    """What a layer is about to ask of a kernel component, described before it computes anything.

    ``given`` names the call's optional arguments that were set ("positions",
    "kv_cache", "attn_mask", "need_weights"). :meth:`Kernel.attention`
    receives none of them except through the keys (a cache's) and positions
    (rotary embedding), so a kernel refuses in :meth:`Kernel.prepare` what it
    cannot honour; likewise a ``window`` or a ``dropout_p`` above 0.
    """

    batch: int  # B
    length: int  # T, this call's queries
    device: torch.device
    causal: bool
    window: int | None
    dropout_p: float  # in effect for this call: the layer's dropout in training mode, else 0
    given: tuple[str, ...]


@runtime_checkable
class Kernel(Protocol):
    """The protocol of a kernel component (see the module docstring for the order of calls)."""

    def prepare(self, request: KernelRequest) -> Tensor | None:
        """Raise if this kernel cannot serve ``request``; the tokens' positions long (B, T), or None.

        None keeps the call's own positions (given, or 0 .. T - 1 after
        what a cache holds).
        """
        ...

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, key_mask: Tensor | None,
                  scale: float) -> Tensor:
        """softmax(q k^T * scale) v over q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv): (B, H, T, Dv).

        ``key_mask`` bool (B, S), True = a real key, or None; ``causal`` with
        the band the kernel's own positions define.
        """
        ...


_METHODS = ("prepare", "attention")


def check_kernel(kernel: object) -> None:
    """Raise TypeError naming what ``kernel`` lacks of the :class:`Kernel` protocol."""
    missing = [name for name in _METHODS if not callable(getattr(kernel, name, None))]
    if missing:
        raise TypeError(f"backend must be a backend's name (str) or a kernel component with methods "
                        f"{' and '.join(_METHODS)} (e.g. attnkit.distributed.ContextParallel); "
                        f"{type(kernel).__name__} lacks {', '.join(missing)}")
