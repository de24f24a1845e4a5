"""A request's results shaped in OpenAI's format: whole answers, and server-sent event streams.

Usage (``cached_tokens`` from the prefix cache), logprobs as the chat API and the completions API each give them,
an answer's assistant message with its tool calls parsed out, a stream's deltas (each tool call whole in one), and
the two ways a request runs to its end: :func:`collect` (every choice's :class:`Answer`, cancelled if the client
goes away) and :func:`stream_events` (``data: {chunk}`` lines, a usage chunk when asked, ``data: [DONE]``). The
routes (:mod:`attnkit.serve.api`) build each chunk's body; the request was parsed and is submitted by
:class:`attnkit.serve.parsing.Server`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from .checks import APIError
from .engine import Engine, Event
from .events import Choice
from .parsing import Parsed, Server
from .tools import CallStream, call_id


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage: ``cached`` of the prompt's tokens came from the prefix cache (not computed again); the
    completion counts every token sampled, a stop id included, as the engine's metrics do.

    With n choices the prompt counts once, as OpenAI counts it, and so does ``cached``: the first choice's hits, what
    the cache held before the request. The other choices share the first one's blocks (the one prefill); counting
    those as hits would report more cached tokens than the prompt has."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def chat_token_logprobs(server: Server, choices: list[Choice]) -> dict[str, Any]:
    """The chat API's logprobs of these tokens: each token's text, log-probability and UTF-8 bytes, with its
    top alternatives'."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = server.engine.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]}
                        for c in choices], "refusal": None}


