"""``attnkit chat``: an interactive conversation, each turn one request to the serving engine.

This thread steps the engine (:class:`~attnkit.serve.engine.Engine`, through :mod:`.driver`), holding Ctrl-C
back until a step ends: it then cancels the request, and never interrupts a step. The engine keeps the
conversation's keys and values in its prefix cache: a turn prefills only the tokens after the whole blocks it
finds there, and its speed line says so ("prefilled 23 new tokens (128 cached)"); a
template that re-renders earlier turns, or a history cut to fit, finds fewer. With --compile the engine's
decoding step is compiled before the first answer and kept on disk as ``attnkit serve`` keeps it (the next start
loads it). The parser: :func:`add_parser` (its options are ``attnkit generate``'s); loading and the terminal's
pieces are :mod:`attnkit.models.terminal`'s.
"""

from __future__ import annotations

import argparse
import codecs
import io
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from attnkit.models.cli import add_generation_options
from attnkit.models.generation_options import GenerationOptions, GenerationStats
from attnkit.models.runtime_options import set_threads
from attnkit.models.terminal import (
    Answer,
    answer_budget,
    answer_ending,
    chat_ids,
    check_options,
    gguf_tokenizer,
    load_model,
    note,
    report_speed,
    sampling_options,
    stderr_console,
    tell_ending,
    write_stdout,
)
from attnkit.serve.driver import Answering, run_request, sigint_held
from attnkit.serve.engine import Engine
from attnkit.serve.events import EngineError, Event
from attnkit.serve.paged import PagedKVPool, pool_dtype

if TYPE_CHECKING:
    from attnkit.models.decoder import DecoderModel

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system message stays)",
    "/exit": "end the session (so do Ctrl-D, and Ctrl-C at an empty prompt)",
}
BLOCK_SIZE = 16  # positions per KV block (the prefix cache finds a conversation's earlier turns in whole blocks)
PREFILL_BUDGET = 512  # the most prompt tokens one step prefills (about a second on 2 cores: Ctrl-C waits for it)
_REPLACE = "attnkit.replace"  # the error handler stdin decodes with in chat (see _tolerant_stdin)


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


