"""The OpenAI-compatible HTTP API over an :class:`~attnkit.serve.engine.Engine` (extra ``serve``: FastAPI, uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus text) and ``GET /`` (the chat page).
Requests are checked here, field by field, and refused with OpenAI's error
shape ``{"error": {"message", "type", "param", "code"}}``; the engine thread
only ever sees valid requests. Streaming is server-sent events as OpenAI
sends them: ``data: {chunk}`` lines with one id and one ``created``, a last
chunk with ``finish_reason``, a usage chunk when asked, then ``data: [DONE]``.
A client that goes away has its request cancelled at the engine's next step.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from importlib import resources
from typing import Any

from attnkit._optional import require

from .engine import Engine, EngineError, Event, QueueFullError, SamplingParams

try:  # FastAPI reads the routes' annotations: the request class must be importable by name
    from starlette.requests import Request
except ImportError:  # the extra ``serve`` is missing: create_app() says so
    Request = Any  # type: ignore[misc,assignment]

MAX_BODY = 1 << 20  # bytes of JSON a request may send
MAX_STOPS = 4

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "n", "user", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
           "logit_bias", "metadata", "store", "service_tier", "parallel_tool_calls", "tools", "tool_choice",
           "response_format", "echo", "suffix", "best_of", "prompt", "messages"}


class APIError(Exception):
    """A request the API refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {json.dumps(value)}")
    if value < low or (high is not None and value > high):
        raise _bad(name, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, f"expected a number, got {json.dumps(value)}")
    return float(value)


def _stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "expected a non-empty string or a list of them")
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    return tuple(stops)


def _unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - _COMMON)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    if body.get("n", 1) != 1:
        raise _bad("n", f"only n=1 is supported, got {json.dumps(body.get('n'))}")
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name, 0) not in (0, 0.0, None):
            raise _bad(name, "is not supported (only 0)")
    for name in ("logprobs", "tools", "logit_bias", "echo", "suffix", "top_logprobs", "response_format"):
        if body.get(name) not in (None, False, [], {}, ""):
            raise _bad(name, "is not supported by this server")
    if body.get("best_of", 1) not in (1, None):
        raise _bad("best_of", "only 1 is supported")


