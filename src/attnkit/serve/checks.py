"""Checking an OpenAI request field by field, and OpenAI's error shape for what the API refuses.

Every refusal is an :class:`APIError`: an HTTP status and the fields of
``{"error": {"message", "type", "param", "code"}}``; the message names the
offending field and what was expected. :mod:`attnkit.serve.api` turns them into
responses.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from attnkit.models.generation_options import MAX_LOGIT_BIAS, MAX_LOGPROBS, check_logit_bias

from .tools import arguments_object, valid_name

MAX_STOPS = 4
MAX_CHOICES = 8  # the most answers (n) one request may ask for
MAX_COMPLETION_LOGPROBS = 5  # the completions API's most alternatives per token (OpenAI's limit)
MAX_TOOLS = 128  # the most functions one request may offer (OpenAI's limit)
ROLES = ("system", "user", "assistant", "developer", "tool")

_COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
           "stream_options", "n", "user", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
           "logit_bias", "metadata", "store", "service_tier", "parallel_tool_calls", "tools", "tool_choice",
           "response_format", "echo", "suffix", "best_of", "prompt", "messages", "repetition_penalty"}


class APIError(Exception):
    """A request the API refuses: an HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(param: str, message: str, code: str | None = None) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code=code)


def no_such_model(name: str, served: Sequence[str]) -> APIError:
    names = ", ".join(f"'{n}'" for n in served)
    return APIError(404, f"The model '{name}' does not exist; this server has {names}", param="model",
                    code="model_not_found")


def embeddings_only(route: str, served: Sequence[str]) -> APIError:
    """A text route on a server of embeddings alone (as OpenAI answers a chat request naming an embedding model)."""
    names = ", ".join(f"'{n}'" for n in served)
    return APIError(404, f"This server serves embeddings only (POST /v1/embeddings, model {names}); {route} needs "
                         "a text model: start attnkit serve --model smollm2 (add --embeddings minilm to serve both)",
                    param="model", code="model_not_found")


def too_long(param: str, message: str) -> APIError:
    """A prompt that leaves no room for an answer: OpenAI's code, which clients branch on to shorten it."""
    return bad(param, message, code="context_length_exceeded")


def integer(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"expected an integer, got {json.dumps(value)}")
    if value < low or (high is not None and value > high):
        raise bad(name, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _number(body: Mapping[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"expected a number, got {json.dumps(value)}")
    return float(value)


def stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    given = [stop] if isinstance(stop, str) else stop
    if not isinstance(given, list) or not all(isinstance(s, str) and s for s in given):
        raise bad("stop", "expected a non-empty string or a list of them")
    if len(given) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} stop strings, got {len(given)}")
    return tuple(given)


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    unknown = sorted(set(body) - _COMMON)
    if unknown:
        raise APIError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
    for name in ("echo", "suffix"):
        if body.get(name) not in (None, False, [], {}, ""):
            raise bad(name, "is not supported by this server")
    if body.get("best_of", 1) not in (1, None):
        raise bad("best_of", "only 1 is supported")
    if not isinstance(body.get("parallel_tool_calls", True), bool):  # a forced call is one call whatever it says
        raise bad("parallel_tool_calls", f"expected true or false, got {body['parallel_tool_calls']!r}")


def response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """``response_format``: None for plain text ({"type": "text"}), else the JSON Schema the answer must follow:
    ``{"type": "object"}`` for {"type": "json_object"}, the ``schema`` of {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}} ({} when it has none: any JSON value). Whether the schema's
    keywords are supported is the grammar's to say (:mod:`attnkit.serve.grammar`)."""
    given = body.get("response_format")
    if given is None or given == {}:
        return None
    shape = '{"type": "text" | "json_object" | "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
    if not isinstance(given, dict) or given.get("type") not in ("text", "json_object", "json_schema"):
        raise bad("response_format", f"expected {shape}, got {json.dumps(given)[:200]}")
    kind = given["type"]
    extra = sorted(set(given) - {"type", "json_schema"} if kind == "json_schema" else set(given) - {"type"})
    if extra:
        raise bad("response_format", f"unknown field {extra[0]!r} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = given.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format", f"json_schema: expected {{\"name\": ..., \"schema\": {{...}}}}, got "
                                     f"{json.dumps(spec)[:200]}")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad("response_format", f"json_schema: unknown field {extra[0]!r}; expected name, schema, strict, "
                                     "description")
    name = spec.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
        raise bad("response_format", f"json_schema.name: expected 1 to 64 letters, digits, _ or -, got "
                                     f"{json.dumps(name)[:80]}")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad("response_format", f"json_schema.strict: expected a boolean, got {json.dumps(spec['strict'])}")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise bad("response_format", f"json_schema.schema: expected a JSON Schema object, got "
                                     f"{json.dumps(schema)[:80]}")
    return schema


def choices(body: Mapping[str, Any]) -> int:
    """``n``: how many answers to sample from the one prompt, 1 to :data:`MAX_CHOICES`."""
    return integer(body, "n", 1, MAX_CHOICES) or 1


def penalties(body: Mapping[str, Any]) -> tuple[float, float, float]:
    """(frequency, presence, repetition): OpenAI's frequency and presence penalties in [-2, 2] (default 0),
    and vLLM's / llama.cpp's repetition_penalty (> 0, default 1 = off)."""
    found = []
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name)
        if value is not None and not -2 <= value <= 2:
            raise bad(name, f"must be in [-2, 2], got {value}")
        found.append(0.0 if value is None else value)
    repetition = _number(body, "repetition_penalty")
    if repetition is not None and not repetition > 0:
        raise bad("repetition_penalty", f"must be > 0 (1 = off), got {repetition}")
    return found[0], found[1], 1.0 if repetition is None else repetition


def chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """The chat API's ``logprobs`` (a boolean) and ``top_logprobs`` (0 to 20): alternatives per token, or None."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", f"expected a boolean (the chat API's; top_logprobs gives the number), got "
                              f"{json.dumps(logprobs)}")
    top = integer(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if logprobs else None


def completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """The completions API's ``logprobs``: a number of alternatives per token (0 to 5), or None."""
    if body.get("top_logprobs") is not None:
        raise bad("top_logprobs", "belongs to /v1/chat/completions; this endpoint takes logprobs as a number")
    return integer(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)


def sampling(body: Mapping[str, Any]) -> tuple[float, float | None]:
    """(temperature, top_p) in OpenAI's ranges; top_p=0 keeps only the most likely token: greedy."""
    temperature = _number(body, "temperature")
    if temperature is not None and not 0 <= temperature <= 2:
        raise bad("temperature", f"must be in [0, 2], got {temperature}")
    top_p = _number(body, "top_p")
    if top_p is not None and not 0 <= top_p <= 1:
        raise bad("top_p", f"must be in [0, 1], got {top_p}")
    if top_p == 0:
        return 0.0, None
    return 1.0 if temperature is None else temperature, top_p


def refuse_other_endpoints_field(body: Mapping[str, Any], field: str, endpoint: str, instead: str) -> None:
    """Refuse a field of the other endpoint, which this one would silently ignore."""
    if body.get(field) is not None:
        raise bad(field, f"belongs to {endpoint}; this endpoint takes {instead}")


def route_error(request: Any, status: int, detail: Any, headers: Mapping[str, str] | None) -> APIError:
    """Starlette's error for a route or method it does not serve, as an :class:`APIError`."""
    route = f"{request.method} {request.url.path}"
    if status == 404:
        return APIError(404, f"Invalid URL ({route})", headers=headers)
    if status == 405:
        allowed = {k.lower(): v for k, v in (headers or {}).items()}.get("allow", "another method")
        return APIError(405, f"Method not allowed ({route}); this route takes {allowed}", headers=headers)
    return APIError(status, str(detail), headers=headers)


