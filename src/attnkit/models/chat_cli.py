"""``attnkit chat``: an interactive conversation that keeps its KV caches between turns.

A turn prefills only its new tokens, and its speed line says so ("prefilled 23 new tokens (137 cached)"), or why
the whole conversation was recomputed (its oldest turns dropped, a template that re-renders earlier turns,
--compile's static caches, a sink cache). The parser is :func:`attnkit.models.cli.add_parser`'s.
"""

from __future__ import annotations

import argparse
import codecs
import io
import sys
from typing import TYPE_CHECKING, Any

from attnkit.models.runtime_options import set_threads
from attnkit.models.terminal import (
    chat_ids,
    check_options,
    gguf_tokenizer,
    load_model,
    note,
    report_speed,
    stderr_console,
    stream_answer,
    tell_ending,
    write_stdout,
)

if TYPE_CHECKING:
    from attnkit.models.decoder import DecoderModel
    from attnkit.models.generation import KeptCaches

COMMANDS = {
    "/help": "list these commands",
    "/reset": "forget the conversation (a --system message stays)",
    "/exit": "end the session (so do Ctrl-D, and Ctrl-C at an empty prompt)",
}
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
        self.tokenizer = gguf_tokenizer(model)
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
            self.kept.clear()
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
        context = self.model.context_length
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
            answer = stream_answer(self.model, ids, self.args, kept)
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
        tell_ending(self.console, answer, self.args, self.model.context_length)
        report_speed(self.console, answer.stats, cached=cached, why=why)


def run_chat(args: argparse.Namespace) -> int:
    """Run ``attnkit chat``: read lines until Ctrl-D or /exit, answering each; 0 at the end."""
    check_options(args, chat=True)
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
