"""Tool calls in a model's own syntax: which syntax its chat template teaches, answers parsed into OpenAI's
``tool_calls`` (whole or streamed), and the grammar that makes an answer one call.

A chat template that offers tools reads the variable ``tools`` (Hugging Face's ``apply_chat_template(tools=)``)
and shows the model how to call one. attnkit knows the Hermes syntax, which Qwen 2.5 (and Qwen 3, Hermes 2 Pro)
templates teach::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

:func:`template_syntax` finds it in a template (a ValueError names what is missing), :meth:`ToolSyntax.parse`
splits an answer into its content and its calls, :class:`CallStream` does so piece by piece as the answer streams,
and :meth:`ToolSyntax.grammar` is the lark grammar (llguidance's, each function's arguments an embedded JSON
Schema) whose every sentence is exactly one call of one of the functions given: what tool_choice "required" or a
named function decodes under.

A call is the start tag, then (after whitespace) a JSON object read to its end by
:meth:`json.JSONDecoder.raw_decode`, not up to the first end tag, so an argument that spells either tag stays
inside its string; then the end tag, when it follows. A start tag followed by anything but an object (a sentence
that mentions it), or by an object that is not JSON or has no name, is text in the content, said as soon as that is
clear (streamed: when the word after the tag arrives, or the object closes). Qwen 2.5's template shows each call
on lines of its own, but a call after text on the same line ("Let me check. <tool_call>") is still a call, as
vLLM's Hermes parser takes it: what makes a call is the object after the tag, not where the tag stands. With
``parallel_tool_calls: false`` only an answer's first call is kept (:attr:`ToolSyntax.parallel`).

Content around calls loses the whitespace next to a call and at its ends, streamed or not, so both give the
same content (None when only calls remain).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from attnkit.models import chat

from .grammar import LAYOUT


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str

    def openai(self, call_id: str) -> dict[str, Any]:
        """OpenAI's shape of the call, under ``call_id`` (the id a ``tool`` message answers)."""
        return {"id": call_id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id() -> str:
    """A fresh call id, OpenAI's style: ``call_`` and 24 hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass(frozen=True)
class ToolSyntax:
    """A tool-call syntax: a call is ``start`` + ``{"name": ..., "arguments": {...}}`` + ``end``.

    ``parallel``: False when an answer may make only one call (OpenAI's ``parallel_tool_calls: false``): the first
    call is parsed, every later one dropped (neither a call nor content)."""

    name: str
    start: str
    end: str
    parallel: bool = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: the text outside the calls (None if nothing is left), the calls."""
        stream = CallStream(self)
        content, calls = stream.feed(text)
        rest, more = stream.close()
        return (content + rest) or None, calls + more

    def call(self, value: Any) -> ToolCall | None:
        """The call a JSON value after a start tag spells (``{"name", "arguments"}``), or None when it spells none."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text already
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def grammar(self, functions: Sequence[Mapping[str, Any]]) -> str:
        """A lark grammar (llguidance's) of exactly one call of one of ``functions`` (OpenAI's function objects,
        ``parameters`` a JSON Schema object), written as the template shows it: ``start``, one line of JSON with
        OpenAI's separators, ``end``."""
        if not functions:
            raise ValueError("a tool call grammar needs at least one function")
        rules = [f"start: {json.dumps(self.start + chr(10))} call {json.dumps(chr(10) + self.end)}",
                 "call: " + " | ".join(f"f{i}" for i in range(len(functions)))]
        for i, function in enumerate(functions):
            arguments = dict(function.get("parameters") or NO_ARGUMENTS)
            # definitions move to the call's root, where a "#/$defs/..." reference in the arguments looks
            defs = {key: arguments.pop(key) for key in ("$defs", "definitions") if key in arguments}
            schema = {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": LAYOUT, **defs}
            rules.append(f"f{i}: %json {json.dumps(schema)}")
        return "\n".join(rules)


# a function without ``parameters`` takes none: its forced call's arguments are {} (OpenAI's default schema
# would let them be any object, written until max_tokens)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
HERMES = ToolSyntax("hermes", "<tool_call>", "</tool_call>")
SYNTAXES = (HERMES,)


@lru_cache(maxsize=8)
def template_syntax(template: str | None) -> ToolSyntax:
    """The tool-call syntax ``template`` teaches; a ValueError saying why there is none (no template, a template
    that never reads ``tools``, or one whose syntax attnkit does not know). Cached: a server asks per request."""
    if template is None:
        raise ValueError("this model has no chat template, so no tool support; start attnkit serve with "
                         "--chat-template-file naming a template that offers tools")
    if not chat.reads(template, "tools"):
        raise ValueError("this model's chat template has no tool support (it never reads `tools`); start attnkit "
                         "serve with --chat-template-file naming a template that offers tools (such as Qwen 2.5's)")
    for syntax in SYNTAXES:
        if syntax.start in template and syntax.end in template:
            return syntax
    known = ", ".join(f"{s.name} ({s.start}...{s.end})" for s in SYNTAXES)
    raise ValueError(f"this model's chat template offers tools in a syntax attnkit does not parse; it knows {known}")


@dataclass
class CallStream:
    """An answer's text split into content and calls as it streams: :meth:`feed` each piece, :meth:`close` at the
    end. Held back until the next piece says what they are: text that may start a start tag, whitespace that may
    precede a call, and what follows a start tag until it is clearly a call (its JSON object has closed and
    parsed) or clearly not one (something other than an object follows the tag, or the object closed but does not
    spell a call). A mention of the tag in a sentence is said as soon as the next word follows it."""

    syntax: ToolSyntax
    calls: int = 0  # calls said so far
    _buffer: str = ""  # text not yet said: a possible start tag, or what follows a start tag
    _inside: bool = False  # the buffer follows a start tag
    _object: _ObjectEnd | None = None  # the JSON object after the start tag, once its "{" arrived
    _space: str = ""  # whitespace held back after content: said only when more content follows
    _fresh: bool = True  # at the answer's start or just after a call: leading whitespace is dropped
    _found: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) this piece completes."""
        self._buffer += text
        return self._said(self._run(final=False))

    def close(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) left at the answer's end: a last call whose object is whole is a call even without its
        end tag; an object cut short is text."""
        out = self._run(final=True)
        self._space = ""
        return self._said(out)

    def _run(self, *, final: bool) -> list[str]:
        out: list[str] = []
        while True:
            if self._inside:
                if not self._after_start(out, final=final):
                    break
                continue
            start = self._buffer.find(self.syntax.start)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, self.syntax.start)
                self._text(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._text(self._buffer[:start], out)  # the whitespace before it is held: dropped if it is a call
            self._inside, self._object = True, None
            self._buffer = self._buffer[start + len(self.syntax.start):]
        return out

    def _after_start(self, out: list[str], *, final: bool) -> bool:
        """Settle what follows a start tag, if it can be settled yet (False: wait for more). A call is the tag, a
        JSON object that spells one (its end found by :func:`json.JSONDecoder.raw_decode`, so a tag inside one of
        its strings is just text), then the end tag if it follows; otherwise the tag is text."""
        body = self._buffer
        if self._object is None:
            opening = len(body) - len(body.lstrip())
            if opening == len(body):  # nothing but whitespace after the tag yet
                return self._not_a_call(len(body), out) if final else False
            if body[opening] != "{":
                return self._not_a_call(0, out)
            self._object = _ObjectEnd(opening)
        closed = self._object.find(body)
        if closed is None:  # the object is still open
            return self._not_a_call(len(body), out) if final else False
        try:
            value, end = _DECODER.raw_decode(body, self._object.opening)
        except (ValueError, RecursionError):  # closed, but not JSON (or nested past what json reads)
            value, end = None, closed
        call = self.syntax.call(value)
        if call is None:  # the tag and the object are text, as written
            return self._not_a_call(end, out)
        after = body[end:].lstrip()
        if self.syntax.end.startswith(after) and len(after) < len(self.syntax.end):  # the end tag may follow
            if not final:
                return False
            end = len(body)  # at the answer's end: whitespace or a cut end tag, the call's own
        elif after.startswith(self.syntax.end):
            end = len(body) - len(after) + len(self.syntax.end)
        self._buffer, self._inside, self._object = body[end:], False, None
        self._fresh, self._space = True, ""
        if self.syntax.parallel or self.calls == 0:
            self.calls += 1
            self._found.append(call)
        return True

    def _not_a_call(self, taken: int, out: list[str]) -> bool:
        """The start tag and the first ``taken`` characters after it are text; scanning goes on after them."""
        self._text(self.syntax.start + self._buffer[:taken], out)
        self._buffer, self._inside, self._object = self._buffer[taken:], False, None
        return True

    def _said(self, out: list[str]) -> tuple[str, list[ToolCall]]:
        found, self._found = self._found, []
        return "".join(out), found

    def _text(self, text: str, out: list[str]) -> None:
        """Say ``text`` as content, less the whitespace next to a call or the answer's ends."""
        if self._fresh:
            text = text.lstrip()
            if not text:
                return
            self._fresh = False
        body = text.rstrip()
        if body:
            out.append(self._space + body)
            self._space = ""
        self._space += text[len(body):]


@dataclass
class _ObjectEnd:
    """Where a JSON object that starts at ``opening`` closes, found as its text arrives: brackets matched outside
    strings, each string's escapes skipped; a bracket that closes the wrong one ends it too (broken). It says
    nothing of whether the text between is JSON (raw_decode does): it says when to stop waiting for more."""

    opening: int
    end: int | None = None  # just after the closing bracket, once seen
    _seen: int = -1  # where the scan goes on (past an escaped character when a piece ended on a backslash)
    _closers: list[str] = field(default_factory=list)  # the bracket each open one needs, innermost last
    _in_string: bool = False

    def find(self, text: str) -> int | None:
        """The object's end in ``text`` (which only grows between calls), or None while it is still open."""
        pos = self.opening if self._seen < 0 else self._seen
        while self.end is None and (found := _STRUCTURE.search(text, pos)) is not None:
            mark, pos = found.group(), found.end()
            if mark == "\\":
                pos += 1  # the escaped character means nothing here
            elif mark == '"':
                self._in_string = not self._in_string
            elif self._in_string:
                continue
            elif mark in "{[":
                self._closers.append("}" if mark == "{" else "]")
            elif self._closers.pop() != mark or not self._closers:
                self.end = pos
        self._seen = pos if self.end is not None else max(pos, len(text))
        return self.end


_STRUCTURE = re.compile(r'[{}\[\]"\\]')
_DECODER = json.JSONDecoder()


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0 when none does)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def arguments_object(arguments: str) -> Any:
    """A call's ``arguments`` JSON text as the template should see it: the object it spells (Hugging Face's
    templates write ``arguments | tojson``), or the text itself when it spells none."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def valid_name(name: object) -> bool:
    """OpenAI's rule for a function name: 1 to 64 letters, digits, underscores and dashes."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None