def logit_bias(body: Mapping[str, Any]) -> dict[int, float] | None:
    """``logit_bias``: {token id (a decimal string, JSON's key) -> bias in [-100, 100]}, at most 300 ids; None when
    absent or empty. Whether each id is in the vocabulary is the server's to say (it knows the model). A refusal
    names the offending key or bias and what is expected, in JSON's terms."""
    given = body.get("logit_bias")
    expected = "a map of token ids (decimal strings) to biases in [-100, 100]"
    if given is not None and not isinstance(given, dict):
        raise bad("logit_bias", f"expected {expected}, got {json.dumps(given)[:80]}")
    if given is not None and len(given) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"names {len(given)} token ids; at most {MAX_LOGIT_BIAS} are allowed")
    for key, bias in (given or {}).items():
        if not (key.isascii() and key.isdecimal()):
            raise bad("logit_bias", f"key {json.dumps(key)[:80]} is not a token id; expected {expected}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"token {key} has the bias {json.dumps(bias)[:80]}; expected a number in "
                                    "[-100, 100]")
    return check_logit_bias(given)


def refuse_control_tokens(body: Mapping[str, Any], specials: Sequence[str], *, tools: bool) -> None:
    """A 400 naming the first field (its whole path: ``tools[1].function.description``) that the chat template
    gets besides messages' content and that spells a control token (``specials``): the tools (when ``tools``: they
    are offered) and earlier assistant messages' tool calls. Content is encoded as plain text around the
    template's markup; these fields cannot be, and a control token in them would forge a turn."""
    fields = [("tools", body["tools"])] if tools else []
    for i, message in enumerate(body.get("messages") or []):  # already checked by chat_messages
        if message.get("role") == "assistant" and message.get("tool_calls"):
            fields.append((f"messages[{i}].tool_calls", message["tool_calls"]))
    for where, value in fields:
        text = json.dumps(value, ensure_ascii=False)
        if any(token in text for token in specials):  # then find where, field by field
            path, token = _spelling(value, specials, where) or (where, next(t for t in specials if t in text))
            raise bad(path, f"spells the control token {token!r}, which only the chat template's own markup may "
                            "write (only message content is encoded as plain text)")


def _spelling(value: Any, specials: Sequence[str], where: str) -> tuple[str, str] | None:
    """(the path of the first string, key or value, in ``value`` that spells one of ``specials``, that token)."""
    if isinstance(value, str):
        token = next((t for t in specials if t in value), None)
        return None if token is None else (where, token)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        path = f"{where}.{key}" if isinstance(key, str) else f"{where}[{key}]"
        found = (_spelling(key, specials, path) if isinstance(key, str) else None) or _spelling(item, specials, path)
        if found is not None:
            return found
    return None


def offered_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """``tools``: OpenAI's [{"type": "function", "function": {"name", "description", "parameters", "strict"}}], each
    checked (a name of letters, digits, _ and -; parameters a JSON Schema of an object, {} of no arguments when
    absent) and returned in that shape; None when absent or empty."""
    given = body.get("tools")
    if given is None or given == []:
        return None
    if not isinstance(given, list):
        raise bad("tools", f"expected a list of {{\"type\": \"function\", \"function\": {{...}}}}, got "
                           f"{json.dumps(given)[:80]}")
    if len(given) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools, got {len(given)}")
    checked = [_tool(i, tool) for i, tool in enumerate(given)]
    names = [t["function"]["name"] for t in checked]
    repeated = next((n for n in names if names.count(n) > 1), None)
    if repeated is not None:
        raise bad("tools", f"two tools are named {repeated!r}: a call names its function, so names must differ")
    return checked


