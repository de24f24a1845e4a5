"""The OpenAI-compatible HTTP API over an :class:`~attnkit.serve.engine.Engine` (extra ``serve``: FastAPI, uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings`` (with an
:class:`~attnkit.serve.embeddings.Embedder`; a server may serve embeddings alone), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /`` (the chat page) and ``GET /favicon.ico`` (204: there is none). Requests
are checked here, field by field (:mod:`attnkit.serve.checks`), and refused with OpenAI's error shape
``{"error": {"message", "type", "param", "code"}}`` (an unknown route or method
too); the engine thread only ever sees valid requests. Streaming is server-sent
events as OpenAI sends them: ``data: {chunk}`` lines with one id and one
``created``, a last chunk with ``finish_reason``, a usage chunk when asked, then
``data: [DONE]``. ``response_format`` json_object / json_schema constrains the answer to the schema
(:class:`~attnkit.serve.grammar.JSONSchemas`, each choice its own constraint); a schema the grammar cannot
honour is a 400 naming what it refuses. ``tools`` are offered to the model through its chat template, and its
answers' calls (in the syntax the template teaches: :mod:`attnkit.serve.tools`) come back as ``tool_calls``
(finish_reason "tool_calls"; streamed, each call whole in one delta); ``tool_choice`` "required" or a named
function decodes under a grammar whose every answer is one call, "none" offers no tools. ``logit_bias`` is added
to the logits before anything else. ``/v1/responses`` answers a 404 that says to use /v1/chat/completions.
A client that goes away has its request cancelled at the
engine's next step, streamed or not. Browsers on other origins are answered
(CORS, preflights before the API key is checked), and every request leaves one
line on the ``attnkit.serve.access`` logger (:class:`AccessLog`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from html import escape
from importlib import resources
from typing import TYPE_CHECKING, Any

from attnkit._optional import require
from attnkit.models.generation_options import GenerationOptions

from .checks import (
    APIError,
    bad,
    chat_logprobs,
    chat_messages,
    choices,
    chosen_tool,
    completion_logprobs,
    embeddings_only,
    integer,
    logit_bias,
    no_such_model,
    offered_tools,
    penalties,
    refuse_other_endpoints_field,
    refuse_unsupported,
    response_format,
    route_error,
    sampling,
    stops,
    too_long,
)
from .engine import Engine, EngineError, Event, QueueFullError
from .grammar import JSONSchemas
from .runner import Choice
from .tools import CallStream, ToolSyntax, call_id, template_syntax

if TYPE_CHECKING:
    from .embeddings import Embedder

try:  # FastAPI reads the routes' annotations: the request class must be importable by name
    from starlette.requests import Request
except ImportError:  # the extra ``serve`` is missing: create_app() says so
    Request = Any  # type: ignore[misc,assignment]

MAX_BODY = 1 << 20  # bytes of JSON a request may send
ACCESS_LOG = logging.getLogger("attnkit.serve.access")  # attnkit serve prints it on stderr (not with --no-access-log)


@dataclass(frozen=True)
class Parsed:
    """A checked request: prompt ids, sampling options, streaming and usage flags, and the prompt's field."""

    prompt: list[int]
    params: GenerationOptions
    stream: bool
    include_usage: bool
    source: str  # the request field the prompt came from: "messages" or "prompt"
    n: int = 1  # answers sampled from the prompt
    grammar: str | None = None  # the compiled grammar every answer follows (response_format, a forced call), or None
    tools: ToolSyntax | None = None  # the syntax the answers' tool calls are parsed in; None: plain text


