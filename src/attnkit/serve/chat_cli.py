"""``attnkit chat``: an interactive conversation, each turn one request to the serving engine stepped here.

The engine (:class:`~attnkit.serve.engine.Engine`, driven from this thread by :mod:`.driver`) keeps the
conversation's keys and values in its prefix cache: a turn prefills only the tokens after the whole blocks it
finds there, and its speed line says so ("prefilled 23 new tokens (128 cached)"); a template that re-renders
earlier turns, or a history cut to fit, finds fewer. With --compile the eager step answers while the decoding
step compiles in the background, kept on disk as ``attnkit serve`` keeps it (the next start loads it). The
parser is :func:`attnkit.models.cli.add_parser`'s; loading and the terminal's pieces are
:mod:`attnkit.models.terminal`'s.
"""

from __future__ import annotations

import argparse
import codecs
import io
import sys
import time
from contextlib import closing
from typing import TYPE_CHECKING, Any

from attnkit.models.cli import add_generation_options
from attnkit.models.runtime_options import set_threads
from attnkit.models.terminal import (
    Answer,
    chat_ids,
    check_options,
    gguf_tokenizer,
    load_model,
    note,
    report_speed,
    stderr_console,
    tell_ending,
    write_stdout,
)

if TYPE_CHECKING:
    from attnkit.models.decoder import DecoderModel
    from attnkit.serve.engine import Engine

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system message stays)",
    "/exit": "end the session (so do Ctrl-D, and Ctrl-C at an empty prompt)",
}
BLOCK_SIZE = 16  # positions per KV block (the prefix cache finds a conversation's earlier turns in whole blocks)
KV_MEMORY_MIB = 512  # the most KV memory a chat holds (attnkit serve's default): the context, or what fits in it
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
    """The engine a chat steps: one request at a time, a prompt prefilled in one forward, KV memory for the model's
    context (at most :data:`KV_MEMORY_MIB`), the options' cache, KV dtype and device; with --compile the decoding
    step compiles in the background (kept on disk under attnkit's cache folder, as ``attnkit serve`` keeps it)."""
    from attnkit.serve.engine import Engine
    from attnkit.serve.paged import PagedKVPool, pool_dtype

    config: Any = model.config  # a decoder's: layers, key/value heads, head size
    kv_dtype = None if args.kv_dtype == "float32" else args.kv_dtype
    dtype = pool_dtype(next(model.parameters()).dtype, kv_dtype)
    per_block = PagedKVPool.bytes_per_block(num_layers=config.num_layers, block_size=BLOCK_SIZE,
                                            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)
    blocks = -(-model.context_length // BLOCK_SIZE) + 1  # the context, and a block for a prompt's last token
    mib = min(blocks * per_block, KV_MEMORY_MIB * 2**20) / 2**20
    return Engine(model, model.decode, kv_memory_mib=mib, block_size=BLOCK_SIZE, max_batch=1,
                  token_budget=model.context_length, kv_dtype=kv_dtype, compile=args.compile, device=args.device,
                  cache=args.cache)


class _Chat:
    """One conversation: its messages, the engine that answers them (and keeps their keys and values), the
    prompt that fits, and what the user is told once."""

    def __init__(self, model: DecoderModel, args: argparse.Namespace, console: Any) -> None:
        self.model, self.args, self.console = model, args, console
        self.tokenizer = gguf_tokenizer(model)
        self.start = [{"role": "system", "content": args.system}] if args.system else []
        self.messages = list(self.start)
        self.engine = conversation_engine(model, args)
        self.limit = min(model.context_length, self.engine.capacity)  # the tokens a prompt and answer may take
        self.told: set[str] = set()
        self.readline = None
        self.replaced = 0
        self.prompt = "> " if sys.stdin.isatty() else ""  # piped input: stdout holds the answers only
        if args.compile:
            note(console, "compiling the decoding step in the background (a minute or two on a CPU the first time, "
                 "seconds once kept on disk); answers run eagerly until it is ready")

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

    def prompt_ids(self) -> list[int]:
        """The conversation's prompt, its oldest turns dropped (the system message kept) until an answer fits."""
        context = self.limit
        want = min(self.args.max_new_tokens, context // 2)
        first = len(self.start)
        while True:
            ids = chat_ids(self.tokenizer, self.messages)
            if len(ids) + want <= context or len(self.messages) <= first + 1:
                return ids
            end = first + 1  # drop the oldest turn: a user message and the answers up to the next one
            while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
                end += 1
            del self.messages[first:end]
            held = "the model's context" if context == self.model.context_length else "the chat's KV memory"
            self.tell_once("trim", f"(the conversation outgrew {held} of {context} tokens: from now on its oldest "
                           "turns are dropped; the system message stays)")

    def turn(self, line: str) -> None:
        """Answer one message, keeping the conversation whatever happens to this answer."""
        self.messages.append({"role": "user", "content": line})
        try:
            answer = stream_request(self.engine, self.prompt_ids(), self.args, self.limit)
        except ValueError as err:  # e.g. one message longer than the context: say so, keep the session
            self.messages.pop()
            note(self.console, f"error: {err}")
            return
        if answer.ending == "interrupted":
            if answer.text:
                self.messages.append({"role": "assistant", "content": answer.text})
                note(self.console, "(answer stopped by Ctrl-C; what was written stays in the conversation)")
            else:
                self.messages.pop()
                note(self.console, "(answer stopped by Ctrl-C before it began; your message is dropped)")
            return
        self.messages.append({"role": "assistant", "content": answer.text})
        tell_ending(self.console, answer, self.args, self.limit)
        report_speed(self.console, answer.stats, cached=answer.cached)
        self.tell_compiled()

    def tell_compiled(self) -> None:
        """Say once when the background compile ended (ready, or failed: answers stay eager)."""
        status = self.engine.compile_status()
        if status["state"] == "ready":
            self.tell_once("compiled", f"(the compiled decoding step is ready after {status['seconds']} s: answers "
                           "use it from now on)")
        elif status["state"] == "failed":
            self.tell_once("compiled", f"(compiling the decoding step failed, answers stay eager: {status['error']})")


def stream_request(engine: Engine, ids: list[int], args: argparse.Namespace, limit: int) -> Answer:
    """Stream the answer to the prompt ``ids`` to stdout, one request to ``engine`` stepped here (:mod:`.driver`);
    Ctrl-C stops it (``ending="interrupted"``). ``limit``: the tokens the prompt and its answer may take."""
    from attnkit.models.generation_options import GenerationOptions, GenerationStats
    from attnkit.models.sink_caches import SinkSpec
    from attnkit.serve.driver import run_request

    endless = SinkSpec.parse(args.cache) is not None  # a sink window: no limit on new tokens
    room = args.max_new_tokens if endless else limit - len(ids)
    if room < 1:
        held = (f"the model's context length {limit}" if limit == engine.model.context_length else
                f"the chat's KV memory of {limit} tokens")
        raise ValueError(f"the prompt has {len(ids)} tokens, no room left in {held}")
    budget = min(args.max_new_tokens, room)
    options = GenerationOptions(max_new_tokens=budget, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed, repetition_penalty=args.repetition_penalty,
                                frequency_penalty=args.frequency_penalty, presence_penalty=args.presence_penalty)
    stats, pieces, reason = GenerationStats(rows=1), [], None
    began = first = time.perf_counter()
    answering = run_request(engine, ids, options)
    events = iter(answering)
    try:
        with closing(events):  # closed at once, also on Ctrl-C: the request ends and its blocks go back
            for event in events:
                if not stats.new_tokens and event.token_ids:
                    first = time.perf_counter()
                stats.new_tokens += len(event.token_ids)
                pieces.append(write_stdout(event.text))
                reason = event.finish_reason
    except KeyboardInterrupt:
        reason = "interrupted"
    if reason == "error":
        write_stdout("\n")
        raise ValueError(f"the answer failed: {event.error}")
    write_stdout("\n")
    stats.prompt_tokens = len(ids) - answering.request.cached_tokens
    stats.prefill_seconds, stats.decode_seconds = first - began, time.perf_counter() - first
    ending = ("interrupted" if reason == "interrupted" else "stop" if reason != "length" or stats.new_tokens < budget
              else "max-new-tokens" if budget == args.max_new_tokens else "context")
    return Answer("".join(pieces), stats, ending, answering.request.cached_tokens)


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
    chat = _Chat(model, args, console)
    chat_ids(chat.tokenizer, [*chat.start, {"role": "user", "content": "hi"}])  # a broken template: exit 2 now
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
