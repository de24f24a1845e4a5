"""The HTTP API in-process over the tiny float64 decoder of test_engine: request checks, routes and disconnects.

No model download and no server process: FastAPI's TestClient, or the ASGI app
called directly where a client must leave in the middle of a request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine
from tests._util import need
from tests.serve._engine import Words, decode_ids, tiny_engine, tiny_model

need("fastapi")
testclient = need("fastapi.testclient")

from attnkit.serve.api import APIError, Parsed, Server, create_app  # noqa: E402


def _server(engine: Engine) -> Server:
    return Server(engine, Words(), model_name="tiny", context_length=128)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    engine = tiny_engine(tiny_model())
    engine.start()
    yield testclient.TestClient(create_app(_server(engine)))
    engine.shutdown()


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "one two three", "max_tokens": 2}


@pytest.mark.parametrize(("route", "body"), [
    ("/v1/chat/completions", {**CHAT, "n": None}),  # an explicit null is the default, n=1
    ("/v1/completions", {**COMPLETION, "n": None}),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "text"}}),  # plain text: what it answers
    ("/v1/chat/completions", {**CHAT, "temperature": 2, "seed": 1}),  # the top of OpenAI's range
    ("/v1/chat/completions", {**CHAT, "top_p": 0}),  # the bottom of OpenAI's range: greedy
    ("/v1/chat/completions", {**CHAT, "logprobs": False}),
    ("/v1/completions", {**COMPLETION, "logprobs": 0}),  # the chosen tokens' only
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": -2, "presence_penalty": 2, "repetition_penalty": 1.1}),
    ("/v1/chat/completions", {**CHAT, "prompt": None}),  # another endpoint's field, but null
    ("/v1/chat/completions", {**CHAT, "tools": [], "logit_bias": {}}),  # empty: none
    ("/v1/completions", {**COMPLETION, "logit_bias": {"3": -100, "4": 100}}),
])
def test_what_openai_accepts_is_accepted(client: Any, route: str, body: dict[str, Any]) -> None:
    """Bug: n=null, response_format text and top_p=0 were refused with a 400."""
    r = client.post(route, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("route", "body", "param", "says"), [
    ("/v1/chat/completions", {**CHAT, "logprobs": 0}, "logprobs", "expected a boolean"),  # 0 == False
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "got 21"),
    ("/v1/completions", {**COMPLETION, "logprobs": 6}, "logprobs", "must be in [0, 5], got 6"),
    ("/v1/completions", {**COMPLETION, "top_logprobs": 2}, "top_logprobs", "belongs to /v1/chat/completions"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 2.5}, "frequency_penalty", "must be in [-2, 2], got 2.5"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
    ("/v1/chat/completions", {**CHAT, "prompt": "four five"}, "prompt", "belongs to /v1/completions"),
    ("/v1/completions", {**COMPLETION, "messages": CHAT["messages"]}, "messages", "belongs to /v1/chat"),
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "must be in [0, 2], got 2.5"),
    ("/v1/chat/completions", {**CHAT, "top_p": 1.5}, "top_p", "must be in [0, 1], got 1.5"),
    ("/v1/chat/completions", {**CHAT, "top_p": -0.1}, "top_p", "must be in [0, 1], got -0.1"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format",
     "cannot constrain its answers"),  # the toy tokenizer has no token bytes for a grammar
    ("/v1/chat/completions", {**CHAT, "n": 9}, "n", "must be in [1, 8], got 9"),
    ("/v1/chat/completions", {**CHAT, "n": True}, "n", "expected an integer, got true"),
    ("/v1/completions", {**COMPLETION, "n": 0}, "n", "must be in [1, 8], got 0"),
])
def test_what_the_server_cannot_honour_is_refused_naming_the_field(client: Any, route: str, body: dict[str, Any],
                                                                   param: str, says: str) -> None:
    """Bug: logprobs=0, temperature > 2 and the other endpoint's prompt / messages were silently accepted."""
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error"


def test_top_p_zero_samples_greedily() -> None:
    """OpenAI's top_p=0 keeps only the most likely token: the server samples greedily, whatever the temperature."""
    parsed = _server(tiny_engine(tiny_model())).parse_completion({**COMPLETION, "top_p": 0, "temperature": 1.5})
    assert (parsed.params.temperature, parsed.params.top_p) == (0.0, None)


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/v1/completions", {**COMPLETION, "prompt": "w " * 200}, "prompt"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "w " * 200}]}, "messages"),
])
def test_a_prompt_longer_than_the_context_says_context_length_exceeded(client: Any, route: str,
                                                                       body: dict[str, Any], param: str) -> None:
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == param
    assert "the prompt has 200 tokens" in error["message"]