class Server:
    """The routes' state: the engine, the tokenizer, the model's name and the API key.

    ``aliases``: more names the model answers to (a client configured with another model id); responses and
    the chat page name it ``model_name``. ``embedder``: serves ``/v1/embeddings`` under its own name, beside
    the engine's model; with no engine (``engine=None``, ``tokenizer=None``) the server serves embeddings
    alone, the embedder answering to ``model_name`` and the aliases, and the text routes answer a 404 saying so.
    ``schemas``: compiles ``response_format``'s JSON Schemas; by default built from the tokenizer on the first
    request that asks for one.
    """

    def __init__(self, engine: Engine | None, tokenizer: Any, *, model_name: str, aliases: Sequence[str] = (),
                 api_key: str | None = None, context_length: int, embedder: Embedder | None = None,
                 schemas: JSONSchemas | None = None) -> None:
        if engine is None and embedder is None:
            raise ValueError("a server needs an engine, an embedder or both")
        self._engine, self.tokenizer, self.model_name, self.api_key = engine, tokenizer, model_name, api_key
        self.names = tuple(dict.fromkeys((model_name, *aliases)))  # every name served, the model's first
        self.embedder = embedder
        self.embedding_names = () if embedder is None else self.names if engine is None else (embedder.name,)
        self.context_length = context_length
        self.started = int(time.time())
        self._schemas = schemas

    @property
    def _schemas_built(self) -> JSONSchemas:
        assert self._schemas is not None, "a request with a grammar was parsed, which builds the schemas"
        return self._schemas

    @property
    def serves_text(self) -> bool:
        """Whether a decoder serves chat and completions (not a server of embeddings alone)."""
        return self._engine is not None

    @property
    def engine(self) -> Engine:
        """The decoder's engine; a server of embeddings alone refuses the routes that need it (404)."""
        return self._decoder("chat and completions")

    def _decoder(self, route: str) -> Engine:
        if self._engine is None:
            raise embeddings_only(route, self.names)
        return self._engine

    def _grammar(self, body: Mapping[str, Any]) -> str | None:
        """``response_format``'s schema compiled, or None for plain text; a 400 naming what cannot be honoured."""
        schema = response_format(body)
        if schema is None:
            return None
        try:
            return self._schemas_for("response_format", "{\"type\": \"text\"}").compile(schema)
        except ValueError as err:
            raise bad("response_format", f"json_schema.schema is not supported: {err}") from err

    def _schemas_for(self, param: str, instead: str) -> JSONSchemas:
        """The grammar compiler, built on first use; a 400 naming ``param`` (only ``instead`` is served) for a
        tokenizer that cannot constrain answers."""
        if self._schemas is None:
            try:
                self._schemas = JSONSchemas(self.tokenizer, vocab_size=self.engine.model.vocab_size)
            except AttributeError as err:  # a stand-in tokenizer without a token table
                raise bad(param, f"this model's tokenizer cannot constrain its answers ({err}); only {instead} is "
                                 "served") from err
        return self._schemas

    def _tools(self, body: Mapping[str, Any]) -> tuple[list[dict[str, Any]] | None, ToolSyntax | None, str | None]:
        """(the tools the template offers, the syntax the answers' calls are parsed in, the grammar a forced call
        decodes under): all None without tools or with tool_choice "none" (no tool is offered, none can be
        called). A template without tool support is a 400 naming ``tools``."""
        offered = offered_tools(body)
        mode, name = chosen_tool(body, offered)
        if offered is None or mode == "none":
            return None, None, None
        try:
            syntax = template_syntax(getattr(self.tokenizer, "chat_template", None))
        except ValueError as err:
            raise bad("tools", str(err)) from None
        if mode == "auto":
            return offered, syntax, None
        schemas = self._schemas_for("tool_choice", "tool_choice \"auto\"")
        functions = []
        for i, tool in enumerate(offered):
            if mode == "required" or tool["function"]["name"] == name:
                try:
                    schemas.compile(tool["function"]["parameters"])
                except ValueError as err:
                    raise bad(f"tools[{i}].function.parameters", f"cannot constrain a call: {err}") from err
                functions.append(tool["function"])
        try:
            return offered, syntax, schemas.compile_lark(syntax.grammar(functions))
        except ValueError as err:
            raise bad("tool_choice", f"the grammar of a forced call is not supported: {err}") from err

    # -- checking a request ------------------------------------------------------------------------------------

    def _params(self, body: Mapping[str, Any], prompt_len: int, source: str, logprobs: int | None
                ) -> GenerationOptions:
        """The sampling options, with OpenAI's defaults (temperature 1, max_tokens the room left); ``source`` is
        the field the prompt came from ("messages" or "prompt")."""
        refuse_unsupported(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise bad("model", f"expected the model's name, got {json.dumps(model)}")
        if model not in self.names:
            raise no_such_model(model, self.names)
        room = self.context_length - prompt_len
        if room < 1:
            raise too_long(source, f"the prompt has {prompt_len} tokens: no room left in the context window "
                                    f"of {self.context_length}")
        limit = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
        room = min(room, self.engine.capacity - prompt_len)  # what the KV memory can hold besides the prompt
        if room < 1:
            raise too_long(source, f"the prompt has {prompt_len} tokens, more than this server's KV memory "
                                    f"holds ({self.engine.capacity} positions)")
        if limit is not None and limit > room:
            name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise bad(name, f"{limit} new tokens do not fit: the prompt has {prompt_len} tokens, the context "
                             f"window is {self.context_length} and the KV memory {self.engine.capacity} positions; "
                             f"ask for at most {room}")
        temperature, top_p = sampling(body)
        frequency, presence, repetition = penalties(body)
        seed = integer(body, "seed", -(2**63), 2**63 - 1)
        bias, vocab = logit_bias(body), self.engine.model.vocab_size
        outside = next((token for token in bias or () if token >= vocab), None)
        if outside is not None:
            raise bad("logit_bias", f"token id {outside} is outside the vocabulary [0, {vocab})")
        return GenerationOptions(max_new_tokens=min(limit or room, room), temperature=temperature, top_p=top_p,
                                 seed=None if seed is None else seed % 2**62, stop=stops(body), logprobs=logprobs,
                                 frequency_penalty=frequency, presence_penalty=presence,
                                 repetition_penalty=repetition, logit_bias=bias)

    def _flags(self, body: Mapping[str, Any]) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise bad("stream", f"expected a boolean, got {json.dumps(stream)}")
        options = body.get("stream_options")
        if options is not None and (not isinstance(options, dict) or not isinstance(
                options.get("include_usage", False), bool)):
            raise bad("stream_options", "expected {\"include_usage\": true|false}")
        if options is not None and not stream:
            raise bad("stream_options", "is only allowed when stream is true")
        return bool(stream), bool(options and options.get("include_usage"))

    def parse_chat(self, body: Mapping[str, Any]) -> Parsed:
        self._decoder("/v1/chat/completions")
        refuse_other_endpoints_field(body, "prompt", "/v1/completions", "messages")
        plain = chat_messages(body.get("messages"))
        offered, syntax, forced = self._tools(body)
        try:  # content is plain text: no control tokens from it
            prompt = self.tokenizer.chat_ids(plain) if offered is None else self.tokenizer.chat_ids(plain,
                                                                                                     tools=offered)
        except ValueError as err:
            raise bad("messages", str(err)) from err
        stream, usage = self._flags(body)
        options = self._params(body, len(prompt), "messages", chat_logprobs(body))
        grammar = self._grammar(body)
        if forced is not None and grammar is not None:
            raise bad("tool_choice", "forces a tool call, whose answer cannot also follow response_format: give one")
        return Parsed(prompt, options, stream, usage, "messages", choices(body), forced or grammar, syntax)

    def parse_completion(self, body: Mapping[str, Any]) -> Parsed:
        self._decoder("/v1/completions")
        for name in ("messages", "tools", "tool_choice"):
            refuse_other_endpoints_field(body, name, "/v1/chat/completions", "a prompt")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise bad("prompt", "expected a non-empty string")
        try:
            ids = self.tokenizer.encode(prompt)
        except ValueError as err:
            raise bad("prompt", str(err)) from err
        stream, usage = self._flags(body)
        options = self._params(body, len(ids), "prompt", completion_logprobs(body))
        return Parsed(ids, options, stream, usage, "prompt", choices(body), self._grammar(body))

    # -- running it --------------------------------------------------------------------------------------------

    def submit(self, parsed: Parsed) -> tuple[list[Any], asyncio.Queue[tuple[int, Event]]]:
        """Queue a checked request's ``n`` choices (choice i seeded ``seed + i``); their events arrive on the
        returned asyncio queue as (choice index, event). Identical prompts share their prefix's KV blocks, so the
        prompt is prefilled once. With a grammar, each choice follows its own constraint."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        seqs: list[Any] = []
        seed = parsed.params.seed  # an int or None: the API's seed field

        def on_event(index: int) -> Callable[[Event], None]:
            def put(event: Event) -> None:  # called in the engine thread
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))
            return put

        try:
            for i in range(parsed.n):
                options = parsed.params if i == 0 or not isinstance(seed, int) else replace(
                    parsed.params, seed=(seed + i) % 2**62)
                constraint = None if parsed.grammar is None else self._schemas_built.constraint(parsed.grammar)
                seqs.append(self.engine.submit(parsed.prompt, options, on_event(i), constraint))
        except (EngineError, ValueError) as err:
            for seq in seqs:
                self.engine.cancel(seq)
            if isinstance(err, QueueFullError):
                raise APIError(429, f"The server is busy ({err}); retry later", code="rate_limit_exceeded",
                               kind="rate_limit_error", headers={"Retry-After": "1"}) from err
            if isinstance(err, EngineError):
                raise APIError(503, str(err), kind="server_error", code="engine_error") from err
            raise bad(parsed.source, str(err)) from err
        return seqs, queue


def _usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    """OpenAI's usage: ``cached`` of the prompt's tokens came from the prefix cache (not computed again); the
    completion counts every token sampled, a stop id included, as the engine's metrics do."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _chat_logprobs(server: Server, choices: list[Choice]) -> dict[str, Any]:
    """The chat API's logprobs of these tokens: each token's text, log-probability and UTF-8 bytes, with its
    top alternatives'."""
    def entry(token: int, logprob: float | None) -> dict[str, Any]:
        text = server.engine.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(c.token, c.logprob), "top_logprobs": [entry(t, lp) for t, lp in c.top]}
                        for c in choices], "refusal": None}


