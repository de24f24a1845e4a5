"""Rendering a model file's chat template: jinja2's sandbox, bounded in time, memory and output.

A chat template comes from the model file, which is data from elsewhere. It is
rendered as Hugging Face's ``apply_chat_template`` renders it (jinja2's
immutable sandbox, ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, its
``tojson`` filter: keys in their order, text not escaped; ``tools`` for a
template that offers tools), and within bounds: a template that runs longer than ``seconds``, grows the process
by more than ``memory`` bytes, writes more than ``output`` characters, or
builds a huge string or number in one operation stops with a
:class:`TemplateLimitError` that names the template. jinja2 >= 3.1.6 is
required (3.1.5's sandbox can be escaped through ``|attr('format')``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from attnkit._optional import require

SECONDS = 2.0
OUTPUT = 1 << 20  # characters a rendered prompt may have
MEMORY = 256 << 20  # bytes the process may grow by while rendering


class TemplateLimitError(ValueError):
    """A chat template went past a bound (time, memory or size)."""


def _rss() -> int:
    """Resident memory of this process in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096
    except (OSError, ValueError, IndexError):
        return 0


def _sandbox(name: str, output: int) -> Any:
    sandbox = require("jinja2.sandbox", "Chat templates")

    class Bounded(sandbox.ImmutableSandboxedEnvironment):  # type: ignore[name-defined]
        """The immutable sandbox, with ``*``, ``**`` and ``+`` refused when their result would be huge."""

        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            size = _result_size(operator, left, right)
            if size > output:
                raise TemplateLimitError(f"{name}: `{operator}` would build a value of about {size:,} elements or "
                                         f"digits, more than the limit of {output:,}")
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson`` filter: ``json.dumps`` with the keys in their order and no HTML escaping (jinja2's
    own sorts the keys and writes ``<`` as ``\\u003c``, so a tool's schema would not read as the model saw it)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _result_size(operator: str, left: Any, right: Any) -> int:
    sized = (str, list, tuple)
    if operator == "*":
        if isinstance(left, sized) and isinstance(right, int):
            return len(left) * right
        if isinstance(right, sized) and isinstance(left, int):
            return len(right) * left
    if operator == "+" and isinstance(left, sized) and isinstance(right, sized):
        return len(left) + len(right)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return int(max(abs(left), 2).bit_length() * right * 0.302)  # decimal digits of the result
    return 0


def check_parses(template: str, name: str = "the chat template") -> None:
    """A ValueError naming ``template`` (as ``name``) when jinja2 cannot parse it: before a model is loaded."""
    jinja2 = require("jinja2", "Chat templates")
    try:
        _sandbox(name, OUTPUT).parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{name} does not parse: {err.message} (line {err.lineno})") from None


def reads(template: str, variable: str) -> bool:
    """Whether ``template`` reads the variable ``variable`` from its caller (such as ``tools``: a template that
    offers tools to the model); False for a template that does not parse."""
    jinja2 = require("jinja2", "Chat templates")
    meta = require("jinja2.meta", "Chat templates")
    try:
        parsed = _sandbox("the chat template", OUTPUT).parse(template)
    except jinja2.TemplateSyntaxError:
        return False
    return variable in meta.find_undeclared_variables(parsed)


def render(template: str, messages: Sequence[Mapping[str, Any]], *, name: str = "the chat template",
           add_generation_prompt: bool = True, seconds: float = SECONDS, output: int = OUTPUT,
           memory: int = MEMORY, variables: Mapping[str, Any] | None = None) -> str:
    """``template`` rendered for ``messages`` (and ``variables`` such as ``bos_token``).

    :class:`TemplateLimitError` past a bound; ValueError for a template that
    does not parse or calls ``raise_exception``.
    """
    jinja2 = require("jinja2", "Chat templates")
    env = _sandbox(name, output)

    def raise_exception(message: str) -> None:
        raise ValueError(f"{name} refused these messages: {message}")

    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{name} does not parse: {err.message} (line {err.lineno})") from None
    context = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt,
               **(variables or {})}
    pieces: list[str] = []
    written = 0
    with _bounded(name, seconds, memory):
        for piece in compiled.generate(**context):
            written += len(piece)
            if written > output:
                raise TemplateLimitError(f"{name} wrote more than {output:,} characters")
            pieces.append(piece)
    return "".join(pieces)


class _bounded:
    """While active, a trace function stops the render past a deadline or a memory growth."""

    def __init__(self, name: str, seconds: float, memory: int) -> None:
        self.name, self.seconds, self.memory = name, seconds, memory
        self.count = 0

    def _trace(self, frame: Any, event: str, arg: Any) -> Any:
        self.count += 1
        if self.count % 512 == 0:
            if time.monotonic() > self.deadline:
                raise TemplateLimitError(f"{self.name} ran longer than {self.seconds:g} s")
            if self.count % 8192 == 0 and _rss() - self.start_rss > self.memory:
                raise TemplateLimitError(f"{self.name} grew the process by more than {self.memory >> 20} MiB")
        return self._trace

    def __enter__(self) -> None:
        self.deadline, self.start_rss = time.monotonic() + self.seconds, _rss()
        self.previous = sys.gettrace()
        sys.settrace(self._trace)

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.previous)
