"""One forward step of a model, described once and read by every layer (gpt-fast's ``input_pos``, nano-vllm's
context).

A model checks its inputs at the door, then builds a :class:`StepContext` and
hands it to each attention layer (``layer(x, context=ctx, kv_cache=cache)``).
A layer given a context checks nothing: it reads where its queries sit, the
padding, the rotary angles and the visibility band from the context, which
computes each of them once for the step and keeps it for the next layer. A
layer called alone, without a context, checks everything as before.

The model's caches advance together (one per layer, made by the same
``new_caches()`` and written in the same steps), so where the first layer's
cache puts this step's tokens is where every layer's does, and the band built
for the first layer is every layer's.

Legend: B batch, T new tokens, S keys held after the step, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from attnkit.backends import AttentionCall, choose, observed, run
from attnkit.backends.call import widened
from attnkit.functional import position_mask
from attnkit.functional.rope import RotaryEmbedding


@dataclass
class StepContext:
    """Where a step's tokens sit, and what every layer derives from it, computed once.

    Attributes:
        length: T, the tokens of this step in each row.
        offset: with ``positions`` None, the tokens sit at offset .. offset +
            T - 1 in every row and keys are a plain prefix 0 .. S - 1 (the
            symbolic band: kernels need no mask).
        positions: (B, T) long, each token's own position (-1: padding), or None.
        key_mask: (B, S) bool, True = a real key; None: every key is real.
        check_caches: each layer has its cache check this step's keys before
            storing them (a model's ``forward``: the caches are the caller's);
            False inside ``step``, whose caller built them.
    """

    length: int
    offset: int = 0
    positions: Tensor | None = None
    key_mask: Tensor | None = None
    check_caches: bool = False
    _angles: dict[tuple[RotaryEmbedding, torch.dtype], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    _masks: dict[tuple[bool, int | None], Tensor] = field(default_factory=dict, repr=False)
    _kernels: dict[tuple[str, bool, bool, bool, bool], Callable[[AttentionCall], Tensor]] = field(
        default_factory=dict, repr=False)

    def kernel(self, backend: str, call: AttentionCall) -> Callable[[AttentionCall], Tensor]:
        """The kernel ``backend`` ("auto", "sdpa", ...) chooses for calls like ``call``, chosen once per step:
        every layer of the step makes calls of one size, band and mask (a layer with dropout in training, or
        keys stored in fewer bytes, gets its own choice); a kernel with a ``plan`` (SDPA) makes its decisions
        for the step's calls once. While :func:`attnkit.trace` observes
        attention, every call goes through :func:`attnkit.backends.run`, which records it."""
        key = (backend, call.causal, call.mask is None, call.k.dtype != call.q.dtype, call.dropout_p > 0)
        if key not in self._kernels:
            if observed():
                self._kernels[key] = lambda c: run(c, backend=backend)  # type: ignore[assignment,return-value]
            else:
                kernel = choose(backend, call, return_weights=False)
                chosen = kernel.run if kernel.plan is None or key[3] else kernel.plan(call)  # decided once a step
                self._kernels[key] = (lambda c: chosen(widened(c))) if key[3] else chosen
        return self._kernels[key]

    def angles(self, rope: RotaryEmbedding, length: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[Tensor, Tensor]:
        """cos and signed sin of this step's positions for ``rope``: (T, D), or (B, 1, T, D) per row."""
        key = (rope, dtype)  # a module hashes by identity
        if key not in self._angles:
            if self.positions is None:
                at = torch.arange(self.offset, self.offset + length, device=device)  # (T,)
                self._angles[key] = rope.signed_angles(at, dtype)  # (T, D) each
            else:
                b, t = self.positions.shape
                cos, sin = rope.signed_angles(self.positions.reshape(-1), dtype)  # (B * T, D) each
                self._angles[key] = cos.view(b, 1, t, -1), sin.view(b, 1, t, -1)  # (B, 1, T, D): over heads
        return self._angles[key]

    def mask(self, key_positions: Tensor | None, num_keys: int, *, causal: bool, window: int | None = None
             ) -> Tensor:
        """What a layer's queries may see, bool (B, 1, T, S) or (B, 1, 1, S), True = may attend.

        With explicit positions (this step's or the cache's, ``key_positions`` (B, S)), the causal / window
        band aligned by them and the padding; for a plain prefix, the padding alone (the kernel aligns the
        band by index: a plain prefix without padding needs no mask at all). Built once per (causal, window):
        every layer of the step holds the same keys (its key count is not part of the key, so that a compiled
        step's symbolic count stays symbolic)."""
        explicit = self.positions is not None or key_positions is not None
        key = (causal, window if explicit else None)
        if key not in self._masks:
            if self.key_mask is not None and self.key_mask.shape[1] != num_keys:  # once per step
                raise ValueError(f"attention_mask must be (B, S) = ({self.key_mask.shape[0]}, {num_keys}): S counts "
                                 f"the cache's positions and this step's {self.length}; got "
                                 f"{tuple(self.key_mask.shape)}")
            mask = None if self.key_mask is None else self.key_mask[:, None, None, :]  # (B, S) -> (B, 1, 1, S)
            if explicit:
                q_pos, k_pos = self._explicit(key_positions, num_keys)  # (B, T), (B, S)
                band = position_mask(q_pos, k_pos, causal=causal, window=window)  # (B, 1, T, S)
                mask = band if mask is None else band & mask
            assert mask is not None
            self._masks[key] = mask
        return self._masks[key]

    def _explicit(self, key_positions: Tensor | None, num_keys: int) -> tuple[Tensor, Tensor]:
        """The queries' positions (B, T) and the keys' (B, S), a plain prefix spelled out where not given."""
        if self.positions is not None:
            q_pos = self.positions
            device = q_pos.device
        else:
            assert key_positions is not None
            b, device = key_positions.shape[0], key_positions.device
            q_pos = (self.offset + torch.arange(self.length, device=device)).expand(b, self.length)  # (B, T)
        k_pos = key_positions if key_positions is not None else torch.arange(num_keys, device=device).expand(
            q_pos.shape[0], num_keys)  # (B, S)
        return q_pos, k_pos
