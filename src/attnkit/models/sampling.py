"""Choosing the next token: greedy, or sampled from per-row counter-based random numbers.

Each row of a batch samples with its own seed and its own step count: the
random number of a row at a step is a hash of (seed, step), computed with
tensor operations. So

- a row's random numbers are the same alone or in any batch, whatever the
  other rows hold (a server batching unrelated requests needs this), so a
  seeded prompt samples the same tokens as far as its logits are the same.
  They are not quite: a batch's shape (left padding, the other rows' lengths)
  changes how float32 attention rounds (SmolLM2's logits move by about 5e-5),
  which moves a float32 or float16 sample only on a knife edge; packed int8 /
  int4 layers round their inputs to bfloat16, which turns that into tenths of a
  logit, so a sampled row with int8 / int4 weights generally takes other tokens
  in a batch than alone, and a greedy row sometimes does (at near-ties; see
  docs/bench/round11-invariance);
- there is no ``torch.Generator`` state and no host synchronisation, so a
  decoding step that samples compiles with ``torch.compile(fullgraph=True)``.

Sampling is exact inverse-CDF sampling in float64 from the filtered softmax.

Legend: B batch, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (xorshift-multiply, constants < 2^31 so int64 products never overflow)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _MASK32
    return x ^ (x >> 16)


def _hash_uniform(seeds: Tensor, steps: Tensor) -> Tensor:
    """:func:`uniform`'s hash, (B,) long, (B,) long -> (B,) float64."""
    low, high = seeds & _MASK32, (seeds >> 32) & _MASK32  # (B,) each
    key = _mix32(low ^ _mix32(high ^ _mix32(steps & _MASK32)))  # (B,)
    first, second = _mix32(key ^ 0x5BD1E995), _mix32(key ^ 0x1B873593)  # two independent 32-bit words
    bits = (first << 21) | (second >> 11)  # 53 random bits (B,)
    return bits.double() / float(2**53)


@torch.library.custom_op("attnkit::uniform", mutates_args=())
def uniform(seeds: Tensor, steps: Tensor) -> Tensor:
    """One number in [0, 1) per row (float64), a function of that row's seed and step alone.

    ``seeds`` and ``steps`` are long tensors (B,) of non-negative values (seeds use 64 bits, steps 32).

    An op of its own, so that ``torch.compile`` calls it rather than inlining it: each xorshift reads its
    input twice, and Inductor inlining the five nested hashes into one expression multiplies them into
    thousands of terms, slow to compile (BENCHMARKS.md, round seventeen); as an op it runs eagerly.
    """
    return _hash_uniform(seeds, steps)


@uniform.register_fake
def _(seeds: Tensor, steps: Tensor) -> Tensor:
    return seeds.new_empty(seeds.shape, dtype=torch.float64)  # (B,)


def row_seeds(seed: int | Sequence[int] | None, batch: int, device: torch.device | str | None = None) -> Tensor:
    """The seed of each row (B,) long.

    An int ``s`` gives row r the seed ``s + r`` (row 0 samples as the prompt alone
    with seed ``s``); a sequence gives each row its own; None draws fresh seeds
    from PyTorch's global generator (so ``torch.manual_seed`` fixes them).
    """
    if seed is None:
        return torch.randint(0, 2**62, (batch,), device=device)
    if isinstance(seed, int) and not isinstance(seed, bool):
        if not 0 <= seed < 2**62:
            raise ValueError(f"seed must be an int in [0, 2**62), got seed={seed}")
        return torch.arange(seed, seed + batch, device=device)
    seeds = list(seed) if isinstance(seed, Sequence) and not isinstance(seed, str) else None
    if seeds is None or len(seeds) != batch or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in seeds):
        raise ValueError(f"seed must be None, an int in [0, 2**62) or a list of {batch} such ints (one per row), "
                         f"got seed={seed!r}")
    return torch.tensor(seeds, dtype=torch.long, device=device)


@dataclass(frozen=True)
class Sampler:
    """Greedy when temperature is 0, else temperature, then top-k, then top-p (nucleus) sampling.

    ``sampler(logits, seeds, steps)`` returns the next ids (B,) for logits (B, V);
    ``seeds`` and ``steps`` (B,) long give each row its random number (see :func:`uniform`).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got temperature={t!r}")
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"top_k must be a positive int or None, got top_k={k!r}")
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ValueError(f"top_p must lie in (0, 1] or be None, got top_p={p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probabilities(self, logits: Tensor) -> Tensor:
        """The filtered distribution each row samples from, (B, V) float64."""
        # from the row maximum, in float64: a tiny temperature gives -huge, never inf - inf = nan
        scores = (logits.double() - logits.amax(dim=-1, keepdim=True).double()) / self.temperature  # (B, V)
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]  # (B, V) -> (B, 1)
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
            sorted_probs = sorted_scores.softmax(dim=-1)  # (B, V)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
            drop_sorted = before >= self.top_p  # keep the smallest prefix whose mass reaches top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
            scores = scores.masked_fill(drop, float("-inf"))
        return scores.softmax(dim=-1)  # (B, V)

    def __call__(self, logits: Tensor, seeds: Tensor, steps: Tensor) -> Tensor:
        """Next token ids (B,) from logits (B, V)."""
        if self.greedy:
            return logits.argmax(dim=-1)  # (B, V) -> (B,)
        cdf = self.probabilities(logits).cumsum(dim=-1)  # (B, V)
        target = uniform(seeds, steps) * cdf[:, -1]  # (B,): a point under each row's total mass
        ids = torch.searchsorted(cdf, target[:, None], right=True)  # (B, 1): first id whose cdf passes it
        return ids.squeeze(-1).clamp_(max=logits.shape[-1] - 1)  # (B,)


@dataclass(frozen=True)
class Penalties:
    """Penalties on tokens already seen, applied to the logits before sampling (and before logprobs).

    - ``repetition`` (transformers' ``repetition_penalty``, llama.cpp's ``repeat_penalty``): a token of the
      prompt or of the answer so far has its logit divided by it where positive and multiplied by it where
      negative; 1 = off, > 1 discourages repeats.
    - ``frequency`` and ``presence`` (OpenAI's, in [-2, 2]): ``logit - count * frequency - (count > 0) *
      presence``, where ``count`` is how often the token appears in the answer so far (not the prompt).
    """

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        for name in ("frequency", "presence"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -2 <= value <= 2:
                raise ValueError(f"{name}_penalty must be a number in [-2, 2], got {name}_penalty={value!r}")
        r = self.repetition
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < float("inf"):
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), got repetition_penalty={r!r}")

    @property
    def active(self) -> bool:
        return self.frequency != 0 or self.presence != 0 or self.repetition != 1

    def __call__(self, logits: Tensor, counts: Tensor, seen: Tensor) -> Tensor:
        """Penalised logits (B, V): ``counts`` (B, V) the answer's tokens, ``seen`` (B, V) bool the prompt's and
        the answer's."""
        out = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float64 stays float64
        if self.repetition != 1:
            out = torch.where(seen, torch.where(out > 0, out / self.repetition, out * self.repetition), out)
        if self.frequency != 0 or self.presence != 0:
            counts = counts.to(out.dtype)
            out = out - counts * self.frequency - (counts > 0).to(out.dtype) * self.presence  # (B, V)
        return out
