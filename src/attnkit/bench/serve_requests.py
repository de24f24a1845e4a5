"""The serve suite's request rows: one request asking for ``n = 4`` choices and one constrained by a JSON schema
(``response_format: {"type": "json_schema", ...}``), each beside plain sampling of the same prompt on the same
server, in the same run.

One client at a time sends the same chat (the suite's system prompt, a story asked for as JSON, up to
:data:`MAX_TOKENS` new tokens per choice, temperature 0.7, seed 0) as each of :data:`REQUESTS`: plain, with
``n: 4``, with the schema :data:`SCHEMA`. After one untimed round, ``repeats`` rounds run the three one after
another, so a round's requests meet the same machine. A row's ``tokens_per_s`` is the median over the rounds of
a request's completion tokens (all its choices) over its wall time, prefill included; ``decode_tokens_per_s``
the tokens after each choice's first over the time after the first chunk (answers of other lengths weigh
their prefill alike). ``vs_plain`` and ``decode_vs_plain``: the median over the rounds of each over the plain
request's of the same round, a ratio of one run, as the machines are shared and noisy. The schema row also
counts the answers that parse and carry the schema's keys (its story is 100 to 300 characters: an answer that
ends within :data:`MAX_TOKENS`; 128 cut some).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .serve_client import SYSTEM, ServerProcess, Stream, post_stream

Row = dict[str, Any]
MAX_TOKENS = 192
SCHEMA: dict[str, Any] = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                                           "story": {"type": "string", "minLength": 100,
                                                                     "maxLength": 300}},
                          "required": ["title", "story"], "additionalProperties": False}
REQUESTS: dict[str, dict[str, Any]] = {  # name -> the fields a request adds to the plain one
    "plain": {},
    "n=4": {"n": 4},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}}},
}


def request_body(name: str, model: str) -> dict[str, Any]:
    """The chat request ``name`` of :data:`REQUESTS`: the plain one with its fields added."""
    question = 'Write a story about a lighthouse, as JSON with a "title" and a "story".'
    return {"model": model, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": 0, "stream": True,
            "stream_options": {"include_usage": True}, **REQUESTS[name]}


def _follows_schema(text: str) -> bool:
    try:
        answer = json.loads(text)
    except ValueError:
        return False
    return isinstance(answer, dict) and set(answer) == set(SCHEMA["required"])


def request_rows(url: str, model: str, repeats: int,
                 post: Callable[[str, dict[str, Any]], Stream] = post_stream) -> list[Row]:
    """A row per request of :data:`REQUESTS` (see the module docstring); ``post(url, body)`` streams one
    request."""
    if repeats < 1:
        raise ValueError(f"the serve suite's request rows need repeats >= 1, got {repeats}")
    for name in REQUESTS:
        post(url, request_body(name, model))  # warm-up: the schema compiled, the prompt's blocks cached
    rounds = [{name: post(url, request_body(name, model)) for name in REQUESTS} for _ in range(repeats)]
    def rates(name: str) -> tuple[list[float], list[float]]:
        """Each round's tokens/s of request ``name``: over its wall time, and after its first chunk."""
        choices = REQUESTS[name].get("n", 1)
        streams = [r[name] for r in rounds]
        return ([s.tokens / s.seconds for s in streams],
                [(s.tokens - choices) / (s.end - s.chunks[0]) if s.chunks else math.nan for s in streams])

    plain, plain_decode = rates("plain")
    rows = []
    for name in REQUESTS:
        streams = [r[name] for r in rounds]
        wall, decode = rates(name)
        row: Row = {"kind": "request", "request": name, "choices": REQUESTS[name].get("n", 1), "rounds": repeats,
                    "output_tokens": statistics.median(s.tokens for s in streams),
                    "seconds": statistics.median(s.seconds for s in streams), "tokens_per_s": statistics.median(wall),
                    "vs_plain": statistics.median(a / b for a, b in zip(wall, plain, strict=True)),
                    "decode_tokens_per_s": statistics.median(decode),
                    "decode_vs_plain": statistics.median(a / b for a, b in zip(decode, plain_decode, strict=True)),
                    "ttft_ms": statistics.median(s.ttft * 1e3 for s in streams)}
        if name == "json_schema":
            answers = [text for s in streams for text in s.texts.values()]
            row["follows_schema"] = f"{sum(map(_follows_schema, answers))}/{len(answers)}"
        rows.append(row)
    return rows


def request_server_rows(work: Path, threads: int, per_position: int, repeats: int) -> list[Row]:
    """:func:`request_rows` against a fresh ``attnkit serve`` (4 sequences at once: the n = 4 request's choices)."""
    positions = 288  # per sequence: ~90 prompt tokens + up to MAX_TOKENS new, rounded up to blocks
    server = ServerProcess.attnkit("--max-batch", "4", "--kv-memory", str(4 * positions * per_position / 2**20 + 8),
                                   log=work / "attnkit-requests.log", threads=threads)
    try:
        return request_rows(server.url, "smollm2", repeats)
    finally:
        server.stop()
