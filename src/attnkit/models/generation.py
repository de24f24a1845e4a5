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
``compile``), or with ``cache="sink:SINKS,WINDOW"`` one ``KVCache(eviction=SinkWindow(...))``
per layer (:mod:`.sink_caches`): constant memory, as many new tokens as asked
for (past the context length), the prompt fed in pieces that keep the cache's bound.

A conversation keeps its caches between runs (:class:`KeptCaches`): the
next prompt, which starts with the tokens they hold, prefills only its new
tokens, through the same loop.

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
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence, Sized
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from attnkit.modules.cache_protocol import Cache
from attnkit.modules.kv_cache import KVCache
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
    bias: Tensor | None = None  # (V,) float: logit_bias, added to every row's logits first

    def cloned(self) -> DecodeState:
        """A copy of every tensor: a CUDA graph's outputs are overwritten by its next replay."""
        counts, seen = self.counts, self.seen
        return DecodeState(self.token.clone(), self.position.clone(), self.done.clone(), self.step.clone(),
                           None if counts is None else counts.clone(), None if seen is None else seen.clone(),
                           self.bias)


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
    if state.bias is not None:
        logits = logits + state.bias  # (B, V) + (V,)
    if penalties is not None and counts is not None and seen is not None:
        logits = penalties(logits, counts, seen)  # (B, V)
    token = sampler(logits, seeds, state.step).masked_fill(state.done, model.pad_token_id)  # (B, V) -> (B,)
    if counts is not None and seen is not None:
        counts = counts.scatter_add(1, token[:, None], torch.ones_like(counts[:, :1]))  # (B, V)
        seen = seen.scatter(1, token[:, None], True)  # (B, V)
    done = state.done | torch.isin(token, stop_ids)
    return DecodeState(token, state.position + 1, done, state.step + 1, counts, seen, state.bias)


def _seen(ids: Tensor, mask: Tensor | None, vocab_size: int) -> Tensor:
    """(B, V) bool: the tokens of each row's prompt (padding left out)."""
    real = torch.ones_like(ids, dtype=torch.float) if mask is None else mask.float()  # (B, T)
    return torch.zeros(ids.shape[0], vocab_size, device=ids.device).scatter_add_(1, ids, real) > 0  # (B, V)


@dataclass
class KeptCaches:
    """The KV caches of one conversation, kept from a generation run to the next.

    Give the same object to each run (``generate_steps``, ``generate`` or
    ``stream_text`` with ``kept=``): the first run makes the model's growing
    caches; every run prefills only the tokens of ``input_ids`` after the
    ``length`` positions the caches hold (``input_ids`` must start with
    :attr:`ids`, and hold at least one more token), and leaves :attr:`ids` at
    what they hold when it ends: the prompt and each new token fed back (all
    but the last one sampled; an interrupted step is rolled back). The
    answer equals a run over the whole prompt (up to rounding: the new
    tokens attend to keys computed in another order). Prompts without
    padding, full caches only (not ``compile``, not a sink cache).

    ``caches``: one per attention layer (empty until the first run);
    ``ids``: (B, S) long, the tokens whose keys and values they hold.
    """

    caches: list[Cache] = field(default_factory=list)
    ids: Tensor | None = None

    @property
    def length(self) -> int:
        """S, the positions the caches hold (0 before the first run)."""
        return 0 if self.ids is None else self.ids.shape[1]

    def matches(self, input_ids: Tensor) -> bool:
        """Whether ``input_ids`` (B, T) can continue these caches: it starts with :attr:`ids` and is longer."""
        held = self.ids
        if held is None:
            return True
        return (input_ids.shape[0] == held.shape[0] and input_ids.shape[1] > held.shape[1]
                and torch.equal(input_ids[:, : held.shape[1]].to(held.device), held))

    def clear(self) -> None:
        """Forget the caches (the next run starts afresh)."""
        self.caches, self.ids = [], None

    def _settle(self, fed: Tensor) -> None:
        """After a run: every cache cropped to the positions all of them hold (a step interrupted between
        layers is rolled back), and ``ids`` to those of ``fed`` (B, T + n), the prompt and the tokens sampled."""
        held = min(_held(self.caches), default=0)
        for cache in self.caches:
            if len(cast(Sized, cache)) > held:
                cast(Any, cache).crop(held)
        self.ids = fed[:, :held]


