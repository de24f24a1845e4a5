"""The OpenAI-compatible HTTP API over an :class:`~attnkit.serve.engine.Engine` (extra ``serve``: FastAPI, uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings`` (with an
:class:`~attnkit.serve.embeddings.Embedder`; a server may serve embeddings alone), ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text),
``GET /`` (the chat page) and ``GET /favicon.ico`` (204: there is none). Requests
are checked (:class:`~attnkit.serve.parsing.Server`, field by field: :mod:`attnkit.serve.checks`) and their
answers shaped (:mod:`attnkit.serve.answers`) in modules of their own; a request is refused with OpenAI's error shape
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
import json
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from html import escape
from importlib import resources
from typing import Any

from attnkit._optional import require

from .answers import (
    chat_delta,
    chat_message,
    chat_token_logprobs,
    collect,
    completion_token_logprobs,
    stream_events,
)
from .checks import APIError, no_such_model, route_error
from .events import Choice
from .parsing import Parsed, Server
from .tools import CallStream

__all__ = ["ACCESS_LOG", "MAX_BODY", "APIError", "AccessLog", "Parsed", "Server", "create_app"]

try:  # FastAPI reads the routes' annotations: the request class must be importable by name
    from starlette.requests import Request
except ImportError:  # the extra ``serve`` is missing: create_app() says so
    Request = Any  # type: ignore[misc,assignment]

MAX_BODY = 1 << 20  # bytes of JSON a request may send
ACCESS_LOG = logging.getLogger("attnkit.serve.access")  # attnkit serve prints it on stderr (not with --no-access-log)


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
                delta = {"role": "assistant", "content": ""} if first else chat_delta(streams, index, text,
                                                                                        reason is not None)
                if reason == "stop" and streams is not None and streams[index].calls:
                    reason = "tool_calls"
                lp = chat_token_logprobs(server, logprobs) if wanted and logprobs else None
                out = {**base, "object": "chat.completion.chunk",
                       "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, Any]) -> dict[str, Any]:
                return {**base, "object": "chat.completion.chunk", "choices": [], "usage": u}

            return responses.StreamingResponse(stream_events(server, parsed, chunk, usage, request.state),
                                               media_type="text/event-stream")
        answers, request.state.usage = await collect(server, parsed, request.receive)
        messages = [chat_message(parsed, a) for a in answers]
        return {**base, "object": "chat.completion",
                "choices": [{"index": i, "message": message,
                             "logprobs": chat_token_logprobs(server, a.logprobs) if wanted else None,
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
                lp = completion_token_logprobs(server, logprobs, offsets[index]) if wanted and logprobs else None
                offsets[index] += len(text)
                out = {**base, "object": "text_completion",
                       "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": reason}]}
                return {**out, "usage": None} if parsed.include_usage else out

            def usage(u: dict[str, Any]) -> dict[str, Any]:
                return {**base, "object": "text_completion", "choices": [], "usage": u}

            return responses.StreamingResponse(stream_events(server, parsed, chunk, usage, request.state),
                                               media_type="text/event-stream")
        answers, request.state.usage = await collect(server, parsed, request.receive)
        return {**base, "object": "text_completion",
                "choices": [{"index": i, "text": a.text,
                             "logprobs": completion_token_logprobs(server, a.logprobs, 0) if wanted else None,
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
        """{"status": "ok"}, and with an engine that compiles its decode step, that step's state under "compile"
        (:meth:`~attnkit.serve.engine.Engine.compile_status`: compiling, ready or failed, with seconds and error);
        503 with the error once the engine died."""
        if server.serves_text and not server.engine.alive:
            return responses.JSONResponse({"status": "error", "error": repr(server.engine.error)}, status_code=503)
        compiled = server.engine.compile_status() if server.serves_text else {"state": "off"}
        return {"status": "ok"} if compiled["state"] == "off" else {"status": "ok", "compile": compiled}

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
