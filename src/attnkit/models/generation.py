"""The one generation loop, shared by every decoder model.

A model it can drive (see :class:`CausalLM`) gives its vocabulary size,
context length, pad and stop ids, one KV cache per attention layer, and
``step(input_ids, positions, kv_caches)``: the logits of the last position
after storing ``input_ids`` in the caches. The loop then

1. checks the prompt once (ids in the vocabulary, a left-padded mask, room in
   the context),
2. prefills: one forward over the whole prompt fills the caches,
3. decodes: one token per row per step (:func:`decode_step`), greedy
   (temperature 0) or sampled with temperature, top-k and top-p, each row
   from its own seed (:mod:`attnkit.models.sampling`),
4. stops a row at a stop id (later tokens of that row are the pad id) and
   the whole batch when every row has stopped.

The caches are the model's (``new_caches``: growing, or static under
``compile``), or with ``cache="sink:SINKS,WINDOW"`` one
:class:`attnkit.modules.sink_cache.SinkCache` per layer (:mod:`.streaming`): constant memory,
as many new tokens as asked for (past the context length), the prompt fed in
pieces that keep the cache's bound.

Padding: a left-padded row's padding gets position -1 (a key nobody sees)
and its real tokens positions 0, 1, ..., so each row computes what it
computes alone (the same values up to rounding: :mod:`.sampling`). :func:`decode_step` has no host synchronisation: with
``compile=True`` it runs as one ``torch.compile(fullgraph=True)`` graph over
static caches (:class:`attnkit.modules.StaticKVCache`); timing and the stop
check live in the loop around it.

Legend: B batch, T prompt tokens, S positions in the caches, V vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from attnkit.modules.kv_cache import Cache, KVCache
from attnkit.modules.static_cache import StaticKVCache

from .generation_options import (
    CausalLM,
    GenerationOptions,
    GenerationStats,
    check_budget,
    check_input_ids,
    check_prompt_mask,
)
from .sampling import Penalties, Sampler, row_seeds
from .text import TextStream


def prompt_positions(mask: Tensor | None) -> Tensor | None:
    """Positions (B, T) of a left-padded prompt: padding -1, real tokens 0, 1, ...; None without padding."""
    if mask is None:
        return None
    return torch.where(mask, mask.long().cumsum(dim=1) - 1, -1)  # (B, T)


@dataclass
class DecodeState:
    """What one decoding step reads and writes, all tensors (B,): nothing for the host to wait on."""

    token: Tensor  # the last token of each row
    position: Tensor  # where that token goes
    done: Tensor  # bool: the row has stopped
    step: Tensor  # how many tokens each row has sampled (the sampler's counter)
    counts: Tensor | None = None  # (B, V) float: each token's count in the answer, with penalties only
    seen: Tensor | None = None  # (B, V) bool: in the prompt or the answer, with penalties only

    def cloned(self) -> DecodeState:
        """A copy of every tensor: a CUDA graph's outputs are overwritten by its next replay."""
        counts, seen = self.counts, self.seen
        return DecodeState(self.token.clone(), self.position.clone(), self.done.clone(), self.step.clone(),
                           None if counts is None else counts.clone(), None if seen is None else seen.clone())


def decode_step(model: CausalLM, caches: Sequence[Cache], state: DecodeState, sampler: Sampler, seeds: Tensor,
                stop_ids: Tensor, plain: bool = False, penalties: Penalties | None = None) -> DecodeState:
    """Feed each row's last token, sample the next: one step, no host synchronisation (compiles whole).

    Stopped rows get the pad id; a row stops when it samples a stop id.
    ``plain``: every row continues right after what the caches hold, so the
    token's position is left to them (the symbolic causal band, no mask).
    ``penalties``: applied to the logits from ``state.counts`` and ``state.seen``.
    """
    positions = None if plain else state.position[:, None]  # (B, 1)
    logits = model.step(state.token[:, None], positions, caches)  # (B, 1) -> (B, V)
    return _choose(model, logits, state, sampler, seeds, stop_ids, penalties)