def _held(caches: Sequence[Cache]) -> list[int]:
    """The positions each kept cache holds; one that cannot say so, or be cropped, is a TypeError; one that evicts
    (its crop could not undo an eviction) a ValueError."""
    if not all(hasattr(c, "__len__") and callable(getattr(c, "crop", None)) for c in caches):
        raise TypeError("kept caches must be growing caches (len() and crop(): KVCache), got "
                        f"{', '.join(sorted({type(c).__name__ for c in caches}))}")
    evicting = next((c for c in caches if getattr(c, "eviction", None) is not None), None)
    if evicting is not None:
        raise ValueError(f"kept caches are cropped to what every layer holds after a run, and a cache with "
                         f"eviction={cast(Any, evicting).eviction!r} cannot be (an eviction cannot be undone): keep "
                         "caches without eviction (cache='full'), or give kept=None")
    return [len(cast(Sized, c)) for c in caches]


def _check_kept(kept: object, ids: Tensor, mask: Tensor | None, opts: GenerationOptions) -> int:
    """The positions ``kept`` holds, once it is known that ``ids`` (B, T) can continue them."""
    if not isinstance(kept, KeptCaches):
        raise TypeError(f"kept must be a KeptCaches, got {type(kept).__name__}")
    why = ("compile=True runs over static caches sized for one run" if opts.compile else
           f"cache={opts.cache!r} evicts positions" if opts.sink is not None else
           "a left-padded prompt puts its padding inside the caches" if mask is not None else None)
    if why is not None:
        raise ValueError(f"kept caches continue full caches of prompts without padding; {why}: give kept=None")
    held, length = _held(kept.caches), kept.length
    if (set(held) if kept.caches else {0}) != {length}:
        raise ValueError(f"the kept caches hold {sorted(set(held)) or [0]} positions and kept.ids {length} tokens: "
                         "caches that hold a different number of positions cannot continue (kept.clear() starts "
                         "afresh)")
    stored = {getattr(c, "dtype", opts.kv_dtype) for c in kept.caches} - {opts.kv_dtype}
    if stored:
        named = ", ".join("the model's dtype" if d is None else str(d) for d in stored)
        raise ValueError(f"the kept caches store {named} and this run asks for kv_dtype={opts.kv_dtype}: keep one "
                         "kv_dtype for a conversation (or kept.clear())")
    if length == 0:
        return 0
    assert kept.ids is not None
    if kept.ids.shape[0] != ids.shape[0]:
        raise ValueError(f"the kept caches hold {kept.ids.shape[0]} rows and input_ids has {ids.shape[0]}: "
                         "continue them with a batch of the same size")
    if not kept.matches(ids):
        raise ValueError(f"input_ids ({ids.shape[1]} tokens) does not continue the {length} tokens the kept caches "
                         "hold: it must start with kept.ids and add at least one token (kept.clear() starts "
                         "afresh)")
    return length


def _kept_steps(kept: KeptCaches, ids: Tensor, steps: Iterator[Tensor]) -> Generator[Tensor, None, None]:
    """``steps``, noting what the caches hold when they end (exhausted, closed or interrupted)."""
    new: list[Tensor] = []
    try:
        for token in steps:  # (B,)
            yield token
            new.append(token[:, None])  # (B, 1): fed by the next step, if one comes
    finally:
        kept._settle(torch.cat([ids, *new], dim=1))  # (B, T + n)


