"""What a generation run is given: the model it drives (:class:`CausalLM`), its options, the statistics it
fills in, and the checks of its inputs, all before the first token (:mod:`.generation` runs the loop).

Legend: B batch, T prompt tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from attnkit.modules.cache_protocol import Cache, check_storage_dtype

from .sampling import Penalties, Sampler
from .sink_caches import SinkSpec


class CausalLM(Protocol):
    """What the generation loop needs from a decoder model."""

    vocab_size: int
    context_length: int
    pad_token_id: int
    stop_token_ids: tuple[int, ...]

    def new_caches(self, capacity: int | None = None, *, static: bool = False,
                   dtype: torch.dtype | None = None) -> list[Cache]:
        """One empty KV cache per attention layer, each for up to ``capacity`` positions."""
        ...

    def step(self, input_ids: Tensor, positions: Tensor | None, kv_caches: Sequence[Cache]) -> Tensor:
        """Logits (B, V) of the last position after storing input_ids (B, T) at ``positions`` (B, T).

        ``positions`` None: after what the caches hold. Position -1 marks padding.
        """
        ...


MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 300  # the most token ids one logit_bias may name (OpenAI's limit)


def check_logit_bias(logit_bias: object) -> dict[int, float] | None:
    """``logit_bias`` checked: {token id: bias in [-100, 100]} with at most :data:`MAX_LOGIT_BIAS` ids, keys ints or
    their decimal strings (JSON's keys); None or {} -> None. A ValueError names the offending id or bias."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, Mapping):
        raise ValueError(f"logit_bias must be a map of token id -> bias, got logit_bias={logit_bias!r}")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias names {len(logit_bias)} token ids, more than {MAX_LOGIT_BIAS}")
    checked = {}
    for key, bias in logit_bias.items():
        digits = isinstance(key, str) and key.isascii() and key.isdecimal()
        if not (digits or (isinstance(key, int) and not isinstance(key, bool) and key >= 0)):
            raise ValueError(f"logit_bias key {key!r} is not a token id (a non-negative integer)")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{key!r}] = {bias!r}: a bias must be a number in [-100, 100]")
        checked[int(key)] = float(bias)
    return dict(sorted(checked.items())) or None


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate: every keyword of :func:`generate`, checked once.

    Args:
        max_new_tokens: the most tokens to add (>= 1); prompt + these must fit the context.
        temperature: 0 = greedy; > 0 samples from softmax(logits / temperature).
        top_k, top_p: keep only the k most likely tokens / the smallest set
            with probability >= top_p before sampling.
        seed: an int (row r samples with seed + r), one int per row, or None
            (fresh seeds). A row's random numbers depend only on its seed,
            never on the other rows; its tokens also on its logits, which a
            batch's shape (padding, other rows) moves by about 5e-5 with
            float32 / float16 weights and by tenths with int8 / int4 weights
            (their bfloat16 inputs magnify the rounding): sampled int8 / int4
            rows generally differ alone and in a batch (:mod:`.sampling`).
        stop_ids: ids that end a row (kept in the output, then pad ids);
            None = the model's end-of-turn / end-of-text ids, [] = never stop early.
        frequency_penalty, presence_penalty: OpenAI's penalties in [-2, 2]
            on tokens the answer already holds (per occurrence, and once);
            0 = off (:class:`attnkit.models.sampling.Penalties`).
        repetition_penalty: transformers' and llama.cpp's: a token of the
            prompt or the answer has its logit divided by it (multiplied,
            where negative); 1 = off, 1.1 to 1.3 stops a greedy answer
            looping.
        logprobs: None (off), or k in [0, 20]: the log-probability of each
            chosen token and of the k most likely ones, from the logits the
            sampler saw (after the penalties, before temperature, top-k and
            top-p). The serving engine reports them; ``generate()`` refuses it.
        logit_bias: {token id: bias}, OpenAI's: each bias in [-100, 100] is
            added to that token's logit before anything else (penalties,
            a constraint, the sampler: logprobs then see the biased scores);
            -100 all but bans a token, 100 all but forces it. At most 300
            ids (ints, or their decimal strings as JSON keys are), each in
            the vocabulary (checked against the model before the first
            token). ``generate()``, ``stream()`` and the serving engine
            apply it.
        stop: strings that end the text (a string or a list of them); the
            first match ends it and is not shown. Text streams honour it
            (``stream()``, the serving engine); ``generate()`` returns ids,
            not text, and refuses it.
        compile: run each decoding step as one compiled graph over static
            caches (the first call compiles, about a minute for SmolLM2 on
            a CPU: BENCHMARKS.md; the graph serves every cache size, prompt + max_new_tokens;
            another batch size, sampling setting or set of stop ids
            compiles again). On a GPU the graph is also captured as a CUDA
            graph (``mode="reduce-overhead"``): one replay per step.
        cache: "full" (default: the model's caches, every position kept) or
            "sink:SINKS,WINDOW[,CHUNK]" (a :class:`SinkSpec`): attention sinks
            and a recent window in constant memory, with no limit on new
            tokens; prompts without padding, not with ``compile`` nor
            ``kv_dtype`` (each eviction re-rotates the kept keys, which a
            narrower storage would round again every time).
        kv_dtype: the dtype the full caches store keys and values in: None
            (default: the model's), or ``torch.bfloat16`` / ``torch.float16``
            (or their names) under a float32 model: half the bytes per cached
            position, so twice the context fits; attention reads float32
            copies of the rounded keys and values (not faster: BENCHMARKS.md).
            ``"int8"`` (``KVCache(dtype=torch.int8)``: :mod:`attnkit.modules.int8_storage`): a
            quarter of the bytes, and decoding reads them with an int8
            kernel (faster at long contexts, slower at short ones; 96.1% of
            SmolLM2's greedy choices: opt-in; not with ``compile``).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | Sequence[int] | None = None
    stop_ids: Sequence[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    logit_bias: Mapping[int, float] | None = None
    stop: str | Sequence[str] = ()
    compile: bool = False
    cache: str | SinkSpec = "full"
    kv_dtype: torch.dtype | str | None = None
    sampler: Sampler = field(init=False, repr=False, compare=False)
    penalties: Penalties = field(init=False, repr=False, compare=False)
    sink: SinkSpec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got max_new_tokens={n!r}")
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got logprobs={k!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got stop={self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if not isinstance(self.compile, bool):
            raise TypeError(f"compile must be a bool, got compile={self.compile!r}")
        object.__setattr__(self, "sampler", Sampler(self.temperature, self.top_k, self.top_p))
        object.__setattr__(self, "penalties", Penalties(self.frequency_penalty, self.presence_penalty,
                                                        self.repetition_penalty))
        object.__setattr__(self, "sink", SinkSpec.parse(self.cache))
        object.__setattr__(self, "kv_dtype", kv_storage(self.kv_dtype))
        if self.sink is not None and self.kv_dtype is not None:
            raise ValueError(f"kv_dtype={self.kv_dtype} is for the full caches: cache={self.cache!r} re-rotates the "
                             "keys it keeps at each eviction, which would round them again every time (an error "
                             "that grows with the evictions), so it stores the model's dtype: use one or the other")
        if self.kv_dtype is torch.int8 and self.compile:
            raise ValueError("compile=True runs over static caches, and kv_dtype='int8' is a growing cache "
                             "(KVCache(dtype=torch.int8)): use one or the other")
        if self.sink is not None and self.compile:
            raise ValueError(f"compile=True runs over static caches, and cache={self.cache!r} is not one (its "
                             "evictions change the shapes): use one or the other")

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> GenerationOptions:
        """Options from keywords; an unknown keyword is named with the known ones."""
        known = [name for name in cls.__dataclass_fields__ if name not in ("sampler", "penalties", "sink")]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown generation option {unknown[0]!r}; known: {', '.join(known)}")
        return cls(**options)


@dataclass
class GenerationStats:
    """Filled in by a generation run: token counts over every row, and seconds of prefill and decode.

    ``prompt_tokens``: the prompts' real tokens (left padding not counted); ``new_tokens``: the tokens the
    rows sampled, each row's stop id included and the pad ids after it not; ``steps``: tokens per row so
    far (the longest row's count); ``rows``: the batch size.
    """

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    steps: int = 0
    rows: int = 0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens after each row's first (which prefill produced) per second of decoding, over all rows."""
        decoded = max(self.new_tokens - self.rows, 0)
        return decoded / self.decode_seconds if self.decode_seconds > 0 else 0.0


_KV_NAMES = ("bfloat16", "float16", "int8")  # the storage dtypes kv_dtype may name


def kv_storage(kv_dtype: object) -> torch.dtype | None:
    """A cache storage dtype from a dtype or its name ("bfloat16", "float16", "int8"); None = the model's own.

    int8 is ``KVCache(dtype=torch.int8)`` (codes and scales, read by an int8 kernel:
    :mod:`attnkit.modules.int8_storage`).
    """
    named = getattr(torch, kv_dtype, None) if isinstance(kv_dtype, str) and kv_dtype in _KV_NAMES else kv_dtype
    if named is torch.int8:
        return torch.int8
    try:
        return check_storage_dtype(named)
    except ValueError:
        raise ValueError(f"kv_dtype must be None (the model's dtype), 'bfloat16', 'float16' or 'int8' (or the torch "
                         f"dtype), got kv_dtype={kv_dtype!r}") from None


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


def check_fit(prompt_len: int, max_new_tokens: int, room: int, what: str) -> None:
    """The one "does it fit" check: a prompt of ``prompt_len`` tokens and ``max_new_tokens`` new ones must fit
    ``room`` positions (``what`` names them: the context length, a server's KV memory)."""
    if prompt_len > room:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than {what} ({room} positions); shorten it "
                         "(nothing is truncated)")
    if prompt_len + max_new_tokens > room:
        raise ValueError(f"prompt ({prompt_len} tokens) + max_new_tokens={max_new_tokens} exceeds {what} ({room} "
                         f"positions); ask for at most {room - prompt_len} new tokens")


def check_budget(model: CausalLM, prompt_len: int, options: GenerationOptions) -> tuple[int, ...]:
    """Raise a ValueError if a prompt of ``prompt_len`` tokens and ``options.max_new_tokens`` new ones do not fit
    the model's context (or its sink window does not), or a stop id or ``logit_bias`` token is not a token id;
    the stop ids (the model's own when ``options.stop_ids`` is None)."""
    if options.sink is not None:
        options.sink.check_fits(model.context_length, options.cache)
    else:
        check_fit(prompt_len, options.max_new_tokens, model.context_length, "the model's context length")
    return check_stops(model, options)


def check_stops(model: CausalLM, options: GenerationOptions) -> tuple[int, ...]:
    """The stop ids (the model's own when ``options.stop_ids`` is None); a ValueError if one of them or a
    ``logit_bias`` token is not a token id."""
    given = options.stop_ids
    if given is not None and (isinstance(given, (str, bytes, Tensor)) or not isinstance(given, Iterable)):
        raise ValueError(f"stop_ids must be a list of token ids (or None: the model's own), got stop_ids={given!r}")
    for token in options.logit_bias or ():
        if token >= model.vocab_size:
            raise ValueError(f"logit_bias names token id {token}, outside the vocabulary [0, {model.vocab_size})")
    stops = model.stop_token_ids if given is None else tuple(given)
    for s in stops:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < model.vocab_size:
            raise ValueError(f"stop id {s!r} is not a token id in [0, {model.vocab_size})")
    return stops