@dataclass(frozen=True)
class Parsed:
    """A checked request: prompt ids, sampling options, streaming and usage flags."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool


class Server:
    """The routes' state: the engine, the tokenizer, the model's name and the API key."""

    def __init__(self, engine: Engine, tokenizer: Any, *, model_name: str, api_key: str | None = None,
                 context_length: int) -> None:
        self.engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.context_length = context_length
        self.started = int(time.time())

    # -- checking a request ------------------------------------------------------------------------------------

    def _params(self, body: Mapping[str, Any], prompt_len: int) -> SamplingParams:
        _unsupported(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise _bad("model", f"expected the model's name, got {json.dumps(model)}")
        if model != self.model_name:
            raise APIError(404, f"The model '{model}' does not exist; this server has '{self.model_name}'",
                           param="model", code="model_not_found")
        room = self.context_length - prompt_len
        if room < 1:
            raise _bad("messages" if "messages" in body else "prompt",
                       f"the prompt has {prompt_len} tokens: no room left in the context window of "
                       f"{self.context_length}")
        limit = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
        room = min(room, self.engine.capacity - prompt_len)  # what the KV memory can hold besides the prompt
        if room < 1:
            raise _bad("messages" if "messages" in body else "prompt",
                       f"the prompt has {prompt_len} tokens, more than this server's KV memory holds "
                       f"({self.engine.capacity} positions)")
        if limit is not None and limit > room:
            name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise _bad(name, f"{limit} new tokens do not fit: the prompt has {prompt_len} tokens, the context "
                             f"window is {self.context_length} and the KV memory {self.engine.capacity} positions; "
                             f"ask for at most {room}")
        temperature = _number(body, "temperature")
        if temperature is not None and temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {temperature}")
        top_p = _number(body, "top_p")
        if top_p is not None and not 0 < top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {top_p}")
        seed = _int(body, "seed", -(2**63), 2**63 - 1)
        return SamplingParams(max_tokens=min(limit or room, room), temperature=1.0 if temperature is None else
                              temperature, top_p=top_p, seed=None if seed is None else seed % 2**62,
                              stop=_stops(body))

    def _flags(self, body: Mapping[str, Any]) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise _bad("stream", f"expected a boolean, got {json.dumps(stream)}")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not isinstance(
                options.get("include_usage", False), bool)):
            raise _bad("stream_options", "expected {\"include_usage\": true|false}")
        if options is not None and not stream:
            raise _bad("stream_options", "is only allowed when stream is true")
        return bool(stream), bool(options and options.get("include_usage"))

    def parse_chat(self, body: Mapping[str, Any]) -> Parsed:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _bad("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
        plain = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "expected an object with a string 'role'")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise _bad(f"messages[{i}].role", f"unknown role {m['role']!r}; expected system, user or assistant")
            content = m.get("content")
            if isinstance(content, list):  # OpenAI's content parts: text only
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise _bad(f"messages[{i}].content", f"expected a string, got {json.dumps(content)}")
            plain.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
        try:
            prompt = self.tokenizer.chat_ids(plain)  # content is plain text: no control tokens from it
        except ValueError as err:
            raise _bad("messages", str(err)) from err
        stream, usage = self._flags(body)
        return Parsed(prompt, self._params(body, len(prompt)), stream, usage)

    def parse_completion(self, body: Mapping[str, Any]) -> Parsed:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt", "expected a non-empty string")
        try:
            ids = self.tokenizer.encode(prompt)
        except ValueError as err:
            raise _bad("prompt", str(err)) from err
        stream, usage = self._flags(body)
        return Parsed(ids, self._params(body, len(ids)), stream, usage)

    # -- running it --------------------------------------------------------------------------------------------

    def submit(self, parsed: Parsed) -> tuple[Any, asyncio.Queue[Event]]:
        """Queue a checked request; its events arrive on the returned asyncio queue."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def on_event(event: Event) -> None:  # called in the engine thread
            loop.call_soon_threadsafe(queue.put_nowait, event)

        try:
            seq = self.engine.submit(parsed.prompt, parsed.params, on_event)
        except QueueFullError as err:
            raise APIError(429, f"The server is busy ({err}); retry later", code="rate_limit_exceeded",
                           kind="rate_limit_error", headers={"Retry-After": "1"}) from err
        except EngineError as err:
            raise APIError(503, str(err), kind="server_error", code="engine_error") from err
        except ValueError as err:
            raise _bad("messages" if parsed.prompt else "prompt", str(err)) from err
        return seq, queue


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _collect(server: Server, parsed: Parsed, is_disconnected: Callable[[], Any]
                   ) -> tuple[str, str, int]:
    """Run a request to its end: (text, finish_reason, completion tokens); cancelled if the client leaves."""
    seq, queue = server.submit(parsed)
    text, tokens = [], 0
    try:
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await is_disconnected():
                    server.engine.cancel(seq)
                    raise asyncio.CancelledError from None
                continue
            text.append(event.text)
            tokens += len(event.token_ids)
            if event.error:
                raise APIError(500, event.error, kind="server_error", code="engine_error")
            if event.finish_reason:
                return "".join(text), event.finish_reason, tokens
    except BaseException:
        server.engine.cancel(seq)
        raise


def _stream(server: Server, parsed: Parsed, make_chunk: Callable[[str, str | None, bool], dict[str, Any]],
            usage_chunk: Callable[[dict[str, int]], dict[str, Any]]) -> AsyncIterator[str]:
    """Submit now (a refusal is still an HTTP error), then stream the request's server-sent events."""
    seq, queue = server.submit(parsed)
    return _events(server, parsed, seq, queue, make_chunk, usage_chunk)