def conversation_engine(model: DecoderModel, args: argparse.Namespace) -> Engine:
    """The engine a chat steps: one request at a time, a prompt prefilled in pieces of at most
    :data:`PREFILL_BUDGET` tokens (Ctrl-C waits for a step to end), a pool of the model's context (memory taken
    as positions are written), the options' cache, KV dtype and device; with --compile, the decoding step
    compiling (:func:`compile_first` waits for it)."""
    config: Any = model.config  # a decoder's: layers, key/value heads, head size
    kv_dtype = None if args.kv_dtype == "float32" else args.kv_dtype
    dtype = pool_dtype(next(model.parameters()).dtype, kv_dtype)
    per_block = PagedKVPool.bytes_per_block(num_layers=config.num_layers, block_size=BLOCK_SIZE,
                                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
    blocks = -(-model.context_length // BLOCK_SIZE)  # the context
    return Engine(model, model.decode, kv_memory_mib=blocks * per_block / 2**20, block_size=BLOCK_SIZE,
                  max_batch=1, token_budget=PREFILL_BUDGET, kv_dtype=kv_dtype, compile=args.compile,
                  device=args.device, cache=args.cache)


def compile_first(engine: Engine, console: Any) -> None:
    """Wait for the engine's decoding step to compile, saying so (Ctrl-C stops waiting: eager steps answer while it
    compiles on). Kept on disk under attnkit's cache folder, as ``attnkit serve`` keeps it, the next start loads
    it. Not in the background by default: a compile beside eager steps slows them severely on a CPU (Python's
    GIL; BENCHMARKS.md, round eighteen). The compile's warnings (it failed; a step the graph could not take) are
    said as notes."""
    _notes_from(logging.getLogger("attnkit.serve.compile"), console)
    note(console, "compiling the decoding step (a minute or two on a CPU the first time, seconds once kept on "
         "disk); Ctrl-C answers eagerly meanwhile, slowly while it compiles")
    try:
        engine.wait_compiled()
    except KeyboardInterrupt:
        note(console, "(answering eagerly while the decoding step compiles in the background)")
        return
    status = engine.compile_status()
    if status["state"] == "ready":
        note(console, f"(the compiled decoding step is ready after {status['seconds']} s)")


class _Notes(logging.Handler):
    """A log's warnings as notes on a console."""

    def __init__(self, console: Any) -> None:
        super().__init__(logging.WARNING)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        note(self.console, f"({record.getMessage()})")


def _notes_from(log: logging.Logger, console: Any) -> None:
    """The log's warnings as notes on ``console`` (its info lines left out), in place of an earlier chat's: each
    said once, on the console of the chat that waits."""
    for handler in [h for h in log.handlers if isinstance(h, _Notes)]:
        log.removeHandler(handler)
    log.addHandler(_Notes(console))
    log.propagate = False


class _Chat:
    """One conversation: its messages, the engine that answers them (and keeps their keys and values), the
    prompt that fits, and what the user is told once."""

    def __init__(self, model: DecoderModel, args: argparse.Namespace, console: Any, engine: Engine) -> None:
        self.model, self.args, self.console, self.engine = model, args, console, engine
        self.tokenizer = gguf_tokenizer(model)
        self.start = [{"role": "system", "content": args.system}] if args.system else []
        self.messages = list(self.start)
        self.told: set[str] = set()
        self.readline = None
        self.replaced = 0
        self.prompt = "> " if sys.stdin.isatty() else ""  # piped input: stdout holds the answers only

    def tell_once(self, key: str, text: str) -> None:
        if key not in self.told:
            self.told.add(key)
            note(self.console, text)

    def read(self) -> str | None:
        """The next line typed; None when the session ends (Ctrl-D, or Ctrl-C at an empty prompt)."""
        try:
            line = input(self.prompt)
        except EOFError:
            write_stdout("\n")
            return None
        except KeyboardInterrupt:
            typed = self.readline.get_line_buffer() if self.readline is not None else ""
            write_stdout("\n")
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
            note(self.console, "conversation reset")
        elif name == "/help":
            for command, what in COMMANDS.items():
                self.console.print(f"  {command:<7} {what}", markup=False)
            note(self.console, "Ctrl-C during an answer stops it; its first part stays in the conversation")
        else:
            note(self.console, f"unknown command {name}: /help lists the commands")
        return True

    def fitted(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """``messages`` with the oldest turns dropped (the system message kept) until an answer fits the context,
        and their prompt's ids."""
        context = self.model.context_length
        want = min(self.args.max_new_tokens, context // 2)
        first, messages = len(self.start), list(messages)
        while len(ids := chat_ids(self.tokenizer, messages)) + want > context and len(messages) > first + 1:
            end = first + 1  # drop the oldest turn: a user message and the answers up to the next one
            while end < len(messages) - 1 and messages[end]["role"] != "user":
                end += 1
            del messages[first:end]
        return messages, ids

    def turn(self, line: str) -> None:
        """Answer one message; the conversation changes (its oldest turns dropped to fit, this message and its
        answer, or what was written of it, added) only once there is an answer."""
        asked = [*self.messages, {"role": "user", "content": line}]
        messages, ids = self.fitted(asked)
        try:
            answer = stream_request(self.engine, ids, self.args)
        except (ValueError, EngineError) as err:  # one message longer than the context, a dead engine: keep going
            note(self.console, f"error: {err}")
            if not self.engine.alive:
                note(self.console, "(the engine stopped; a new one answers from now on, the conversation kept)")
                self.engine = conversation_engine(self.model, self.args)
                if self.args.compile:  # as at the start: kept on disk, its compiled step loads in seconds
                    compile_first(self.engine, self.console)
            return
        if answer.ending == "interrupted" and not answer.text:
            note(self.console, "(answer stopped by Ctrl-C before it began; your message is dropped)")
            return
        if len(messages) < len(asked):
            self.tell_once("trim", f"(the conversation outgrew the model's context of {self.model.context_length} "
                           "tokens: from now on its oldest turns are dropped; the system message stays)")
        self.messages = [*messages, {"role": "assistant", "content": answer.text}]
        if answer.ending == "interrupted":
            note(self.console, "(answer stopped by Ctrl-C; what was written stays in the conversation)")
            return
        with sigint_held(replay=False):  # the answer has ended: a Ctrl-C meant for it is dropped, the session goes on
            tell_ending(self.console, answer, self.args, self.model.context_length)
            report_speed(self.console, answer.stats, cached=answer.cached)


def stream_request(engine: Engine, ids: list[int], args: argparse.Namespace) -> Answer:
    """Stream the answer to the prompt ``ids`` to stdout, one request to ``engine`` stepped here (:mod:`.driver`);
    Ctrl-C stops it (``ending="interrupted"``)."""
    budget = answer_budget(args, engine.model.context_length, len(ids))
    options = GenerationOptions(max_new_tokens=budget, **sampling_options(args))
    stats, pieces, last = GenerationStats(rows=1), [], Event("", [])
    began = first = time.perf_counter()
    answering: Answering | None = None
    try:
        answering = run_request(engine, ids, options)
        for last in answering:
            first = first if stats.new_tokens or not last.token_ids else time.perf_counter()
            stats.new_tokens += len(last.token_ids)
            pieces.append(write_stdout(last.text))
    except KeyboardInterrupt:
        last = Event("", [], "interrupted")
    finally:  # Ctrl-C or any error: the request is cancelled and its blocks are free before the next turn
        if answering is not None:
            answering.close()
    cached = 0 if answering is None else answering.request.cached_tokens  # set when the engine admitted it
    write_stdout("\n")
    if last.finish_reason == "error":
        raise ValueError(f"the answer failed: {last.error}")
    stats.prompt_tokens = len(ids) - cached
    stats.prefill_seconds, stats.decode_seconds = first - began, time.perf_counter() - first
    stopped = last.finish_reason != "length" or stats.new_tokens < budget  # a stop id or string
    ending = "interrupted" if last.finish_reason == "interrupted" else answer_ending(stopped, budget, args)
    return Answer("".join(pieces), stats, ending, cached)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand (its options are ``attnkit generate``'s)."""
    commands = "; ".join(f"{name} {what}" for name, what in COMMANDS.items())
    c = sub.add_parser("chat", help="talk with a real language model (SmolLM2-135M-Instruct)",
                       description="An interactive chat that keeps the conversation, with line editing and "
                       f"history at a terminal. Commands: {commands}. Ctrl-C during an answer stops that answer "
                       "(what was written stays in the conversation). When the conversation outgrows the "
                       "model's context, its oldest turns are dropped (the system message stays).")
    c.add_argument("--system", help="a system message to start the conversation with")
    add_generation_options(c, max_new_tokens=256)
    c.set_defaults(func=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    """Run ``attnkit chat``: read lines until Ctrl-D or /exit, answering each; 0 at the end."""
    check_options(args, chat=True, static=False)
    set_threads(args)
    console = stderr_console()
    model = load_model(args, console)
    return _converse(_Chat(model, args, console, conversation_engine(model, args)), console)


def _converse(chat: _Chat, console: Any) -> int:
    """Read lines until Ctrl-D or /exit, answering each; 0 at the end."""
    chat_ids(chat.tokenizer, [*chat.start, {"role": "user", "content": "hi"}])  # a broken template: exit 2 now
    if chat.args.compile:
        compile_first(chat.engine, console)
    _tolerant_stdin()
    chat.readline = _line_editing()
    note(console, "chat with the model: /help lists the commands; Ctrl-C stops an answer; Ctrl-D ends")
    while (line := chat.read()) is not None:
        if line.strip().startswith("/"):
            if not chat.command(line):
                break
        elif line.strip():
            chat.turn(line)
    return 0
