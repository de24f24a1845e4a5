"""logit_bias: checked in GenerationOptions, added to each request's own logits by the serving engine before anything
else (logprobs then report the biased scores, as OpenAI's do), refused by field over HTTP, and honoured by a real
``attnkit serve`` process through the openai client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine
from tests._util import need
from tests.serve._engine import Words, tiny_engine, tiny_model


def _run(engine: Engine, options: list[GenerationOptions], prompt: list[int]) -> list[list[int]]:
    """Submit one request per options, all at once (one batch), step until all finish: each one's tokens."""
    tokens: list[list[int]] = [[] for _ in options]
    for i, o in enumerate(options):
        engine.submit(prompt, o, lambda e, i=i: tokens[i].extend(e.token_ids))
    while not engine.idle:
        engine.step()
    return tokens


def _greedy_logits(prompt: list[int], n: int, bias: dict[int, float]) -> list[torch.Tensor]:
    """The tiny model's biased logit rows (V,) along its greedy biased answer (float64)."""
    model, tokens, rows = tiny_model(), list(prompt), []
    add = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    for token, b in bias.items():
        add[token] = b
    for _ in range(n):
        with torch.no_grad():
            row = model(torch.tensor([tokens]))[0, -1] + add  # (V,)
        rows.append(row)
        tokens.append(int(row.argmax()))
    return rows


@pytest.mark.parametrize(("bias", "says"), [
    ({str(i): 1 for i in range(301)}, "names 301 token ids, more than 300"),
    ({"5": 100.5}, "logit_bias['5'] = 100.5: a bias must be a number in [-100, 100]"),
    ({5: float("nan")}, "a bias must be a number in [-100, 100]"),
    ({5: True}, "a bias must be a number"),
    ({"-1": 1}, "logit_bias key '-1' is not a token id"),
    ({"x": 1}, "logit_bias key 'x' is not a token id"),
    ({2.0: 1}, "logit_bias key 2.0 is not a token id"),
    ([(1, 2)], "logit_bias must be a map of token id -> bias"),
])
def test_bad_biases_are_refused_naming_the_id_or_bias(bias: Any, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        GenerationOptions(logit_bias=bias)
    assert "logit_bias" in str(refused.value) and says in str(refused.value)


def test_json_keys_become_token_ids_and_an_empty_bias_is_none() -> None:
    assert GenerationOptions(logit_bias={"7": 1, 3: -2}).logit_bias == {3: -2.0, 7: 1.0}
    assert GenerationOptions(logit_bias={}).logit_bias is None


def test_a_bias_outside_the_vocabulary_is_refused_before_the_first_token() -> None:
    with pytest.raises(ValueError, match=r"logit_bias names token id 50, outside the vocabulary \[0, 50\)"):
        tiny_engine(tiny_model()).submit([1, 2, 3], GenerationOptions(max_new_tokens=4, logit_bias={50: 1}),
                                         lambda e: None)


def test_each_request_of_a_batch_gets_its_own_bias() -> None:
    """+100 makes a token every answer's; -100 on the greedy token gives the runner-up; the unbiased request beside
    them is the greedy answer alone (bug to catch: a bias added to the whole batch's logits, or to the wrong row)."""
    prompt = [1, 2, 3]
    greedy = [int(r.argmax()) for r in _greedy_logits(prompt, 4, {})]
    forced = next(t for t in range(50) if t not in greedy)
    first = _greedy_logits(prompt, 1, {})[0]
    runner_up = int(first.topk(2).indices[1])
    banned = [int(r.argmax()) for r in _greedy_logits(prompt, 4, {greedy[0]: -100})]
    assert banned[0] == runner_up
    options = [GenerationOptions(max_new_tokens=4), GenerationOptions(max_new_tokens=4, logit_bias={forced: 100}),
               GenerationOptions(max_new_tokens=4, logit_bias={greedy[0]: -100})]
    assert _run(tiny_engine(tiny_model()), options, prompt) == [greedy, [forced] * 4, banned]


# -- over HTTP -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    need("fastapi")
    testclient = need("fastapi.testclient")
    from attnkit.serve.api import Server, create_app

    engine = tiny_engine(tiny_model())
    engine.start()
    yield testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128)))
    engine.shutdown()


def test_logprobs_report_the_biased_scores(client: Any) -> None:
    """As OpenAI's: the chosen token's logprob and its alternatives' are the log-softmax of the biased logits."""
    bias = {7: 3.0, 11: -2.5}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3,
            "temperature": 0, "logprobs": True, "top_logprobs": 3, "logit_bias": {str(k): v for k, v in bias.items()}}
    content = client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    rows = _greedy_logits(Words().encode("one two three"), 3, bias)
    for entry, row in zip(content, rows, strict=True):
        logp = row.log_softmax(dim=-1)
        torch.testing.assert_close(entry["logprob"], float(logp.max()), atol=1e-9, rtol=0)
        torch.testing.assert_close([t["logprob"] for t in entry["top_logprobs"]], logp.topk(3).values.tolist(),
                                   atol=1e-9, rtol=0)


@pytest.mark.parametrize(("bias", "says"), [
    ({"50": 1}, "logit_bias: token id 50 is outside the vocabulary [0, 50)"),
    ({"1": 101}, "logit_bias: token 1 has the bias 101; expected a number in [-100, 100]"),
    ({"1": True}, "logit_bias: token 1 has the bias true; expected a number in [-100, 100]"),
    ({"one": 1}, 'logit_bias: key "one" is not a token id; expected a map of token ids (decimal strings) to biases '
                 "in [-100, 100]"),
    ({str(i): 1 for i in range(301)}, "logit_bias: names 301 token ids; at most 300 are allowed"),
    ([1, 2], "logit_bias: expected a map of token ids (decimal strings) to biases in [-100, 100], got [1, 2]"),
])
def test_a_bad_bias_is_a_400_naming_logit_bias_once(client: Any, bias: Any, says: str) -> None:
    """Bug: the message said the field's name two or three times ("logit_bias: logit_bias must be ..., got
    logit_bias=[1, 2]") and the offending key in Python's quotes; it names it once, then the key or bias at fault
    (in JSON's spelling) and what is expected."""
    for route, prompt in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "one"}]}),
                          ("/v1/completions", {"prompt": "one"})]:
        r = client.post(route, json={"model": "tiny", **prompt, "max_tokens": 2, "logit_bias": bias})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "logit_bias" and error["message"] == says, error


def test_a_real_server_honours_logit_bias_through_the_openai_client(tmp_path: Path) -> None:
    """The tiny Qwen 2 file of the tool tests (its token 3 + b is byte b): +100 on "x" makes every token "x"."""
    need("uvicorn")
    openai = need("openai")
    from attnkit.bench.serve import ServerProcess
    from tests.serve._tools import ASK, write_tool_model

    path = write_tool_model(tmp_path / "tiny-bias.gguf")
    process = ServerProcess.attnkit("--gguf", str(path), "--kv-memory", "4", threads=1, log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="none", max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny-bias", messages=ASK, max_tokens=5, temperature=0.8,
                                               seed=1, logit_bias={str(3 + ord("x")): 100})
        plain = client.chat.completions.create(model="tiny-bias", messages=ASK, max_tokens=5, temperature=0.8, seed=1)
    finally:
        process.stop()
    assert reply.choices[0].message.content == "xxxxx"
    assert plain.choices[0].message.content != "xxxxx"
