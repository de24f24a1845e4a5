"""Structured outputs through a real ``attnkit serve`` process and the official openai client.

Every answer under ``response_format`` must parse with ``json.loads`` and validate with ``jsonschema``,
greedy and sampled, on both endpoints, with requests of different schemas decoding in the same batches.
Schemas bound their strings and arrays so that SmolLM2 (135M) finishes within ``max_tokens``: an answer cut
by ``max_tokens`` (finish_reason "length") is the one answer that may not parse.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
from collections.abc import Iterator
from typing import Any

import pytest

from tests._util import need
from tests.models._decoder import need_smollm2

need("fastapi")
need("uvicorn")
need("llguidance")
openai = need("openai")
jsonschema = need("jsonschema")

from attnkit.bench.serve import ServerProcess  # noqa: E402

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": NAME,
        "address": {"type": "object", "properties": {"city": NAME, "street": NAME}, "required": ["city", "street"],
                    "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_of_enums": {"type": "object", "properties": {
        "breads": {"type": "array", "minItems": 1, "maxItems": 3,
                   "items": {"type": "object", "properties": {"kind": {"enum": ["baguette", "brioche", "rye"]},
                                                              "sliced": {"type": "boolean"}},
                             "required": ["kind", "sliced"], "additionalProperties": False}}},
        "required": ["breads"], "additionalProperties": False},
    "bounded_numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "floors": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}},
        "required": ["age", "rating", "floors"], "additionalProperties": False},
    "required_and_optional": {"type": "object", "properties": {
        "title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030}, "subtitle": NAME},
        "required": ["title", "year"], "additionalProperties": False},
}
QUESTIONS = {"nested": "Who is the baker, and where is the bakery? Answer in JSON.",
             "array_of_enums": "Which breads do you sell today? Answer in JSON.",
             "bounded_numbers": "Describe the baker's age, your rating of the shop and its floors, in JSON.",
             "required_and_optional": "Name a famous book and its year, in JSON."}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    need_smollm2()
    process = ServerProcess.attnkit("--kv-memory", "96", "--max-batch", "16",
                                    log=tmp_path_factory.mktemp("serve") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _json_schema(name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def _chat(client: Any, name: str, **options: Any) -> Any:
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[name]}],
                                          response_format=_json_schema(name), max_tokens=80, **options)


def _valid(text: str, schema: dict[str, Any]) -> Any:
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def test_greedy_and_sampled_answers_parse_and_validate_against_their_schemas(client: Any) -> None:
    """Every schema at once, greedy and sampled (n=2, seeded), so rows of different schemas share each decode
    step: a mask applied to the wrong row, or a grammar not advanced by its own tokens, fails validation."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        greedy = {name: pool.submit(_chat, client, name, temperature=0) for name in SCHEMAS}
        sampled = {name: pool.submit(_chat, client, name, temperature=0.9, seed=3, n=2) for name in SCHEMAS}
        answers = [(name, choice) for runs in (greedy, sampled) for name, f in runs.items()
                   for choice in f.result().choices]
    assert len(answers) == 3 * len(SCHEMAS)
    for name, choice in answers:
        assert choice.finish_reason == "stop", (name, choice.message.content)
        _valid(choice.message.content, SCHEMAS[name])


def test_completions_streams_and_logprobs_follow_the_schema(client: Any) -> None:
    """/v1/completions takes response_format too; a stream's pieces join to a valid answer; the logprobs are those
    of the masked distribution: finite, and no alternative the grammar forbids (a top alternative's text is a
    token the schema allows at that point, so never plain prose before the first brace)."""
    name = "required_and_optional"
    reply = client.completions.create(model="smollm2", prompt="A famous book as JSON:", max_tokens=60, temperature=0,
                                      logprobs=3, extra_body={"response_format": _json_schema(name)})
    _valid(reply.choices[0].text, SCHEMAS[name])
    stream = _chat(client, "nested", temperature=0, stream=True, logprobs=True, top_logprobs=5)
    chunks = [c for c in stream if c.choices]
    _valid("".join(c.choices[0].delta.content or "" for c in chunks), SCHEMAS["nested"])
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert all(math.isfinite(t.logprob) and all(math.isfinite(a.logprob) for a in t.top_logprobs) for t in tokens)
    assert all(a.token.startswith("{") for a in tokens[0].top_logprobs), tokens[0].top_logprobs


def test_json_object_mode_answers_any_json_object(client: Any) -> None:
    question = "What is the capital of France? Answer as a JSON object."
    reply = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                           response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


@pytest.mark.parametrize(("response_format", "says"), [
    ({"type": "json_schema", "json_schema": {"name": "tags", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}, "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "odd", "schema": {"type": "strin"}}}, "strin"),
    ({"type": "json_schema", "json_schema": {"name": "look", "schema": {"type": "string", "pattern": "(?=a)"}}},
     "look-around"),
    ({"type": "json_schema", "json_schema": {"name": "ref", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "json_schema.schema"),
    ({"type": "yaml"}, "json_object"),
])
def test_a_schema_that_cannot_be_honoured_is_a_400_naming_response_format(client: Any, response_format: Any,
                                                                          says: str) -> None:
    """Bug: an unsupported keyword silently ignored (answers that do not validate) or a 500 from the grammar."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                       response_format=response_format, max_tokens=8)
    error = caught.value.body
    assert error["param"] == "response_format" and says in error["message"], error


def test_two_schemas_at_once_each_answer_follows_its_own_beside_bad_requests(client: Any) -> None:
    """Two requests whose schemas exclude each other (different required keys, no others allowed) decode together,
    while refused requests arrive beside them: each answer validates against its own schema and not the other's."""
    first, second = SCHEMAS["bounded_numbers"], SCHEMAS["array_of_enums"]
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "object", "uniqueItems": 1}}}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        a = pool.submit(_chat, client, "bounded_numbers", temperature=0.7, seed=11)
        b = pool.submit(_chat, client, "array_of_enums", temperature=0.7, seed=11)
        refused = [pool.submit(client.chat.completions.create, model="smollm2", max_tokens=8, response_format=bad,
                               messages=[{"role": "user", "content": "Hi"}]) for _ in range(2)]
        for f in refused:
            with pytest.raises(openai.BadRequestError):
                f.result()
        text_a, text_b = a.result().choices[0].message.content, b.result().choices[0].message.content
    _valid(text_a, first)
    _valid(text_b, second)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text_a), second)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text_b), first)
