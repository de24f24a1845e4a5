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
named function decodes under. A block whose JSON does not parse, or has no name, stays text in the content.

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
    """A tool-call syntax: a call is ``start`` + ``{"name": ..., "arguments": {...}}`` + ``end``."""

    name: str
    start: str
    end: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer: the text outside the calls (None if nothing is left), the calls."""
        stream = CallStream(self)
        content, calls = stream.feed(text)
        rest, more = stream.close()
        return (content + rest) or None, calls + more

    def call(self, body: str) -> ToolCall | None:
        """The call a block's inside spells (``{"name", "arguments"}``), or None when it spells none."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
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
    end. Text that may start a call (a prefix of ``syntax.start``) and whitespace that may precede one are held
    back until the next piece says what they are."""

    syntax: ToolSyntax
    calls: int = 0  # calls found so far
    _buffer: str = ""  # text not yet said: a possible start, or a call's inside
    _inside: bool = False  # the buffer is a call's inside (after its start)
    _space: str = ""  # whitespace held back after content: said only when more content follows
    _fresh: bool = True  # at the answer's start or just after a call: leading whitespace is dropped
    _found: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) this piece completes."""
        self._buffer += text
        out: list[str] = []
        while True:
            if self._inside:
                end = self._buffer.find(self.syntax.end)
                if end < 0:
                    break
                self._block(self._buffer[:end], out, closed=True)
                self._buffer = self._buffer[end + len(self.syntax.end):]
                continue
            start = self._buffer.find(self.syntax.start)
            if start < 0:
                keep = _partial_suffix(self._buffer, self.syntax.start)
                self._text(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._text(self._buffer[:start], out)  # the whitespace before it is held: dropped if it is a call
            self._inside = True
            self._buffer = self._buffer[start + len(self.syntax.start):]
        return self._said(out)

    def close(self) -> tuple[str, list[ToolCall]]:
        """(content, calls) left at the answer's end: an unclosed last call that parses is a call."""
        out: list[str] = []
        if self._inside:
            self._inside = False
            self._block(self._buffer, out, closed=False)
        else:
            self._text(self._buffer, out)
        self._buffer, self._space = "", ""
        return self._said(out)

    def _said(self, out: list[str]) -> tuple[str, list[ToolCall]]:
        found, self._found = self._found, []
        return "".join(out), found

    def _block(self, body: str, out: list[str], *, closed: bool) -> None:
        call = self.syntax.call(body.strip())
        if call is None:  # not a call: the block is text, as written
            self._inside = False
            self._text(self.syntax.start + body + (self.syntax.end if closed else ""), out)
            return
        self._inside, self._fresh, self._space = False, True, ""
        self.calls += 1
        self._found.append(call)

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