def test_an_engine_refusal_names_the_field_the_prompt_came_from() -> None:
    """Bug: Server.submit blamed "messages" for every prompt that is not empty, a completion's included."""
    server = _server(tiny_engine(tiny_model()))
    too_long = GenerationOptions(max_new_tokens=500)  # past the context: the engine refuses it

    async def submit(source: str) -> APIError:
        with pytest.raises(APIError) as refused:
            server.submit(Parsed([1, 2, 3], too_long, False, False, source))
        return refused.value

    for source in ("prompt", "messages"):
        error = asyncio.run(submit(source))
        assert error.status == 400 and error.param == source and "context length" in error.message


def test_a_model_is_retrieved_by_its_id_and_another_is_not_found(client: Any) -> None:
    """Bug: GET /v1/models/{id} (the openai client's models.retrieve) did not exist."""
    listed = client.get("/v1/models").json()["data"][0]
    assert client.get("/v1/models/tiny").json() == listed == {**listed, "id": "tiny", "object": "model"}
    r = client.get("/v1/models/gpt-4")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model 'gpt-4' does not exist; this server has 'tiny'",
                                  "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}


def test_unknown_routes_and_methods_answer_in_openais_error_shape(client: Any) -> None:
    """Bug: they answered FastAPI's {"detail": ...}, which OpenAI clients cannot read."""
    r = client.get("/v1/nothing")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "Invalid URL (GET /v1/nothing)", "type": "invalid_request_error",
                                  "param": None, "code": None}}
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"error": {"message": "Method not allowed (GET /v1/chat/completions); this route takes POST",
                                  "type": "invalid_request_error", "param": None, "code": None}}


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1")])
def test_the_responses_api_is_a_404_saying_to_use_chat_completions(client: Any, method: str, path: str) -> None:
    """Bug: /v1/responses answered "Invalid URL", which says nothing of what this server serves instead."""
    r = client.request(method, path, json={"model": "tiny", "input": "Hi"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert "does not serve the Responses API" in error["message"] and "/v1/chat/completions" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_client_that_leaves_a_request_that_does_not_stream_is_cancelled_while_tokens_arrive() -> None:
    """Bug: the disconnect check ran only after 0.5 s without an event (and request.is_disconnected() never
    turned true under the auth middleware), so a decoding request ran on to max_tokens, holding its batch slot and
    KV blocks, after its client had gone."""
    model = tiny_model()
    engine = tiny_engine(model)
    step = model.step

    def slow_step(*args: Any) -> Any:  # 20 ms a token: 120 tokens take 2.4 s
        time.sleep(0.02)
        return step(*args)

    model.step = slow_step  # type: ignore[method-assign]
    app = create_app(_server(engine))
    body = json.dumps({**COMPLETION, "max_tokens": 120, "temperature": 0}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    sent: list[dict[str, Any]] = []

    async def leave_mid_answer() -> None:
        gone = asyncio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        request = asyncio.ensure_future(app(scope, receive, send))
        while engine.stats["generated_tokens_total"] < 3:  # the answer is under way: events keep arriving
            await asyncio.sleep(0.005)
        gone.set()
        await asyncio.wait([request], timeout=10)
        assert request.done()

    engine.start()
    try:
        asyncio.run(leave_mid_answer())
        deadline = time.monotonic() + 10
        while not engine.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    assert metrics["requests_running"] == 0 and metrics["kv_blocks_used"] == 0
    assert metrics["generated_tokens_total"] < 60, metrics  # cancelled at once, not run on to max_tokens
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]  # for the access log


class _Recording(Words):
    """Words that keeps the messages each chat prompt was built from."""

    def __init__(self) -> None:
        self.seen: list[list[dict[str, str]]] = []

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        self.seen.append(messages)
        return super().chat_ids(messages)


def test_text_content_parts_are_joined_by_a_newline() -> None:
    """Bug: the parts were joined by nothing, "What is" + "the best book" -> "What isthe best book" (llama.cpp
    joins them with a newline)."""
    words = _Recording()
    server = Server(tiny_engine(tiny_model()), words, model_name="tiny", context_length=128)
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    server.parse_chat({**CHAT, "messages": [{"role": "user", "content": parts}]})
    assert words.seen == [[{"role": "user", "content": "What is\nthe best book"}]]


PREFLIGHT = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def test_a_browser_preflight_is_answered_before_the_api_key_is_checked() -> None:
    """Bug: no CORS: a browser app on another origin failed at its preflight (an OPTIONS without the key), so
    it never sent its request."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        server = Server(engine, Words(), model_name="tiny", api_key="secret", context_length=128)
        client = testclient.TestClient(create_app(server))
        preflight = client.options("/v1/chat/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        answer = client.post("/v1/chat/completions", json=CHAT,
                             headers={"Origin": "http://localhost:3000", "Authorization": "Bearer secret"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "*"
        refused = client.post("/v1/chat/completions", json=CHAT, headers={"Origin": "http://localhost:3000"})
        assert refused.status_code == 401  # the key still guards the route, and the page may read why:
        assert refused.headers["access-control-allow-origin"] == "*"
    finally:
        engine.shutdown()


def test_cors_origins_name_the_only_pages_that_may_call() -> None:
    client = testclient.TestClient(create_app(_server(tiny_engine(tiny_model())), cors_origins=["https://app.example"]))
    allowed = client.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://app.example",
                                                    "Access-Control-Request-Method": "GET"})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = client.options("/v1/models", headers={**PREFLIGHT, "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers


def test_a_model_alias_is_listed_and_served_and_other_names_are_not_found() -> None:
    """Bug: the model id was fixed to the file's name: an app configured with another name got a 404."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        server = Server(engine, Words(), model_name="tiny", aliases=["gpt-4o-mini"], context_length=128)
        client = testclient.TestClient(create_app(server))
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "gpt-4o-mini"]
        assert client.get("/v1/models/gpt-4o-mini").json()["id"] == "gpt-4o-mini"
        for name in ("tiny", "gpt-4o-mini"):
            answer = client.post("/v1/completions", json={**COMPLETION, "model": name})
            assert answer.status_code == 200, answer.text
        other = client.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"})
        assert other.status_code == 404
        assert other.json()["error"]["message"] == ("The model 'gpt-4' does not exist; this server has 'tiny', "
                                                    "'gpt-4o-mini'")
    finally:
        engine.shutdown()


def test_every_request_logs_one_line_with_its_status_and_tokens_but_not_the_prompt(
        caplog: pytest.LogCaptureFixture) -> None:
    """Bug: the server logged no requests. A stream's line comes once it ended, with the tokens it sent."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        server = Server(engine, Words(), model_name="tiny", api_key="secret", context_length=128)
        client = testclient.TestClient(create_app(server))
        key = {"Authorization": "Bearer secret"}
        caplog.set_level(logging.INFO, logger="attnkit.serve.access")
        client.post("/v1/completions", json={**COMPLETION, "temperature": 0}, headers=key)
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True}, headers=key)
        client.post("/v1/completions", json=COMPLETION)  # no key
        client.get("/v1/models", headers=key)
    finally:
        engine.shutdown()
    lines = [r.getMessage().rsplit(" ", 2) for r in caplog.records if r.name == "attnkit.serve.access"]
    assert [line for line, _, _ in lines] == [
        "POST /v1/completions 200 prompt_tokens=3 completion_tokens=2",
        "POST /v1/chat/completions 200 prompt_tokens=3 completion_tokens=3",
        "POST /v1/completions 401", "GET /v1/models 200"]
    assert all(float(seconds) >= 0 and unit == "s" for _, seconds, unit in lines)
    assert "one two three" not in caplog.text


def test_a_repeated_prompt_reports_its_cached_tokens() -> None:
    """Bug: usage had no prompt_tokens_details.cached_tokens although the prefix cache served the prompt."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        client = testclient.TestClient(create_app(_server(engine)))
        body = {**COMPLETION, "prompt": " ".join(["one", "two", "three"] * 4)}  # 12 tokens: three blocks of 4
        first, second = (client.post("/v1/completions", json=body).json()["usage"] for _ in range(2))
    finally:
        engine.shutdown()
    assert first["prompt_tokens"] == second["prompt_tokens"] == 12
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 8}  # the last full block is recomputed for logits