def completion_token_logprobs(server: Server, choices: list[Choice], offset: int) -> dict[str, Any]:
    """The completions API's logprobs: tokens, their log-probabilities, {token: logprob} of the top
    alternatives, and where each token's text starts in the answer (from ``offset``)."""
    tokens = [server.engine.decode([c.token]) for c in choices]
    return {"tokens": tokens, "token_logprobs": [c.logprob for c in choices],
            "top_logprobs": [{server.engine.decode([t]): lp for t, lp in c.top} for c in choices],
            "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=offset))}


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _cancel_when_gone(engine: Engine, seqs: list[Any], receive: Callable[[], Any]) -> None:
    """Cancel ``seqs`` in the engine once their client has gone (ASGI's ``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    for seq in seqs:
        engine.cancel(seq)


@dataclass
class Answer:
    """One choice's answer: its text, finish reason and the logprobs of its text's tokens."""

    text: str = ""
    finish_reason: str | None = None
    logprobs: list[Choice] = field(default_factory=list)


async def collect(server: Server, parsed: Parsed, receive: Callable[[], Any]
                   ) -> tuple[list[Answer], dict[str, Any]]:
    """Run a request's choices to their end: (an :class:`Answer` per choice, usage).

    Meanwhile a watcher awaits the client's disconnect (``receive``: the request's ASGI receive), however
    often events arrive; if it comes, the engine cancels the request at its next step, freeing its blocks,
    and this raises a 499 that nobody reads but the access log.
    """
    seqs, queue = server.submit(parsed)
    watcher = asyncio.ensure_future(_cancel_when_gone(server.engine, seqs, receive))
    answers, tokens = [Answer() for _ in seqs], 0
    try:
        while any(a.finish_reason is None for a in answers):
            index, event = await queue.get()
            answer = answers[index]
            answer.text += event.text
            answer.logprobs += event.logprobs
            tokens += len(event.token_ids)
            if event.error:
                raise APIError(500, event.error, kind="server_error", code="engine_error")
            if event.finish_reason == "cancelled":
                raise APIError(499, "the client closed the request before its answer was complete",
                               code="client_closed_request")
            answer.finish_reason = event.finish_reason
        return answers, _usage(len(parsed.prompt), tokens, seqs[0].cached_tokens)
    finally:
        watcher.cancel()
        for seq in seqs:
            server.engine.cancel(seq)  # a no-op once it finished


def chat_message(parsed: Parsed, answer: Answer) -> tuple[dict[str, Any], str]:
    """A choice's answer as OpenAI's assistant message and finish reason; with tools offered, its calls parsed out
    into ``tool_calls`` (finish_reason "tool_calls" when it made one and was not cut short)."""
    reason = "length" if answer.finish_reason == "length" else "stop"
    if parsed.tools is None:
        return {"role": "assistant", "content": answer.text, "refusal": None}, reason
    content, calls = parsed.tools.parse(answer.text)
    if not calls:
        return {"role": "assistant", "content": content or "", "refusal": None}, reason
    return ({"role": "assistant", "content": content, "refusal": None,
             "tool_calls": [call.openai(call_id()) for call in calls]}, "tool_calls" if reason == "stop" else reason)


def chat_delta(streams: list[CallStream] | None, index: int, text: str, end: bool) -> dict[str, Any]:
    """A streamed chunk's delta: the text as content; with tools offered (``streams``, one per choice), the content
    and the calls this piece completes, each call whole in one delta (id, name and arguments at once) with its
    index among the choice's calls. ``end``: the choice's last chunk, which says what was held back."""
    if streams is None:
        return {"content": text} if text else {}
    stream = streams[index]
    first = stream.calls
    content, calls = stream.feed(text)
    if end:
        rest, more = stream.close()
        content, calls = content + rest, calls + more
    delta: dict[str, Any] = {"content": content} if content else {}
    if calls:
        delta["tool_calls"] = [{"index": first + k, **call.openai(call_id())} for k, call in enumerate(calls)]
    return delta


Chunk = Callable[[int, str, str | None, bool, list[Choice]], dict[str, Any]]  # (index, text, reason, first, lps)


def _empty(chunk: dict[str, Any]) -> bool:
    """Whether a chunk carries nothing: no delta (chat) or text (completion), no logprobs, no finish reason."""
    return all(not choice.get("delta", choice.get("text")) and choice.get("logprobs") is None
               and choice.get("finish_reason") is None for choice in chunk["choices"])


def stream_events(server: Server, parsed: Parsed, make_chunk: Chunk,
                  usage_chunk: Callable[[dict[str, Any]], dict[str, Any]], state: Any) -> AsyncIterator[str]:
    """Submit now (a refusal is still an HTTP error), then stream the request's server-sent events; ``state``
    (the request's) gets the usage at the end, for the access log."""
    seqs, queue = server.submit(parsed)
    return _events(server, parsed, seqs, queue, make_chunk, usage_chunk, state)


async def _events(server: Server, parsed: Parsed, seqs: list[Any], queue: asyncio.Queue[tuple[int, Event]],
                  make_chunk: Chunk, usage_chunk: Callable[[dict[str, Any]], dict[str, Any]],
                  state: Any) -> AsyncIterator[str]:
    """Server-sent events of a request's choices, each chunk naming its choice's index; the engine cancels
    every choice if the client goes away (GeneratorExit)."""
    tokens, running = 0, set(range(len(seqs)))
    try:
        for i in range(len(seqs)):
            yield _sse(make_chunk(i, "", None, True, []))
        while running:
            index, event = await queue.get()
            tokens += len(event.token_ids)
            if event.error:
                yield _sse({"error": {"message": event.error, "type": "server_error", "param": None,
                                      "code": "engine_error"}})
                break
            if event.text or event.logprobs:
                chunk = make_chunk(index, event.text, None, False, event.logprobs)
                if not _empty(chunk):  # text a tool call holds back says nothing yet
                    yield _sse(chunk)
            if event.finish_reason:
                running.discard(index)
                yield _sse(make_chunk(index, "", "length" if event.finish_reason == "length" else "stop", False, []))
        if not running and parsed.include_usage:
            yield _sse(usage_chunk(_usage(len(parsed.prompt), tokens, seqs[0].cached_tokens)))
        yield "data: [DONE]\n\n"
    finally:
        state.usage = _usage(len(parsed.prompt), tokens, seqs[0].cached_tokens)
        for seq in seqs:
            server.engine.cancel(seq)  # a no-op once it finished; frees its blocks if the client left