def _tool(i: int, tool: Any) -> dict[str, Any]:
    """``tools[i]`` checked; a refusal names the innermost field at fault (``tools[1].function.name``)."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad(where, f"expected {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got "
                         f"{json.dumps(tool)[:80]}")
    if tool.get("type") != "function":
        raise bad(f"{where}.type", f"expected \"function\" (the only type of tool served), got "
                                   f"{json.dumps(tool.get('type'))[:80]}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad(f"{where}.function", f"expected {{\"name\": ..., \"description\": ..., \"parameters\": {{...}}}}, "
                                       f"got {json.dumps(function)[:80]}")
    extra = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if extra:
        raise bad(f"{where}.function", f"unknown field {extra[0]!r}; expected name, description, parameters, strict")
    if not valid_name(function.get("name")):
        raise bad(f"{where}.function.name", f"expected 1 to 64 letters, digits, _ or -, got "
                                            f"{json.dumps(function.get('name'))[:80]}")
    if not isinstance(function.get("description", ""), str):
        raise bad(f"{where}.function.description", "expected a string")
    if not isinstance(function.get("strict", False), (bool, type(None))):
        raise bad(f"{where}.function.strict", f"expected true or false, got {json.dumps(function['strict'])[:80]}")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad(f"{where}.function.parameters", f"expected a JSON Schema of an object ({{\"type\": \"object\", "
                                                  f"\"properties\": ...}}), got {json.dumps(parameters)[:80]}")
    return {"type": "function", "function": {**function, "parameters": parameters}}


def chosen_tool(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """``tool_choice``: ("auto" | "none" | "required", None), or ("function", its name) for
    {"type": "function", "function": {"name"}} naming one of ``tools``; ("none", None) without tools."""
    given = body.get("tool_choice")
    if tools is None:
        if given is not None:
            raise bad("tool_choice", "is only allowed when tools are given")
        return "none", None
    if given is None or given in ("auto", "none", "required"):
        return given or "auto", None
    function = given.get("function") if isinstance(given, dict) and given.get("type") == "function" else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad("tool_choice", f"expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                                 f"\"function\": {{\"name\": ...}}}}, got {json.dumps(given)[:80]}")
    names = [t["function"]["name"] for t in tools]
    if function["name"] not in names:
        raise bad("tool_choice", f"names the function {function['name']!r}, which is not among the tools "
                                 f"({', '.join(names)})")
    return "function", function["name"]


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked and made plain for the chat template: {"role", "content"} with text content (text
    parts joined by a newline, as llama.cpp joins them; "developer" as "system"), an assistant's ``tool_calls``
    (content may then be null) with their arguments as objects, a tool's ``tool_call_id`` (it must answer a call
    of an earlier assistant message) and the function's ``name``."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty list of {\"role\", \"content\"} objects")
    plain: list[dict[str, Any]] = []
    calls: dict[str, str] = {}  # each earlier call's id -> its function's name
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}]", "expected an object with a string 'role'")
        if m["role"] not in ROLES:
            raise bad(f"messages[{i}].role", f"unknown role {m['role']!r}; expected system, user, assistant or tool")
        message: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"]}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(i, m["tool_calls"])
            calls |= {c["id"]: c["function"]["name"] for c in message["tool_calls"]}
        message["content"] = _content(i, m.get("content"), null="tool_calls" in message)
        if m["role"] == "tool":
            answered = m.get("tool_call_id")
            if not isinstance(answered, str) or answered not in calls:
                raise bad(f"messages[{i}].tool_call_id", f"{json.dumps(answered)[:80]} answers no tool call of an "
                                                         "earlier assistant message")
            message |= {"tool_call_id": answered, "name": calls[answered]}
        plain.append(message)
    return plain


def _content(i: int, content: Any, *, null: bool) -> str:
    if content is None and null:  # an assistant message of tool calls alone
        return ""
    if isinstance(content, list):  # OpenAI's text content parts, one a line (as llama.cpp joins them)
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"messages[{i}].content", "only text content parts are supported")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content", f"expected a string, got {json.dumps(content)}")
    return content


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` checked, each call's arguments as the object they spell."""
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls", "expected a list of {\"id\", \"type\": \"function\", \"function\"}")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("id"), str) or call.get("type", "function") != \
                "function" or not isinstance(function, dict):
            raise bad(where, f"expected {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             f"\"arguments\"}}}}, got {json.dumps(call)[:80]}")
        if not isinstance(function.get("name"), str) or not isinstance(function.get("arguments"), str):
            raise bad(f"{where}.function", "expected a string name and arguments (JSON text)")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"], "arguments": arguments_object(function["arguments"])}})
    return out
