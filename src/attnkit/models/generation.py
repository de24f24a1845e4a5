"""The one generation loop, shared by every decoder model.

A model it can drive (see :class:`CausalLM`) gives its vocabulary size,
context length, pad and stop ids, one :class:`attnkit.KVCache` per attention
layer, and ``step(input_ids, key_mask, kv_caches)``: the logits of the last
position after appending ``input_ids`` to the caches. The loop then

1. checks the prompt once (ids in the vocabulary, a left-padded mask, room in
   the context),
2. prefills: one forward over the whole prompt fills the caches,
3. decodes: one token per step, greedy (temperature 0) or sampled with
   temperature, top-k and top-p, each row from its own seed (see
   :mod:`attnkit.models.sampling`: a row samples the same alone or in a batch),
4. stops a row at a stop id (later tokens of that row are the pad id) and
   the whole batch when every row has stopped.

Left padding and rotary embedding: every row is rotated at the same
positions, so a padded row's real tokens sit further right than they would
alone. Rotary scores depend only on relative positions, so each row gets what
it would alone, up to rounding.

Legend: B batch, T prompt tokens, S positions in the caches, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from attnkit.modules import KVCache

from .sampling import Sampler, row_seeds


class CausalLM(Protocol):
    """What the generation loop needs from a decoder model."""

    vocab_size: int
    context_length: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    def new_caches(self, capacity: int) -> list[KVCache]:
        """One empty KV cache per attention layer, each for up to ``capacity`` positions."""
        ...

    def step(self, input_ids: Tensor, key_mask: Tensor | None, kv_caches: list[KVCache]) -> Tensor:
        """Logits (B, V) of the last position after appending input_ids (B, T) to the caches.

        ``key_mask`` (B, S) bool, True = real token, covers cached and new positions; None = all real.
        """
        ...


@dataclass
class GenerationStats:
    """Filled in by a generation run: token counts and seconds of prefill and decode."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after the first (which prefill produced) per second of decoding."""
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_seconds if self.decode_seconds > 0 else 0.0


def check_input_ids(model: CausalLM, input_ids: object) -> Tensor:
    """input_ids must be a non-empty (B, T) long tensor of ids in the vocabulary."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        got = (tuple(input_ids.shape), input_ids.dtype) if isinstance(input_ids, Tensor) else type(input_ids)
        raise ValueError(f"input_ids must be a (B, T) torch.long tensor, got {got}")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a prompt needs at least one token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= model.vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {model.vocab_size})")
    return input_ids


def mask_to_bool(attention_mask: Tensor) -> Tensor:
    """A bool or integer attention mask as bool; integers must be 0 (padding) or 1 (real token)."""
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise ValueError(f"attention_mask must be bool or integer (1 = real token, 0 = padding), "
                         f"got dtype {attention_mask.dtype}")
    if attention_mask.dtype == torch.bool:
        return attention_mask
    bad = ((attention_mask != 0) & (attention_mask != 1)).nonzero()
    if len(bad):
        where = tuple(int(i) for i in bad[0])
        raise ValueError(f"attention_mask must hold only 0 and 1, got {int(attention_mask[where])} at {where}")
    return attention_mask.bool()


def check_prompt_mask(input_ids: Tensor, attention_mask: object) -> Tensor | None:
    """attention_mask (B, T) bool or 0/1 integers, left-padded -> bool (B, T), or None if all real."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
    mask = mask_to_bool(attention_mask).to(input_ids.device)
    empty = (~mask.any(dim=1)).nonzero()
    if len(empty):
        raise ValueError(f"row {int(empty[0])} of attention_mask has no real token: its prompt is empty")
    if (mask[:, :-1] & ~mask[:, 1:]).any():
        raise ValueError("attention_mask must be left-padded (zeros before ones in every row) for generation")
    return None if bool(mask.all()) else mask


def _check_budget(model: CausalLM, prompt_len: int, max_new_tokens: object,
                  stop_ids: Sequence[int] | None) -> tuple[int, ...]:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got max_new_tokens={max_new_tokens!r}")
    if prompt_len > model.context_length:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context length "
                         f"{model.context_length}; shorten it (nothing is truncated)")
    if prompt_len + max_new_tokens > model.context_length:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens={max_new_tokens} exceeds the model's "
                         f"context length {model.context_length}; ask for at most "
                         f"{model.context_length - prompt_len} new tokens")
    stops = model.stop_token_ids if stop_ids is None else tuple(stop_ids)
    for s in stops:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < model.vocab_size:
            raise ValueError(f"stop id {s!r} is not a token id in [0, {model.vocab_size})")
    return stops


