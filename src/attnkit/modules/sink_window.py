"""Attention sinks and a recent window (StreamingLLM): the eviction policy of a constant-memory KV cache.

Xiao et al. (2023), "Efficient Streaming Language Models with Attention
Sinks": a model trained on a finite context keeps its perplexity far past
that context when every query sees the first few tokens (the *sinks*, where
softmax parks the weight no other key claims) and a window of recent tokens,
the middle being forgotten. Positions are those *inside the cache*: the sinks
sit at 0 .. sinks - 1 and the window right after them, so no query ever sees
a distance longer than the cache, whatever the number of tokens generated.

attnkit's layer rotates a key (RoPE) at its position before handing it to
the cache, so when the oldest ``e`` window keys are evicted the ones left
move ``e`` places to the left and are rotated by ``-e`` (rotations compose:
R(p - e) = R(-e) R(p)). Eviction happens a chunk at a time, so the window is
re-rotated once per ``chunk`` tokens, not at every token. Keys stay
contiguous ``[sinks | window]``: the cache hands back a plain prefix
(positions None, ``next_positions`` an int) and every kernel keeps its fast
path.

    caches = [KVCache(eviction=SinkWindow(sinks=4, window=1020, rope=block.attention.rope))
              for block in model.layers]
    model.generate(ids, cache="sink:4,1020", max_new_tokens=20_000)   # the same, built by the loop

Legend: B batch, G key/value heads, T new positions, S positions held, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.functional import RotaryEmbedding


def _rotation(rope: object) -> tuple[object, ...] | None:
    """What a rotary embedding computes, for comparing two: its class and configuration (None: no rotation)."""
    if not isinstance(rope, RotaryEmbedding):
        return None if rope is None else (rope,)  # something else: itself
    return (type(rope), rope.head_dim, rope.base, rope.scaling)


def _count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"SinkWindow {name} must be an int >= 1, got {name}={value!r}")
    return value


class SinkWindow:
    """What a :class:`~attnkit.modules.kv_cache.KVCache` keeps of one layer's tokens: the first ``sinks`` and a
    recent window, the middle evicted.

    Args:
        sinks: the first tokens, kept for good (in-cache positions 0 .. sinks - 1).
        window: every query sees at least its ``window`` most recent tokens,
            itself included, besides the sinks.
        rope: the layer's rotary embedding (``layer.rope``), used to rotate the
            keys left in the window back to their new positions after an
            eviction; None for a layer without one (then only the order of the
            keys moves). Required, so that forgetting it is not silent.
        chunk: window keys evicted at once (the re-rotation cost is paid once
            per ``chunk`` tokens).

    Each call's queries see the sinks and between ``window`` and ``window +
    chunk - 1`` recent tokens (more for a call of more than ``chunk`` tokens,
    which sees all the tokens of the call). The cache holds at most
    :attr:`capacity` = ``sinks + window + chunk - 1`` keys while calls bring at
    most ``chunk`` tokens; a longer call (a long prompt in one piece) is stored
    whole and the next call shrinks the cache back. Generation feeds a long
    prompt in pieces for that reason (:mod:`attnkit.models.generation`).

    Positions are assigned by the cache (a plain prefix): explicit positions,
    and so rows at different positions (left padding), are refused; what reads
    positions (the causal band, a layer's score or mask modifiers) reads these
    in-cache positions. The policy holds no tokens (the cache does: ``len(cache)``
    keys held, ``cache.seen`` tokens stored since its last reset), so one
    policy may serve every cache of layers that rotate alike (rotary
    embeddings are compared by what they compute: class, head_dim, base,
    scaling). A cache with eviction stores the layer's dtype (16-bit or
    int8 storage would round the kept keys again at each re-rotation) and
    cannot be cropped.
    """

    def __init__(self, *, sinks: int = 4, window: int = 1020, rope: RotaryEmbedding | None, chunk: int = 64) -> None:
        self.sinks, self.window, self.chunk = _count("sinks", sinks), _count("window", window), _count("chunk", chunk)
        if rope is not None and not isinstance(rope, RotaryEmbedding):
            raise TypeError(f"SinkWindow rope must be the layer's RotaryEmbedding (layer.rope) or None for a layer "
                            f"without one, got {type(rope).__name__}")
        self.rope = rope

    @property
    def capacity(self) -> int:
        """The most keys a cache holds while every call brings at most ``chunk`` tokens."""
        return self.sinks + self.window + self.chunk - 1

    def __repr__(self) -> str:
        rope = "" if self.rope is not None else ", rope=None"
        return f"SinkWindow(sinks={self.sinks}, window={self.window}, chunk={self.chunk}{rope})"

    def piece(self, length: int, done: int) -> int:
        """How many tokens the piece starting at token ``done`` of a prompt of ``length`` holds, fed as generation
        feeds a long prompt: as much as fits :attr:`capacity` (no eviction inside it), then a chunk at a time."""
        first = min(length, self.capacity)
        if done < first:
            return first - done
        return min(self.chunk - (done - first) % self.chunk, length - done)

    def evicted_before(self, held: int, length: int) -> int:
        """How many window keys a call of ``length`` tokens evicts first from a cache of ``held`` (0 while there
        is room).

        A call evicts when the window would pass ``window + chunk - 1`` keys,
        keeping the ``window - 1`` most recent, so that the call's first query
        still sees ``window`` tokens.
        """
        in_window = max(held - self.sinks, 0)
        if in_window + length <= self.window + self.chunk - 1:
            return 0
        return max(in_window - (self.window - 1), 0)

    def check(self, k: Tensor, positions: Tensor | None) -> None:
        """Raise a ValueError for explicit positions, or keys k (B, G, T, D) of another head size than the rotary
        embedding's."""
        if positions is not None:
            raise ValueError("a KVCache with a SinkWindow assigns positions inside the cache (sinks at 0 .. sinks - 1, "
                             "the window right after), so it takes no explicit positions: call the layer without "
                             "positions (every row at the same position: no left padding); use a KVCache without "
                             "eviction for rows at different positions")
        if self.rope is not None and k.shape[3] != self.rope.head_dim:
            raise ValueError(f"SinkWindow rope has head_dim={self.rope.head_dim} but the keys have D={k.shape[3]}: "
                             "give the cache its own layer's rotary embedding")

    def check_owner(self, owner: object) -> None:
        """The layer writing to the cache must rotate its keys as this rotary embedding does (else an eviction would
        rotate them by another rotation, silently).

        Rotary embeddings are compared by what they compute (their class, head_dim, base and scaling), not by
        identity: a copied or unpickled cache holds a copy of its layer's, which rotates alike.
        """
        layers_rope = getattr(owner, "rope", self.rope)  # a layer has one (None without rotary embeddings)
        if _rotation(layers_rope) != _rotation(self.rope):
            raise ValueError(f"this SinkWindow rotates evicted keys with {self.rope!r} but the layer writing to it "
                             f"({type(owner).__name__}) rotates them with {layers_rope!r}: build the SinkWindow with "
                             "rope=layer.rope (None only for a layer without rotary embeddings)")

    def shifted(self, keys: Tensor, by: int) -> Tensor:
        """Window keys (B, G, n, D) moved ``by`` places left: rotated by -by (rotations compose)."""
        if self.rope is None:
            return keys
        compute = torch.promote_types(keys.dtype, torch.float32)  # half precision would round once per chunk
        moved = self.rope.rotate(keys.to(compute), torch.tensor([-by], device=keys.device))  # (B, G, n, D)
        return moved.to(keys.dtype)