def _choose(model: CausalLM, logits: Tensor, state: DecodeState, sampler: Sampler, seeds: Tensor,
            stop_ids: Tensor, penalties: Penalties | None) -> DecodeState:
    counts, seen = state.counts, state.seen
    if penalties is not None and counts is not None and seen is not None:
        logits = penalties(logits, counts, seen)  # (B, V)
    token = sampler(logits, seeds, state.step).masked_fill(state.done, model.pad_token_id)  # (B, V) -> (B,)
    if counts is not None and seen is not None:
        counts = counts.scatter_add(1, token[:, None], torch.ones_like(counts[:, :1]))  # (B, V)
        seen = seen.scatter(1, token[:, None], True)  # (B, V)
    done = state.done | torch.isin(token, stop_ids)
    return DecodeState(token, state.position + 1, done, state.step + 1, counts, seen)


def _seen(ids: Tensor, mask: Tensor | None, vocab_size: int) -> Tensor:
    """(B, V) bool: the tokens of each row's prompt (padding left out)."""
    real = torch.ones_like(ids, dtype=torch.float) if mask is None else mask.float()  # (B, T)
    return torch.zeros(ids.shape[0], vocab_size, device=ids.device).scatter_add_(1, ids, real) > 0  # (B, V)


def generate_steps(model: CausalLM, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                   stats: GenerationStats | None = None, **options: Any) -> Iterator[Tensor]:
    """Yield the next tokens (B,) one step at a time; stopped rows yield the pad id.

    Keywords are :class:`GenerationOptions`. Inputs are checked before the first token.
    """
    opts = GenerationOptions.of(options)
    if opts.stop:
        raise ValueError(f"stop={list(opts.stop)} ends text, and generate() returns token ids: stream() the text "
                         "(or give stop_ids)")
    if opts.logprobs is not None:
        raise ValueError(f"logprobs={opts.logprobs}: generate() returns token ids only; the serving engine "
                         "(attnkit.serve.Engine) reports logprobs")
    ids = check_input_ids(model, input_ids)
    mask = check_prompt_mask(ids, attention_mask)
    if mask is not None and opts.sink is not None:
        raise ValueError(f"cache={opts.cache!r} assigns positions inside the cache, one for every row: give "
                         "prompts of one length, without padding (or one prompt at a time)")
    stops = check_budget(model, ids.shape[1], opts)
    seeds = row_seeds(opts.seed, ids.shape[0], ids.device)
    return _steps(model, ids, mask, opts, seeds, stops, stats or GenerationStats())


_COMPILED: dict[int, Callable[..., DecodeState]] = {}
RECOMPILE_LIMIT = 256  # graphs of the decoding step kept: one per batch size and sampling setting met


def _step_function(model: CausalLM, compiled: bool, device: torch.device) -> Callable[..., DecodeState]:
    """decode_step, or its compiled graphs (one per model, reused by later calls).

    One graph serves every cache size (the static caches mark their capacity
    dynamic); on a GPU it is also a CUDA graph (:func:`compile_mode`); a new
    batch size, sampling setting or set of stop ids compiles
    another, and dynamo's default limit of 8 per function would make the ninth
    a hard error under ``fullgraph``, so the step raises it.
    """
    if not compiled:
        return decode_step
    if id(model) not in _COMPILED:
        _COMPILED.clear()  # keep one: a graph holds its model alive
        graph = torch.compile(decode_step, fullgraph=True, mode=compile_mode(device))
        _COMPILED[id(model)] = torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)(graph)
    return _COMPILED[id(model)]


def compile_mode(device: torch.device) -> str | None:
    """torch.compile's mode for the decoding step on ``device``: "reduce-overhead" (CUDA graphs: one replay a
    step, no kernel launches from Python) on a GPU, the default elsewhere."""
    return "reduce-overhead" if device.type == "cuda" else None