def generate_steps(model: CausalLM, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                   max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
                   top_p: float | None = None, seed: int | Sequence[int] | None = None,
                   stop_ids: Sequence[int] | None = None, stats: GenerationStats | None = None) -> Iterator[Tensor]:
    """Yield the next tokens (B,) one step at a time; stopped rows yield the pad id.

    Arguments as :func:`generate`. Inputs are checked before the first token.
    """
    sampler = Sampler(temperature, top_k, top_p)
    ids = check_input_ids(model, input_ids)
    mask = check_prompt_mask(ids, attention_mask)
    stops = _check_budget(model, ids.shape[1], max_new_tokens, stop_ids)
    seeds = row_seeds(seed, ids.shape[0], ids.device)
    return _steps(model, ids, mask, max_new_tokens, sampler, seeds, stops, stats or GenerationStats())


def _steps(model: CausalLM, ids: Tensor, mask: Tensor | None, max_new_tokens: int, sampler: Sampler,
           seeds: Tensor, stops: tuple[int, ...], stats: GenerationStats) -> Iterator[Tensor]:
    b, t = ids.shape
    stop_tensor = torch.tensor(stops, dtype=torch.long, device=ids.device)  # (n_stops,)
    caches = model.new_caches(t + max_new_tokens)
    full_mask = None if mask is None else torch.cat(  # (B, T) -> (B, T + N), new tokens are real
        [mask, mask.new_ones(b, max_new_tokens)], dim=1)
    done = torch.zeros(b, dtype=torch.bool, device=ids.device)  # (B,)
    token = ids[:, -1]  # (B,), replaced by each step's choice
    stats.prompt_tokens, stats.new_tokens = b * t, 0
    start = time.perf_counter()
    with torch.inference_mode():
        logits = model.step(ids, None if full_mask is None else full_mask[:, :t], caches)  # (B, V)
    for n in range(max_new_tokens):
        with torch.inference_mode():
            if n > 0:
                key_mask = None if full_mask is None else full_mask[:, : t + n]  # (B, S) view, no copy
                logits = model.step(token[:, None], key_mask, caches)  # (B, 1) -> (B, V)
            token = sampler(logits, seeds, torch.full_like(seeds, n))  # (B, V) -> (B,)
            token = token.masked_fill(done, model.pad_token_id)
            done = done | torch.isin(token, stop_tensor)
        now = time.perf_counter()
        if n == 0:
            stats.prefill_seconds, start = now - start, now
        else:
            stats.decode_seconds = now - start
        stats.new_tokens = n + 1
        yield token
        if bool(done.all()):
            return


def generate(model: CausalLM, input_ids: Tensor, attention_mask: Tensor | None = None, *,
             max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | Sequence[int] | None = None, stop_ids: Sequence[int] | None = None,
             stats: GenerationStats | None = None) -> Tensor:
    """Prompt plus new tokens, (B, T + n) long, n <= max_new_tokens.

    Args:
        input_ids: (B, T) prompt ids, left-padded when rows differ in length.
        attention_mask: (B, T) bool or 0/1, True/1 = real token; None = all real.
        max_new_tokens: the most tokens to add (>= 1); prompt + these must fit the context.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_k, top_p: keep only the k most likely tokens / the smallest set
            with probability >= top_p before sampling.
        seed: an int (row r samples with seed + r), one int per row, or None
            (fresh seeds). A row's tokens depend only on its prompt and seed,
            never on the other rows of the batch.
        stop_ids: ids that end a row (kept in the output, then pad ids);
            None = the model's end-of-turn / end-of-text ids, [] = never stop early.
        stats: filled with token counts and timings.
    """
    steps = generate_steps(model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                           temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           stop_ids=stop_ids, stats=stats)
    new = list(steps)
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)  # (B, T) + (B, n) -> (B, T + n)


def stream_text(model: CausalLM, decode: Callable[[list[int]], str], input_ids: Tensor,
                attention_mask: Tensor | None = None, **options: object) -> Iterator[str]:
    """Yield the new text of a single prompt (B = 1) piece by piece as tokens are produced.

    ``decode`` turns ids into text; a piece is held back while it ends in an
    incomplete UTF-8 character. ``options`` are :func:`generate`'s keywords.
    """
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"stream() takes one prompt (B = 1), got a batch of {input_ids.shape[0]}")
    steps = generate_steps(model, input_ids, attention_mask, **options)  # type: ignore[arg-type]
    return _pieces(steps, decode)


def _pieces(steps: Iterator[Tensor], decode: Callable[[list[int]], str]) -> Iterator[str]:
    """New text per token, decoding only a short window of ids each time (linear in the answer's length).

    The window starts at the tokens of the last piece shown, so a decoder that
    drops a leading space at the start of a text still sees what precedes the
    new tokens; a piece is held back while it ends in an incomplete character.
    """
    ids: list[int] = []
    start = shown = 0  # ids[start:shown] were last shown; ids[shown:] are not yet
    for token in steps:
        ids.append(int(token[0]))
        before, after = decode(ids[start:shown]), decode(ids[start:])
        if after.endswith("\ufffd") or len(after) <= len(before):  # an incomplete character, or nothing new
            continue
        yield after[len(before):]
        start, shown = shown, len(ids)
    before, after = decode(ids[start:shown]), decode(ids[start:])
    if len(after) > len(before):
        yield after[len(before):]