def test_usage_and_metrics_count_the_stop_token_alike() -> None:
    """Bug: usage.completion_tokens left out the stop id that /metrics' generated tokens counted (7 against 8)."""
    model = tiny_model()
    engine = tiny_engine(model)
    greedy = engine.submit([1, 2, 3], GenerationOptions(max_new_tokens=1), lambda e: None)
    while not engine.idle:
        engine.step()
    stop = greedy.tokens[-1]  # the first greedy token: ask for it as the stop id
    events: list[Any] = []
    engine.submit([1, 2, 3], GenerationOptions(max_new_tokens=8, stop_ids=[stop]), events.append)
    while not engine.idle:
        engine.step()
    assert events[-1].finish_reason == "stop"
    assert sum(len(e.token_ids) for e in events) == 1
    assert engine.metrics()["generated_tokens_total"] == 2  # one per request, each counted once


def _reference_logprobs(prompt: list[int], n: int) -> list[torch.Tensor]:
    """Greedy log-softmax rows (V,) of the tiny model, token by token (float64)."""
    model, tokens, rows = tiny_model(), list(prompt), []
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([tokens]))[0, -1].log_softmax(dim=-1)  # (V,)
        rows.append(row)
        tokens.append(int(row.argmax()))
    return rows


def test_chat_logprobs_are_the_models_log_softmax_in_openais_shape(client: Any) -> None:
    body = {**CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    rows = _reference_logprobs(Words().encode("one two three"), 3)
    assert len(content) == 3
    for entry, row in zip(content, rows, strict=True):
        top = row.topk(2)
        assert entry["token"] == decode_ids([int(top.indices[0])]) and entry["bytes"] == list(entry["token"].encode())
        torch.testing.assert_close(entry["logprob"], float(top.values[0]), atol=1e-9, rtol=0)
        assert [t["token"] for t in entry["top_logprobs"]] == [decode_ids([int(i)]) for i in top.indices]
        torch.testing.assert_close([t["logprob"] for t in entry["top_logprobs"]], top.values.tolist(), atol=1e-9,
                                   rtol=0)


def test_completion_logprobs_streamed_and_not_agree(client: Any) -> None:
    body = {**COMPLETION, "max_tokens": 3, "temperature": 0, "logprobs": 1}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    rows = _reference_logprobs(Words().encode("one two three"), 3)
    assert whole["logprobs"]["tokens"] == [decode_ids([int(row.argmax())]) for row in rows]
    torch.testing.assert_close(whole["logprobs"]["token_logprobs"], [float(row.max()) for row in rows], atol=1e-9,
                               rtol=0)
    tokens = whole["logprobs"]["tokens"]
    assert whole["logprobs"]["text_offset"] == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]
    assert "".join(tokens) == whole["text"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert [t for p in pieces for t in p["tokens"]] == whole["logprobs"]["tokens"]
    assert [o for p in pieces for o in p["text_offset"]] == whole["logprobs"]["text_offset"]
    assert [lp for p in pieces for lp in p["top_logprobs"]] == whole["logprobs"]["top_logprobs"]


def test_n_answers_are_the_single_answers_of_seeds_seed_plus_i(client: Any) -> None:
    """n choices: one prompt, choice i sampled as a request of seed + i alone; usage counts the prompt once."""
    body = {**COMPLETION, "prompt": "one two three four five six seven", "max_tokens": 6, "temperature": 2,
            "presence_penalty": 2, "frequency_penalty": 2}  # the tiny model's answers vary only so
    many = client.post("/v1/completions", json={**body, "n": 3, "seed": 5}).json()
    alone = [client.post("/v1/completions", json={**body, "seed": 5 + i}).json() for i in range(3)]
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert [c["text"] for c in many["choices"]] == [a["choices"][0]["text"] for a in alone]
    assert len({c["text"] for c in many["choices"]}) > 1  # three seeds, not one answer three times
    assert many["usage"]["prompt_tokens"] == 7
    assert many["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


def test_n_streamed_chunks_name_their_choice(client: Any) -> None:
    body = {**CHAT, "max_tokens": 4, "temperature": 2, "seed": 2, "n": 2, "presence_penalty": 2}
    whole = client.post("/v1/chat/completions", json=body).json()
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts, reasons = ["", ""], [None, None]
    for c in chunks:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    assert texts == [c["message"]["content"] for c in whole["choices"]]
    assert reasons == [c["finish_reason"] for c in whole["choices"]]


def test_n_prefills_the_prompt_once() -> None:
    """The n choices share the prompt's full blocks: the prefix cache serves all but the first."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        client = testclient.TestClient(create_app(_server(engine)))
        body = {**COMPLETION, "prompt": " ".join(["one", "two", "three"] * 4), "n": 4, "temperature": 1.0}
        assert client.post("/v1/completions", json=body).status_code == 200
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    assert metrics["prefix_cache_hit_tokens_total"] == 3 * 8  # three choices reuse two full blocks of four