def _steps(model: CausalLM, ids: Tensor, mask: Tensor | None, opts: GenerationOptions, seeds: Tensor,
           stops: tuple[int, ...], stats: GenerationStats) -> Iterator[Tensor]:
    b, t = ids.shape
    stop_ids = torch.tensor(stops, dtype=torch.long, device=ids.device)  # (n_stops,)
    if opts.sink is None:
        caches = _new_caches(model, t + opts.max_new_tokens, opts.compile, opts.kv_dtype)
    else:
        caches = opts.sink.caches(model)  # constant memory; positions assigned inside each cache
    given = positions = prompt_positions(mask)  # (B, T) or None
    if positions is None and opts.compile:  # a static cache takes explicit positions in the compiled step
        positions = torch.arange(t, device=ids.device).expand(b, t)
    start = positions[:, -1] + 1 if positions is not None else torch.full((b,), t, device=ids.device)  # (B,)
    zeros = torch.zeros(b, dtype=torch.long, device=ids.device)
    state = DecodeState(ids[:, -1], start - 1, zeros.bool(), zeros)  # the prompt's last token, at start - 1
    penalties = opts.penalties if opts.penalties.active else None
    if penalties is not None:
        state.counts = torch.zeros(b, model.vocab_size, device=ids.device)  # (B, V)
        state.seen = _seen(ids, mask, model.vocab_size)  # (B, V)
    step = _step_function(model, opts.compile, ids.device)
    replayed = opts.compile and compile_mode(ids.device) == "reduce-overhead"
    stats.prompt_tokens = b * t if mask is None else int(mask.sum())
    stats.new_tokens, stats.steps, stats.rows, live = 0, 0, b, b
    begin = time.perf_counter()
    with torch.inference_mode():
        logits = _prefill(model, ids, given, caches, opts)  # (B, V)
        state = _choose(model, logits, state, opts.sampler, seeds, stop_ids, penalties)  # the first, at start
    stats.prefill_seconds, begin = time.perf_counter() - begin, time.perf_counter()
    for n in range(opts.max_new_tokens):
        if n > 0:
            with torch.inference_mode():
                state = step(model, caches, state, opts.sampler, seeds, stop_ids, positions is None, penalties)
                if replayed:  # a CUDA graph's outputs are overwritten by its next replay: keep copies
                    state = state.cloned()
            stats.decode_seconds = time.perf_counter() - begin
        stats.new_tokens, stats.steps = stats.new_tokens + live, n + 1  # rows not stopped before this step
        yield state.token
        live = int((~state.done).sum())  # between steps: the one host synchronisation of the loop
        if live == 0:
            return


def _new_caches(model: CausalLM, capacity: int, static: bool, dtype: torch.dtype | str | None) -> list[Cache]:
    """The model's caches; ``dtype`` (GenerationOptions.kv_dtype, a dtype once checked) is passed only when asked
    for (a model may predate the keyword)."""
    if dtype is None:
        return model.new_caches(capacity, static=static)
    return model.new_caches(capacity, static=static, dtype=cast(torch.dtype, dtype))


def _prefill(model: CausalLM, ids: Tensor, positions: Tensor | None, caches: Sequence[Cache],
             opts: GenerationOptions) -> Tensor:
    """Logits (B, V) of the prompt's last token (at ``positions``, None = 0 .. T - 1).

    Sink caches take the prompt in pieces that keep their bound. Static caches
    (``compile``) are filled from a growing cache's prefill (the prompt's keys
    and values are held twice until they are copied): over a static cache
    every prompt token would attend through a mask over all its slots
    (measured 1.4x slower at 4,000 tokens) instead of the causal band.
    """
    if opts.sink is not None:
        start = 0
        for size in opts.sink.pieces(ids.shape[1]):
            logits = model.step(ids[:, start : start + size], None, caches)  # (B, size) -> (B, V)
            start += size
        return logits
    if not opts.compile:
        return model.step(ids, positions, caches)
    grown = _new_caches(model, ids.shape[1], False, opts.kv_dtype)  # held twice until the copy is done
    logits = model.step(ids, positions, grown)
    at = positions if positions is not None else torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    for static, held in zip(caches, grown, strict=True):
        if not isinstance(held, KVCache) or held.keys is None or held.values is None:
            raise TypeError(f"compile=True copies the prompt from the model's growing caches into its static ones: "
                            f"new_caches() must give KVCache, got {type(held).__name__}")
        if isinstance(static, StaticKVCache):
            static.continue_from(held, at)
        else:
            static.update(held.keys, held.values, at)  # (B, G, T, D) into slots at (B, T)
    return logits