def generate_steps(model: CausalLM, input_ids: Tensor, attention_mask: Tensor | None = None, *,
                   stats: GenerationStats | None = None, kept: KeptCaches | None = None,
                   **options: Any) -> Generator[Tensor, None, None]:
    """Yield the next tokens (B,) one step at a time; stopped rows yield the pad id.

    Keywords are :class:`GenerationOptions`. Inputs are checked before the first token.
    ``kept``: caches kept from an earlier run (:class:`KeptCaches`) that ``input_ids`` continues: only its
    tokens after them are prefilled (``stats.prompt_tokens`` counts those). Close the iterator (or run it to
    its end) before the next run reads ``kept``.
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
    if kept is None:
        return _steps(model, ids, mask, opts, seeds, stops, stats or GenerationStats())
    cached = _check_kept(kept, ids, mask, opts)
    if not kept.caches:  # growing, unbounded: later runs add to them
        kept.caches = _new_caches(model, None, False, opts.kv_dtype)
    steps = _steps(model, ids, mask, opts, seeds, stops, stats or GenerationStats(), kept.caches, cached)
    return _kept_steps(kept, ids, steps)


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
           stops: tuple[int, ...], stats: GenerationStats, caches: list[Cache] | None = None,
           cached: int = 0) -> Generator[Tensor, None, None]:
    """The loop; ``caches`` given hold the first ``cached`` tokens of ``ids`` already (only the rest is prefilled)."""
    b, t = ids.shape
    stop_ids = torch.tensor(stops, dtype=torch.long, device=ids.device)  # (n_stops,)
    if caches is None and opts.sink is not None:
        caches = opts.sink.caches(model)  # constant memory; positions assigned inside each cache
    elif caches is None:
        caches = _new_caches(model, t + opts.max_new_tokens, opts.compile, opts.kv_dtype)
    given = positions = prompt_positions(mask)  # (B, T) or None
    if positions is None and opts.compile:  # a static cache takes explicit positions in the compiled step
        positions = torch.arange(t, device=ids.device).expand(b, t)
    start = positions[:, -1] + 1 if positions is not None else torch.full((b,), t, device=ids.device)  # (B,)
    zeros = torch.zeros(b, dtype=torch.long, device=ids.device)
    state = DecodeState(ids[:, -1], start - 1, zeros.bool(), zeros)  # the prompt's last token, at start - 1
    if opts.logit_bias:
        biased = torch.tensor(list(opts.logit_bias), dtype=torch.long, device=ids.device)  # (k,)
        values = torch.tensor(list(opts.logit_bias.values()), device=ids.device)  # (k,)
        state.bias = torch.zeros(model.vocab_size, device=ids.device).index_add_(0, biased, values)  # (V,)
    penalties = opts.penalties if opts.penalties.active else None
    if penalties is not None:
        state.counts = torch.zeros(b, model.vocab_size, device=ids.device)  # (B, V)
        state.seen = _seen(ids, mask, model.vocab_size)  # (B, V)
    step = _step_function(model, opts.compile, ids.device)
    replayed = opts.compile and compile_mode(ids.device) == "reduce-overhead"
    stats.prompt_tokens = b * (t - cached) if mask is None else int(mask.sum())
    stats.new_tokens, stats.steps, stats.rows, live = 0, 0, b, b
    begin = time.perf_counter()
    with torch.inference_mode():
        logits = _prefill(model, ids[:, cached:], given, caches, opts)  # (B, V); given is None when cached
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


def _new_caches(model: CausalLM, capacity: int | None, static: bool, dtype: torch.dtype | str | None
                ) -> list[Cache]:
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
             stats: GenerationStats | None = None, kept: KeptCaches | None = None, **options: Any) -> Tensor:
    """Prompt plus new tokens, (B, T + n) long, n <= max_new_tokens.

    Args:
        input_ids: (B, T) prompt ids, left-padded when rows differ in length.
        attention_mask: (B, T) bool or 0/1, True/1 = real token; None = all real.
        stats: filled with token counts and timings.
        kept: caches kept from an earlier run, which ``input_ids`` continues
            (:class:`KeptCaches`): only its new tokens are prefilled.
        options: :class:`GenerationOptions` (max_new_tokens, temperature,
            top_k, top_p, seed, stop_ids, the three penalties, compile,
            cache, kv_dtype).
    """
    new = list(generate_steps(model, input_ids, attention_mask, stats=stats, kept=kept, **options))
    return torch.cat([input_ids, torch.stack(new, dim=1)], dim=1)  # (B, T) + (B, n) -> (B, T + n)


def stream_text(model: CausalLM, decode: Callable[[list[int]], str], input_ids: Tensor,
                attention_mask: Tensor | None = None, *, stats: GenerationStats | None = None,
                kept: KeptCaches | None = None, **options: Any) -> Iterator[str]:
    """Yield the new text of a single prompt (B = 1) piece by piece as tokens are produced.

    ``decode`` turns ids into text; a piece is held back while it ends in an
    incomplete UTF-8 character or may start a stop string. ``options`` are
    :func:`generate`'s keywords and ``stop`` (strings that end the text);
    ``kept``: as :func:`generate_steps`'s.
    """
    if isinstance(input_ids, Tensor) and input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"stream() takes one prompt (B = 1), got a batch of {input_ids.shape[0]}")
    context = input_ids[0, -1:].tolist() if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else []
    text = TextStream(decode, GenerationOptions.of(options).stop, context)
    steps = generate_steps(model, input_ids, attention_mask, stats=stats, kept=kept, **{**options, "stop": ()})
    return _pieces(steps, text)


def _pieces(steps: Generator[Tensor, None, None], text: TextStream) -> Iterator[str]:
    """New text per token of a single row, up to a stop string (:class:`attnkit.models.text.TextStream`)."""
    with closing(steps):  # a stop string ends the steps now (kept caches note what they hold), not at collection
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
