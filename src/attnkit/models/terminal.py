"""A decoder at the terminal, for ``attnkit generate`` and ``attnkit chat``: their options checked before the
load, the model loaded with a progress bar and a load line, an answer streamed to stdout, its speed on stderr.

Imports stay light: torch and the model load only when a function runs.
"""

from __future__ import annotations

import argparse
import sys
import warnings
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnkit._optional import require
from attnkit.models.runtime_options import (
    BASE_MODELS,
    check_runtime_options,
    check_weights_on_device,
    describe_device,
    model_name,
    packaged_path,
)

if TYPE_CHECKING:
    from attnkit.models.decoder import DecoderModel
    from attnkit.models.generation_options import GenerationStats
    from attnkit.models.tokenizer import GGUFTokenizer


def check_options(args: argparse.Namespace, *, chat: bool, static: bool = True) -> None:
    """Reject bad options before the (slow) model load; ``chat``: the prompt goes through a chat template;
    ``static``: --compile runs generate's step over static caches (``attnkit chat``'s engine compiles its paged
    step, which takes a sink window and an int8 cache)."""
    from attnkit.models.sampling import Penalties, Sampler
    from attnkit.models.sink_caches import SinkSpec

    if args.gguf is not None and args.model is not None:
        raise ValueError(f"--model {args.model} and --gguf name two models: give one")
    if chat and args.model in BASE_MODELS:
        command = "generate --chat" if getattr(args, "chat", False) else "chat"
        raise ValueError(f"--model {args.model} is a base model: it has no chat template and continues text, so "
                         f"{command} does not apply; run attnkit generate --model {args.model} \"TEXT\" without "
                         "--chat")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_runtime_options(args)
    check_weights_on_device(args)
    if args.weights not in (None, "float32") and args.dtype != "float32":
        raise ValueError(f"--weights {args.weights} computes in float32: drop --dtype {args.dtype}")
    Sampler(args.temperature, args.top_k, args.top_p)  # raises ValueError naming a bad value
    Penalties(args.frequency_penalty, args.presence_penalty, args.repetition_penalty)  # likewise
    shaping = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("top_k", "top_p", "seed")
               if getattr(args, name) is not None]
    if shaping and args.temperature == 0:
        raise ValueError(f"{', '.join(shaping)} shape sampling, and --temperature 0 (the default) is greedy: add "
                         "--temperature > 0 (e.g. 0.7), or drop them")
    sink = SinkSpec.parse(args.cache)
    if static and args.compile and sink is not None:
        raise ValueError(f"--compile runs over static caches and --cache {args.cache} evicts (its shapes change): "
                         "use one or the other")
    if static and args.compile and args.kv_dtype == "int8":
        raise ValueError("--compile runs over static caches and --kv-dtype int8 is a growing cache: use one or the "
                         "other")
    narrow = args.kv_dtype in ("bfloat16", "float16")  # int8 takes a float32 or a bfloat16 model's keys
    if args.kv_dtype != "float32" and sink is not None:
        raise ValueError(f"--kv-dtype {args.kv_dtype} stores the cache in fewer bytes, and --cache {args.cache} "
                         "re-rotates the keys it keeps at each eviction, which would round them again every time: "
                         "drop one of them")
    if narrow and args.dtype != "float32":
        raise ValueError(f"--kv-dtype {args.kv_dtype} stores a float32 model's cache in fewer bytes; --dtype "
                         f"{args.dtype} computes in the model's dtype: drop one of them")


def stderr_console() -> Any:
    """A rich console on stderr, where loading progress, notes and speed go (stdout holds the text)."""
    return require("rich.console", "attnkit generate").Console(stderr=True, highlight=False)


def note(console: Any, text: str) -> None:
    """A dim line on stderr; ``text`` is data, never markup."""
    escape = require("rich.markup", "attnkit chat").escape
    console.print(f"[dim]{escape(text)}[/dim]", soft_wrap=True)


