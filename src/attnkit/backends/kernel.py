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
3. calls ``kernel.attention(q, k, v, causal=..., key_mask=..., scale=...)``,
   adding ``score_mod=..., mask_mod=..., sinks=...`` only when the layer has
   modifiers or sinks (so a kernel written without them keeps serving layers
   without them; :func:`check_kernel` with ``modifiers=True`` says whether it
   can serve one with them);
4. merges the heads of its result and applies ``out_proj``.

Legend: B batch, H query heads, G key/value heads, T queries, S keys, D head
dim, Dv value head dim.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from attnkit.functional.modifiers import MaskMod, ScoreMod


@dataclass(frozen=True)
class KernelRequest:
    """What a layer is about to ask of a kernel component, described before it computes anything.

    ``given`` names the call's optional arguments that were set ("positions",
    "kv_cache", "attn_mask", "need_weights"). :meth:`Kernel.attention`
    receives none of them except through the keys (a cache's) and positions
    (rotary embedding), so a kernel refuses in :meth:`Kernel.prepare` what it
    cannot honour; likewise a ``window`` or a ``dropout_p`` above 0.
    ``problem``: why the layer's own checks refused this call (a bad ``x``
    or modifier), else None: a kernel whose ranks wait on each other must
    make every rank raise it, not leave the others waiting; the layer raises
    it after :meth:`Kernel.prepare` in any case.
    """

    batch: int  # B
    length: int  # T, this call's queries
    device: torch.device
    causal: bool
    window: int | None
    dropout_p: float  # in effect for this call: the layer's dropout in training mode, else 0
    given: tuple[str, ...]
    problem: str | None = None


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
                  scale: float, score_mod: ScoreMod | None = None, mask_mod: MaskMod | None = None,
                  sinks: Tensor | None = None) -> Tensor:
        """softmax(q k^T * scale) v over q (B, H, T, D), k (B, G, S, D), v (B, G, S, Dv): (B, H, T, Dv).

        ``key_mask`` bool (B, S), True = a real key, or None; ``causal`` with
        the band the kernel's own positions define. ``score_mod`` and
        ``mask_mod`` (FlexAttention's form, as :func:`attnkit.attention`
        takes them) see those positions too; ``sinks`` (H,) are learned sink
        logits. A layer passes these three only when it has them.
        """
        ...


_METHODS = ("prepare", "attention")
_MODIFIER_KEYWORDS = ("score_mod", "mask_mod", "sinks")


def _missing_keywords(fn: object) -> list[str]:
    """Which of score_mod, mask_mod, sinks ``fn`` cannot take as keywords ([] when unknown)."""
    try:
        params = inspect.signature(fn).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read: its call will tell
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [name for name in _MODIFIER_KEYWORDS if name not in params or params[name].kind not in keyword]


def check_kernel(kernel: object, *, modifiers: bool = False) -> None:
    """Raise TypeError naming what ``kernel`` lacks of the :class:`Kernel` protocol.

    ``modifiers``: the layer has modifiers or sinks, so ``kernel.attention``
    must take ``score_mod``, ``mask_mod`` and ``sinks`` too (a kernel without
    them passes when it is not asked to).
    """
    missing = [name for name in _METHODS if not callable(getattr(kernel, name, None))]
    if missing:
        raise TypeError(f"backend must be a backend's name (str) or a kernel component with methods "
                        f"{' and '.join(_METHODS)} (e.g. attnkit.distributed.ContextParallel); "
                        f"{type(kernel).__name__} lacks {', '.join(missing)}")
    lacking = _missing_keywords(kernel.attention) if modifiers else []  # type: ignore[attr-defined]
    if lacking:
        raise TypeError(f"a layer with score / mask modifiers or sinks needs a kernel component whose attention "
                        f"takes score_mod=, mask_mod= and sinks=; {type(kernel).__name__}.attention lacks "
                        f"{', '.join(lacking)}")