def generate(model: CausalLM, input_ids: Tensor, attention_mask: Tensor | None = None, *,
             stats: GenerationStats | None = None, **options: Any) -> Tensor:
    """Prompt plus new tokens, (B, T + n) long, n <= max_new_tokens.

    Args:
        input_ids: (B, T) prompt ids, left-padded when rows differ in length.
        attention_mask: (B, T) bool or 0/1, True/1 = real token; None = all real.
        stats: filled with token counts and timings.
        options: :class:`GenerationOptions` (max_new_tokens, temperature,
            top_k, top_p, seed, stop_ids, the three penalties, compile,
            cache, kv_dtype).
    """
    new = list(generate_steps(model, input_ids, attention_mask, stats=stats, **options))
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)  # (B, T) + (B, n) -> (B, T + n)


def stream_text(model: CausalLM, decode: Callable[[list[int]], str], input_ids: Tensor,
                attention_mask: Tensor | None = None, *, stats: GenerationStats | None = None,
                **options: Any) -> Iterator[str]:
    """Yield the new text of a single prompt (B = 1) piece by piece as tokens are produced.

    ``decode`` turns ids into text; a piece is held back while it ends in an
    incomplete UTF-8 character or may start a stop string. ``options`` are
    :func:`generate`'s keywords and ``stop`` (strings that end the text).
    """
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"stream() takes one prompt (B = 1), got a batch of {input_ids.shape[0]}")
    context = input_ids[0, -1:].tolist() if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else []
    text = TextStream(decode, GenerationOptions.of(options).stop, context)
    steps = generate_steps(model, input_ids, attention_mask, stats=stats, **{**options, "stop": ()})
    return _pieces(steps, text)


def _pieces(steps: Iterator[Tensor], text: TextStream) -> Iterator[str]:
    """New text per token of a single row, up to a stop string (:class:`attnkit.models.text.TextStream`)."""
    for token in steps:
        piece = text.add(int(token[0]))
        if piece:
            yield piece
        if text.stopped:
            return
    rest = text.flush()
    if rest:
        yield rest


class Tokenizer(Protocol):
    """What :class:`GenerationMixin` needs from a tokenizer (:class:`attnkit.models.tokenizer.GGUFTokenizer`)."""

    def tokenize(self, texts: str | Sequence[str]) -> dict[str, Tensor]: ...

    def decode(self, ids: Tensor | Sequence[int], *, skip_special_tokens: bool = True) -> str: ...

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str: ...


class GenerationMixin:
    """Text in, text out, for a decoder model that has a ``tokenizer``: written once for every model.

    The model is a :class:`CausalLM`; these methods only hand it and its
    tokenizer to the generation loop.
    """

    tokenizer: Tokenizer | None

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer; load it with attnkit.models.load_gguf()")
        return self.tokenizer

    def tokenize(self, texts: str | Sequence[str]) -> dict[str, Tensor]:
        """``input_ids`` and ``attention_mask`` (B, T) long, left-padded (ready for generate)."""
        return self._tok().tokenize(texts)

    def decode(self, ids: Tensor | Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of one row of ids (padding and other special tokens left out by default)."""
        return self._tok().decode(ids, skip_special_tokens=skip_special_tokens)

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The file's chat template for ``messages``, ending with the assistant's turn opened."""
        return self._tok().chat_prompt(messages)

    def generate(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                 stats: GenerationStats | None = None, **options: Any) -> Tensor:
        """Prompt plus new tokens (B, T + n); options as :class:`GenerationOptions`."""
        return generate(self, input_ids, attention_mask, stats=stats, **options)  # type: ignore[arg-type]

    def stream(self, input_ids: Tensor, attention_mask: Tensor | None = None, *,
               stats: GenerationStats | None = None, **options: Any) -> Iterator[str]:
        """The new text of one prompt (B = 1), piece by piece as it is generated."""
        return stream_text(self, self.decode, input_ids, attention_mask, stats=stats,  # type: ignore[arg-type]
                           **options)