def load_model(args: argparse.Namespace, console: Any) -> DecoderModel:
    """Load the model the options name (--model, --gguf, --dtype, --weights, --device) with a progress bar, then
    say in one line what runs: weights, device, compute and KV cache dtypes, threads."""
    import torch

    from attnkit.cpu import SlowDtypeWarning
    from attnkit.models.loader import load_gguf
    from attnkit.modules.quantize import weight_form

    rich_progress = require("rich.progress", "attnkit generate")
    path = args.gguf if args.gguf else packaged_path(args.model or "smollm2")
    with rich_progress.Progress(*rich_progress.Progress.get_default_columns(), console=console, transient=True,
                                disable=not console.is_terminal) as progress:  # no stray newline in logs
        task = progress.add_task(f"loading {model_name(args)}", total=None)

        def report(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        cpu = args.device == "cpu"  # a GPU takes plain weights; auto picks by architecture on the CPU
        asked = args.weights or ("auto" if args.dtype == "float32" and cpu else "float32")
        with warnings.catch_warnings(record=True) as slow:  # said in one line below, not as Python's warning
            warnings.simplefilter("always", SlowDtypeWarning)
            model = load_gguf(path, dtype=getattr(torch, args.dtype), progress=report, weights=asked)
    model = model if cpu else model.to(args.device)
    weights = weight_form(model)  # "float32" when nothing was swapped: the weights are then in --dtype
    weights = args.dtype if weights == "float32" else weights
    kv = args.kv_dtype if args.kv_dtype != "float32" else args.dtype
    threads = torch.get_num_threads()
    note(console, f"{model_name(args)} ({weights} weights, {describe_device(args.device)}): {args.dtype} compute, "
                   f"{kv} KV cache, {threads} CPU thread{'s' if threads > 1 else ''}")
    escape = require("rich.markup", "attnkit generate").escape
    for warning in slow:
        if issubclass(warning.category, SlowDtypeWarning):
            if cpu:  # the warning is about the CPU's arithmetic
                console.print(f"[yellow]warning:[/yellow] {escape(str(warning.message))}", soft_wrap=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return model


def gguf_tokenizer(model: DecoderModel) -> GGUFTokenizer:
    """The model's GGUF tokenizer (the one with a chat template); a model without one is a ValueError."""
    from attnkit.models.tokenizer import GGUFTokenizer

    if not isinstance(model.tokenizer, GGUFTokenizer):
        raise ValueError("this model has no GGUF tokenizer; load it with attnkit.models.load_gguf()")
    return model.tokenizer


def chat_ids(tokenizer: GGUFTokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
    """The chat prompt's ids (content as plain text); a template that cannot render is a ValueError."""
    try:
        return tokenizer.chat_ids(messages)
    except ValueError:
        raise
    except Exception as err:  # jinja2's TemplateSyntaxError, UndefinedError, ...: the file's template is broken
        jinja2 = sys.modules.get("jinja2.exceptions")
        if jinja2 is None or not isinstance(err, jinja2.TemplateError):
            raise
        where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise ValueError(f"the model file's chat template (tokenizer.chat_template) cannot be rendered: "
                         f"{type(err).__name__}{where}: {err}") from err


def report_speed(console: Any, stats: GenerationStats, *, cached: int = 0) -> None:
    """The speed line; ``cached``: the prompt's tokens found cached (not prefilled)."""
    if cached:
        prompt = f"prefilled {stats.prompt_tokens} new tokens ({cached} cached)"
    else:
        prompt = f"{stats.prompt_tokens} tokens"
    note(console, f"prompt: {prompt} in {stats.prefill_seconds:.2f} s ({stats.prefill_tokens_per_s:.1f} tokens/s) "
                   f"· generation: {stats.new_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s")


@dataclass
class Answer:
    """One streamed answer: its text, its speed and why it ended."""

    text: str  # what was written to stdout
    stats: GenerationStats
    ending: str  # "stop" (the model ended it), "max-new-tokens", "context" (window full) or "interrupted"
    cached: int = 0  # the prompt's tokens found cached (a chat's earlier turns), not prefilled again


_COMPILING_SAID: weakref.WeakSet[DecoderModel] = weakref.WeakSet()  # models whose compiling was announced


def stream_answer(model: DecoderModel, ids: Sequence[int], args: argparse.Namespace) -> Answer:
    """Stream ``attnkit generate``'s answer to the prompt ``ids`` to stdout; Ctrl-C stops it
    (``ending="interrupted"``)."""
    from contextlib import closing

    import torch

    from attnkit.models.generation import generate_steps
    from attnkit.models.generation_options import GenerationStats
    from attnkit.models.text import IncrementalDecoder

    budget = answer_budget(args, model.context_length, len(ids))
    if args.compile and model not in _COMPILING_SAID:  # the first answer's first step compiles: say so, once
        _COMPILING_SAID.add(model)
        print("compiling the decoding step (about a minute on a CPU the first time; this answer's speed line "
              "counts it)...", file=sys.stderr, flush=True)
    prompt = torch.tensor([list(ids)], dtype=torch.long, device=args.device)  # (1, T)
    stats, text, pieces, last = GenerationStats(), IncrementalDecoder(model.decode, ids[-1:]), [], -1
    try:
        steps = generate_steps(model, prompt, max_new_tokens=budget, **sampling_options(args), cache=args.cache,
                               kv_dtype=None if args.kv_dtype == "float32" else args.kv_dtype,
                               compile=args.compile, stats=stats)
        with closing(steps):  # closed at once, also on Ctrl-C
            for token in steps:  # (1,)
                last = int(token[0])
                pieces.append(write_stdout(text.add(last)))
        pieces.append(write_stdout(text.flush()))
    except KeyboardInterrupt:
        ending = "interrupted"
    else:
        ending = answer_ending(last in model.stop_token_ids or stats.new_tokens < budget, budget, args)
    write_stdout("\n")
    return Answer("".join(pieces), stats, ending)


def answer_budget(args: argparse.Namespace, context: int, prompt_tokens: int) -> int:
    """The most new tokens an answer may take: --max-new-tokens, and what the context leaves (none with a sink
    cache); a ValueError when the prompt leaves no room."""
    from attnkit.models.sink_caches import SinkSpec

    room = args.max_new_tokens if SinkSpec.parse(args.cache) is not None else context - prompt_tokens
    if room < 1:
        raise ValueError(f"the prompt has {prompt_tokens} tokens, no room left in the model's context length "
                         f"{context}")
    return int(min(args.max_new_tokens, room))


def sampling_options(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling options and penalties, as :class:`attnkit.models.generation_options.GenerationOptions`
    keywords."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "repetition_penalty": args.repetition_penalty, "frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty}


def answer_ending(stopped: bool, budget: int, args: argparse.Namespace) -> str:
    """:attr:`Answer.ending` of an answer that was not interrupted: "stop" when the model ended it (``stopped``),
    else what cut it at ``budget`` tokens."""
    if stopped:
        return "stop"
    return "max-new-tokens" if budget == args.max_new_tokens else "context"


def write_stdout(piece: str) -> str:
    """Write ``piece`` to stdout at once (flushed) and return it."""
    sys.stdout.write(piece)
    sys.stdout.flush()
    return piece


def tell_ending(console: Any, answer: Answer, args: argparse.Namespace, context: int) -> None:
    """Say on stderr when an answer was cut (by --max-new-tokens, or a full context) rather than finished."""
    if answer.ending == "max-new-tokens":
        note(console, f"(answer cut at --max-new-tokens {args.max_new_tokens})")
    elif answer.ending == "context":
        note(console, f"(answer cut: the model's context of {context} tokens is full)")