async def _events(server: Server, parsed: Parsed, seq: Any, queue: asyncio.Queue[Event],
                  make_chunk: Callable[[str, str | None, bool], dict[str, Any]],
                  usage_chunk: Callable[[dict[str, int]], dict[str, Any]]) -> AsyncIterator[str]:
    """Server-sent events of one request; the engine cancels it if the client goes away (GeneratorExit)."""
    tokens = 0
    try:
        yield _sse(make_chunk("", None, True))
        while True:
            event = await queue.get()
            tokens += len(event.token_ids)
            if event.error:
                yield _sse({"error": {"message": event.error, "type": "server_error", "param": None,
                                      "code": "engine_error"}})
                break
            if event.text:
                yield _sse(make_chunk(event.text, None, False))
            if event.finish_reason:
                reason = "length" if event.finish_reason == "length" else "stop"
                yield _sse(make_chunk("", reason, False))
                if parsed.include_usage:
                    yield _sse(usage_chunk(_usage(len(parsed.prompt), tokens)))
                break
        yield "data: [DONE]\n\n"
    finally:
        server.engine.cancel(seq)  # a no-op once it finished; frees its blocks if the client left


def _prometheus(metrics: Mapping[str, float]) -> str:
    lines = []
    for name, value in metrics.items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# TYPE attnkit_{name} {kind}", f"attnkit_{name} {value}"]
    return "\n".join(lines) + "\n"


def create_app(server: Server) -> Any:
    """The FastAPI application of :class:`Server`."""
    fastapi = require("fastapi", "attnkit serve")
    responses = require("fastapi.responses", "attnkit serve")
    app = fastapi.FastAPI(title="attnkit", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Any, err: APIError) -> Any:
        return responses.JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        open_paths = ("/health", "/")
        if server.api_key is not None and request.url.path not in open_paths:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {server.api_key}"):
                err = APIError(401, "Incorrect API key provided", code="invalid_api_key")
                return responses.JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    async def read_json(request: Request) -> dict[str, Any]:
        body = await request.body()
        if len(body) > MAX_BODY:
            raise APIError(413, f"the request body has {len(body)} bytes, more than {MAX_BODY}", code="too_large")
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as err:
            raise APIError(400, f"the body is not valid JSON: {err}", code="invalid_json") from err
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object", code="invalid_json")
        if not server.engine.alive:
            raise APIError(503, f"the engine stopped: {server.engine.error!r}", kind="server_error",
                           code="engine_error")
        return data

    def ids(prefix: str) -> tuple[str, int]:
        return f"{prefix}-{secrets.token_hex(12)}", int(time.time())

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        parsed = server.parse_chat(await read_json(request))
        rid, created = ids("chatcmpl")
        base = {"id": rid, "created": created, "model": server.model_name, "system_fingerprint": None}
        if parsed.stream:
            def chunk(text: str, reason: str | None, first: bool) -> dict[str, Any]:
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                out = {**base, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, int]) -> dict[str, Any]:
                return {**base, "object": "chat.completion.chunk", "choices": [], "usage": u}

            return responses.StreamingResponse(_stream(server, parsed, chunk, usage), media_type="text/event-stream")
        text, reason, n = await _collect(server, parsed, request.is_disconnected)
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                             "logprobs": None, "finish_reason": "length" if reason == "length" else "stop"}],
                "usage": _usage(len(parsed.prompt), n)}

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        parsed = server.parse_completion(await read_json(request))
        rid, created = ids("cmpl")
        base = {"id": rid, "created": created, "model": server.model_name, "system_fingerprint": None}
        if parsed.stream:
            def chunk(text: str, reason: str | None, first: bool) -> dict[str, Any]:
                out = {**base, "object": "text_completion",
                       "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, int]) -> dict[str, Any]:
                return {**base, "object": "text_completion", "choices": [], "usage": u}

            return responses.StreamingResponse(_stream(server, parsed, chunk, usage), media_type="text/event-stream")
        text, reason, n = await _collect(server, parsed, request.is_disconnected)
        return {**base, "object": "text_completion",
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": "length" if reason == "length" else "stop"}],
                "usage": _usage(len(parsed.prompt), n)}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.started,
                                            "owned_by": "attnkit"}]}

    @app.get("/health")
    async def health() -> Any:
        if not server.engine.alive:
            return responses.JSONResponse({"status": "error", "error": repr(server.engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        return responses.PlainTextResponse(_prometheus(server.engine.metrics()))

    @app.get("/")
    async def page() -> Any:
        html = resources.files("attnkit.serve").joinpath("chat.html").read_text(encoding="utf-8")
        return responses.HTMLResponse(html.replace("__MODEL__", server.model_name))

    return app