def _completion_logprobs(server: Server, choices: list[Choice], offset: int) -> dict[str, Any]:
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


async def _collect(server: Server, parsed: Parsed, receive: Callable[[], Any]
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


def _chat_message(parsed: Parsed, answer: Answer) -> tuple[dict[str, Any], str]:
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


def _chat_delta(streams: list[CallStream] | None, index: int, text: str, end: bool) -> dict[str, Any]:
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


def _stream(server: Server, parsed: Parsed, make_chunk: Chunk, usage_chunk: Callable[[dict[str, Any]], dict[str, Any]],
            state: Any) -> AsyncIterator[str]:
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
                yield _sse(make_chunk(index, event.text, None, False, event.logprobs))
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


class AccessLog:
    """ASGI middleware: one line per request on :data:`ACCESS_LOG` once its response has ended (a stream's too):
    method, path, status, the usage a completion route left in the request's state, seconds. Never the body."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.monotonic(), 500  # 500 until the response starts: an exception escaped
        state = scope.setdefault("state", {})  # request.state of the routes

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            usage = state.get("usage")
            tokens = "".join(f" {name}={usage[name]}" for name in ("prompt_tokens", "completion_tokens")
                             if name in (usage or {}))  # an embedding has no completion
            ACCESS_LOG.info("%s %s %d%s %.3f s", scope["method"], scope["path"], status, tokens,
                            time.monotonic() - start)


def _prometheus(metrics: Mapping[str, float]) -> str:
    lines = []
    for name, value in metrics.items():
        kind = "counter" if name.endswith("_total") else "gauge"
        lines += [f"# TYPE attnkit_{name} {kind}", f"attnkit_{name} {value}"]
    return "\n".join(lines) + "\n"


def create_app(server: Server, *, cors_origins: Sequence[str] = ("*",)) -> Any:
    """The FastAPI application of :class:`Server`.

    ``cors_origins``: the web origins (``scheme://host[:port]``) whose pages may call the API from a browser,
    ``"*"`` for any; the API key, if the server has one, still guards every route but the open ones.
    """
    fastapi = require("fastapi", "attnkit serve")
    responses = require("fastapi.responses", "attnkit serve")
    cors = require("fastapi.middleware.cors", "attnkit serve")
    app = fastapi.FastAPI(title="attnkit", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_: Any, err: APIError) -> Any:
        return responses.JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(require("starlette.exceptions", "attnkit serve").HTTPException)
    async def http_error(request: Request, err: Any) -> Any:
        """An unknown route (404) or method (405), in OpenAI's error shape rather than FastAPI's."""
        return await api_error(request, route_error(request, err.status_code, err.detail, err.headers))

    @app.middleware("http")
    async def authorize(request: Request, call_next: Any) -> Any:
        open_paths = ("/health", "/", "/favicon.ico")
        if server.api_key is not None and request.url.path not in open_paths:
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given, f"Bearer {server.api_key}"):
                err = APIError(401, "Incorrect API key provided", code="invalid_api_key")
                return responses.JSONResponse(err.body(), status_code=401)
        return await call_next(request)

    # Added last, so it runs first: a browser's preflight (OPTIONS, which never carries the key) is answered
    # before the key is checked, and a 401 carries the CORS headers the page needs to read it.
    app.add_middleware(cors.CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                       allow_headers=["*"], expose_headers=["Retry-After"])
    app.add_middleware(AccessLog)  # outermost: every request is logged, a refused one (401) or a preflight too

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
        if server.serves_text and not server.engine.alive:
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
        wanted = parsed.params.logprobs is not None
        if parsed.stream:
            streams = None if parsed.tools is None else [CallStream(parsed.tools) for _ in range(parsed.n)]

            def chunk(index: int, text: str, reason: str | None, first: bool, logprobs: list[Choice]
                      ) -> dict[str, Any]:
                delta = {"role": "assistant", "content": ""} if first else _chat_delta(streams, index, text,
                                                                                        reason is not None)
                if reason == "stop" and streams is not None and streams[index].calls:
                    reason = "tool_calls"
                lp = _chat_logprobs(server, logprobs) if wanted and logprobs else None
                out = {**base, "object": "chat.completion.chunk",
                       "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, Any]) -> dict[str, Any]:
                return {**base, "object": "chat.completion.chunk", "choices": [], "usage": u}

            return responses.StreamingResponse(_stream(server, parsed, chunk, usage, request.state),
                                               media_type="text/event-stream")
        answers, request.state.usage = await _collect(server, parsed, request.receive)
        messages = [_chat_message(parsed, a) for a in answers]
        return {**base, "object": "chat.completion",
                "choices": [{"index": i, "message": message,
                             "logprobs": _chat_logprobs(server, a.logprobs) if wanted else None,
                             "finish_reason": reason}
                            for i, (a, (message, reason)) in enumerate(zip(answers, messages, strict=True))],
                "usage": request.state.usage}

    @app.post("/v1/completions")
    async def complete(request: Request) -> Any:
        parsed = server.parse_completion(await read_json(request))
        rid, created = ids("cmpl")
        base = {"id": rid, "created": created, "model": server.model_name, "system_fingerprint": None}
        wanted, offsets = parsed.params.logprobs is not None, [0] * parsed.n
        if parsed.stream:
            def chunk(index: int, text: str, reason: str | None, first: bool, logprobs: list[Choice]
                      ) -> dict[str, Any]:
                lp = _completion_logprobs(server, logprobs, offsets[index]) if wanted and logprobs else None
                offsets[index] += len(text)
                out = {**base, "object": "text_completion",
                       "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, Any]) -> dict[str, Any]:
                return {**base, "object": "text_completion", "choices": [], "usage": u}

            return responses.StreamingResponse(_stream(server, parsed, chunk, usage, request.state),
                                               media_type="text/event-stream")
        answers, request.state.usage = await _collect(server, parsed, request.receive)
        return {**base, "object": "text_completion",
                "choices": [{"index": i, "text": a.text,
                             "logprobs": _completion_logprobs(server, a.logprobs, 0) if wanted else None,
                             "finish_reason": "length" if a.finish_reason == "length" else "stop"}
                            for i, a in enumerate(answers)],
                "usage": request.state.usage}

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        """Checked here, run in a worker thread (the model, and the JSON of a large answer, off the event loop)."""
        body = await read_json(request)
        if server.embedder is None:
            raise APIError(404, f"This server serves no embeddings (its model {server.model_name} generates text); "
                                "start attnkit serve with --embeddings minilm", param="model", code="model_not_found")
        parsed = server.embedder.parse(body, server.embedding_names, server.names if server.serves_text else ())
        content, tokens = await asyncio.to_thread(server.embedder.run, parsed)
        request.state.usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return responses.Response(content, media_type="application/json")

    @app.api_route("/v1/responses", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    @app.api_route("/v1/responses/{rest:path}", methods=["GET", "POST", "DELETE"], include_in_schema=False)
    async def responses_api() -> Any:
        """OpenAI's Responses API is not served: a 404 that says what to use instead (not "Invalid URL")."""
        raise APIError(404, "attnkit does not serve the Responses API (/v1/responses); use /v1/chat/completions "
                            "(POST /v1/chat/completions with messages)", code="unsupported_endpoint")

    def all_names() -> tuple[str, ...]:
        return tuple(dict.fromkeys((*server.names, *server.embedding_names)))

    def model_object(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": server.started, "owned_by": "attnkit"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_object(name) for name in all_names()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id not in all_names():
            raise no_such_model(model_id, all_names())
        return model_object(model_id)

    @app.get("/health")
    async def health() -> Any:
        if server.serves_text and not server.engine.alive:
            return responses.JSONResponse({"status": "error", "error": repr(server.engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Any:
        values = {**(server.engine.metrics() if server.serves_text else {}),
                  **(server.embedder.metrics() if server.embedder is not None else {})}
        return responses.PlainTextResponse(_prometheus(values))

    @app.get("/")
    async def page() -> Any:
        """The chat page; the model's name goes in HTML-escaped (its script reads it from ``<body data-model>``),
        whether the API needs a key (``<body data-key="required">``: the page shows a field for it), and whether
        the model has a chat template (``<body data-chat="none">`` for a base model: completion mode). A server
        of embeddings alone has no page: a 404 says so. (A stand-in for the server, as the page's tests use, needs
        only those attributes and a tokenizer.)"""
        if isinstance(server, Server) and not server.serves_text:
            return responses.PlainTextResponse(
                f"This attnkit server serves embeddings only ({server.model_name}: POST /v1/embeddings); the chat "
                "page needs a text model (attnkit serve --model smollm2).\n", status_code=404)
        html = resources.files("attnkit.serve").joinpath("chat.html").read_text(encoding="utf-8")
        html = html.replace("__KEY__", "required" if server.api_key is not None else "")
        chat = getattr(server.tokenizer, "chat_template", None) is not None  # a base model's file has none
        html = html.replace("__CHAT__", "template" if chat else "none")
        return responses.HTMLResponse(html.replace("__MODEL__", escape(server.model_name, quote=True)))

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Any:
        """No icon, said without an error: browsers ask for one on every load."""
        return responses.Response(status_code=204)

    return app
