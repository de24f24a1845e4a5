"""An OpenAI request's checked body turned into what the engine runs (:class:`Parsed`), and submitted.

:class:`Server` holds the routes' state (the engine, the tokenizer, the model's names, the API key) and parses
``/v1/chat/completions`` and ``/v1/completions`` bodies field by field (:mod:`attnkit.serve.checks`): the prompt's
ids, the sampling options (:class:`~attnkit.models.generation_options.GenerationOptions`), the grammar of
``response_format`` or of a forced tool call (:mod:`attnkit.serve.grammar`), the syntax of the answers' tool calls
(:mod:`attnkit.serve.tools`). A refusal is an :class:`~attnkit.serve.checks.APIError` in OpenAI's error shape;
:meth:`Server.submit` queues a parsed request's choices in the engine. The answers are shaped by
:mod:`attnkit.serve.answers`, the routes are :mod:`attnkit.serve.api`'s.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from attnkit.models.chat import TemplateLimitError
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
    refuse_control_tokens,
    refuse_other_endpoints_field,
    refuse_unsupported,
    response_format,
    sampling,
    stops,
    too_long,
)
from .engine import Engine
from .events import EngineError, Event, QueueFullError
from .grammar import JSONSchemas
from .tools import ToolSyntax, template_syntax

if TYPE_CHECKING:
    from .embeddings import Embedder

WINDOWED_MAX_TOKENS = 1 << 17  # with a sink window, the most tokens one answer may ask for (so it ends)


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
        called). A template without tool support is a 400 naming ``tools``. ``parallel_tool_calls: false`` keeps
        an answer's first call only (the others are dropped as it is parsed; a forced call is one call anyway)."""
        offered = offered_tools(body)
        mode, name = chosen_tool(body, offered)
        if offered is None or mode == "none":
            return None, None, None
        try:
            syntax = template_syntax(getattr(self.tokenizer, "chat_template", None))
        except ValueError as err:
            raise bad("tools", str(err)) from None
        if body.get("parallel_tool_calls") is False:
            syntax = replace(syntax, parallel=False)
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

    def _refuse_lost_calls(self, messages: list[dict[str, Any]]) -> None:
        """Earlier tool calls or their results, for a template without tool support, are a 400 naming the first
        message that carries one (such a template renders them as empty turns: the model would never see them)."""
        for i, message in enumerate(messages):
            if message.get("tool_calls") or message["role"] == "tool":
                try:
                    template_syntax(getattr(self.tokenizer, "chat_template", None))
                except ValueError as err:
                    raise bad(f"messages[{i}]", f"carries a tool call or its result, which this model's template "
                                                f"cannot show the model: {err}") from None
                return

    # -- checking a request ------------------------------------------------------------------------------------

    def _params(self, body: Mapping[str, Any], prompt_len: int, source: str, logprobs: int | None
                ) -> GenerationOptions:
        """The sampling options, with OpenAI's defaults (temperature 1, max_tokens the room left: with a sink
        window, the context length); ``source`` is the field the prompt came from ("messages" or "prompt")."""
        refuse_unsupported(body)
        model = body.get("model")
        if not isinstance(model, str):
            raise bad("model", f"expected the model's name, got {json.dumps(model)}")
        if model not in self.names:
            raise no_such_model(model, self.names)
        limit = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        if self.engine.window is not None:  # a sink window: any prompt; by default, a context of new tokens
            if limit is not None and limit > WINDOWED_MAX_TOKENS:
                raise bad(field, f"{limit} new tokens: this server's sink window takes at most "
                                f"{WINDOWED_MAX_TOKENS} per answer")
            return self._options(body, limit or self.context_length, logprobs)
        room = self.context_length - prompt_len
        if room < 1:
            raise too_long(source, f"the prompt has {prompt_len} tokens: no room left in the context window "
                                    f"of {self.context_length}")
        room = min(room, self.engine.capacity - prompt_len)  # what the KV memory can hold besides the prompt
        if room < 1:
            raise too_long(source, f"the prompt has {prompt_len} tokens, more than this server's KV memory "
                                    f"holds ({self.engine.capacity} positions)")
        if limit is not None and limit > room:
            raise bad(field, f"{limit} new tokens do not fit: the prompt has {prompt_len} tokens, the context "
                             f"window is {self.context_length} and the KV memory {self.engine.capacity} positions; "
                             f"ask for at most {room}")
        return self._options(body, min(limit or room, room), logprobs)

    def _options(self, body: Mapping[str, Any], max_new_tokens: int, logprobs: int | None) -> GenerationOptions:
        """The request's sampling options for an answer of at most ``max_new_tokens`` tokens."""
        temperature, top_p = sampling(body)
        frequency, presence, repetition = penalties(body)
        seed = integer(body, "seed", -(2**63), 2**63 - 1)
        bias, vocab = logit_bias(body), self.engine.model.vocab_size
        outside = next((token for token in bias or () if token >= vocab), None)
        if outside is not None:
            raise bad("logit_bias", f"token id {outside} is outside the vocabulary [0, {vocab})")
        return GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
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
        self._refuse_lost_calls(plain)
        offered, syntax, forced = self._tools(body)
        refuse_control_tokens(body, getattr(self.tokenizer, "specials", ()), tools=offered is not None)
        try:  # content is plain text: no control tokens from it
            prompt = self.tokenizer.chat_ids(plain) if offered is None else self.tokenizer.chat_ids(plain,
                                                                                                     tools=offered)
        except TemplateLimitError as err:  # rendering again could take as long: the template's limit names it
            raise bad("messages", str(err)) from err
        except ValueError as err:
            raise bad(self._culprit(plain, offered), str(err)) from err
        stream, usage = self._flags(body)
        options = self._params(body, len(prompt), "messages", chat_logprobs(body))
        grammar = self._grammar(body)
        if forced is not None and grammar is not None:
            raise bad("tool_choice", "forces a tool call, whose answer cannot also follow response_format: give one")
        return Parsed(prompt, options, stream, usage, "messages", choices(body), forced or grammar, syntax)

    def _culprit(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """The field a template that failed to render blames: "tools" if the messages render without them."""
        if tools is None:
            return "messages"
        try:
            self.tokenizer.chat_ids(messages)
        except Exception:  # any failure without the tools is the messages' (a 400 on them, never a 500)
            return "messages"
        return "tools"

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
