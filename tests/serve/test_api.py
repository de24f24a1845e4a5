"""``attnkit serve`` as users meet it: the official openai client and raw HTTP against a real process.

Answers are compared with the offline ``generate`` of each prompt alone. Greedy
tokens are compared exactly; where they differ, the test requires a near-tie
(the top two offline logits within 1e-3 at the first differing token: batched
float32 arithmetic may round the other way there) and says so.
"""

from __future__ import annotations

import concurrent.futures
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._util import need
from tests.models._decoder import need_smollm2, smollm2

need("fastapi")
need("uvicorn")
openai = need("openai")
httpx = need("httpx")

from attnkit.bench.serve import ServerProcess  # noqa: E402

SYSTEM = ("You are a helpful assistant for a small bakery in Lyon. Answer briefly and kindly, in English, and "
          "never invent prices: say you will check with the baker instead.")
QUESTIONS = ["What is bread?", "Name a French cake.", "Is it open on Sunday?", "What is a croissant?",
             "Do you sell coffee?", "What is sourdough?", "Say hello.", "What flour do you use?",
             "Where is Lyon?", "What is a baguette?", "Tell me a joke.", "What is yeast?",
             "Can I order a cake?", "What is brioche?", "Is bread healthy?", "Thank you!"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    need_smollm2()
    process = ServerProcess.attnkit("--kv-memory", "96", "--max-batch", "16", "--api-key", "test-key",
                                    "--weights", "float32",  # compared with float32 generate below
                                    log=tmp_path_factory.mktemp("serve") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="test-key", max_retries=0, timeout=120)


def _offline(messages: list[dict[str, str]], max_tokens: int) -> tuple[str, list[int], torch.Tensor]:
    """The offline greedy answer of one conversation alone: its text, prompt ids and new ids."""
    model = smollm2()
    ids = model.tokenizer.chat_ids(messages)
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens)
    new = out[0, len(ids):]
    stop = set(model.stop_token_ids)
    kept = [t for t in new.tolist() if t not in stop]
    return model.decode(kept), ids, new


def _assert_same_or_near_tie(served: str, messages: list[dict[str, str]], max_tokens: int) -> None:
    expected, ids, new = _offline(messages, max_tokens)
    if served == expected:
        return
    model = smollm2()
    served_ids = model.tokenizer.encode(served) if served else []
    k = next((i for i, (a, b) in enumerate(zip(served_ids, new.tolist(), strict=False)) if a != b),
             min(len(served_ids), len(new)))
    with torch.inference_mode():
        logits = model(torch.tensor([ids + new[:k].tolist()]))[0, -1]
    top = logits.topk(2).values
    assert float(top[0] - top[1]) < 1e-3, f"served {served!r}, offline {expected!r}: not a near-tie"


def test_chat_completion_equals_generate_alone(client: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    _assert_same_or_near_tie(choice.message.content, messages, 24)
    assert reply.usage.prompt_tokens == len(smollm2().tokenizer.chat_ids(messages))


def test_text_completion_and_its_stream(client: Any) -> None:
    reply = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
    pieces = list(client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8,
                                            temperature=0, stream=True))
    assert reply.object == "text_completion" and reply.usage.completion_tokens == 8
    assert "".join(c.choices[0].text for c in pieces if c.choices) == reply.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"


def test_n_logprobs_and_penalties_through_the_openai_client(client: Any) -> None:
    """The official client parses n choices, chat logprobs and completion logprobs; a repetition penalty
    changes a looping greedy answer (SmolLM2 repeats itself without one)."""
    messages = [{"role": "user", "content": "List the days of the week."}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, temperature=0.8,
                                           seed=1, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    for choice in reply.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    text = client.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=6, temperature=0, logprobs=1)
    assert "".join(text.choices[0].logprobs.tokens) == text.choices[0].text
    plain = client.completions.create(model="smollm2", prompt="the the the", max_tokens=12, temperature=0)
    penalised = client.completions.create(model="smollm2", prompt="the the the", max_tokens=12, temperature=0,
                                          extra_body={"repetition_penalty": 1.3})
    assert penalised.choices[0].text != plain.choices[0].text


def test_streaming_chat_is_openai_shaped(client: Any) -> None:
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Say hi."}],
                                            temperature=0, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_sixteen_concurrent_streams_each_equal_generate_alone(client: Any, server: ServerProcess) -> None:
    def ask(question: str) -> str:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=16,
                                                stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    hits_before = server.metrics({"Authorization": "Bearer test-key"})["prefix_cache_hit_tokens_total"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, QUESTIONS))
    for question, answer in zip(QUESTIONS, answers, strict=True):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        _assert_same_or_near_tie(answer, messages, 16)
    hits = server.metrics({"Authorization": "Bearer test-key"})["prefix_cache_hit_tokens_total"] - hits_before
    a, b = (smollm2().tokenizer.chat_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // 16 * 16  # full blocks
    assert shared >= 32 and hits >= 15 * shared  # the system prompt came from the prefix cache for 15 of 16


def test_a_fully_cached_prompt_answers_the_same(client: Any) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    first, second = (client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                                    max_tokens=12).choices[0].message.content for _ in range(2))
    assert first == second


def test_a_client_that_leaves_mid_stream_frees_its_blocks(server: ServerProcess) -> None:
    auth = {"Authorization": "Bearer test-key"}
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metrics(auth)["requests_running"] == 1
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metrics(auth)["requests_running"]:
        time.sleep(0.1)
    metrics = server.metrics(auth)
    assert metrics["requests_running"] == 0 and metrics["kv_blocks_used"] == 0


def test_a_client_that_leaves_before_a_whole_answer_frees_its_blocks(server: ServerProcess) -> None:
    """Bug: a request that does not stream asked request.is_disconnected() only after 0.5 s without a token (and
    under the auth middleware that never turned true), so it ran on to max_tokens after its client had gone
    (test_api_inprocess.py has the in-process test)."""
    auth = {"Authorization": "Bearer test-key"}
    body = {"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 1500, "temperature": 0}
    before = server.metrics(auth)["generated_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=httpx.Timeout(60, read=2))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metrics(auth)["requests_running"]:
        time.sleep(0.1)
    metrics = server.metrics(auth)
    assert metrics["requests_running"] == 0 and metrics["kv_blocks_used"] == 0
    assert metrics["generated_tokens_total"] - before < 1500
    assert "Traceback" not in server.log()


BAD = [
    ({"model": "smollm2", "messages": []}, 400, "messages"),
    ({"model": "smollm2", "messages": "hi"}, 400, "messages"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "top_p": 1.5}, 400, "top_p"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, 400, "stop"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "n": 9}, 400, "n"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400, "stream"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "smollm2", "messages": [{"role": "user", "content": "hi " * 9000}]}, 400, "messages"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD)
def test_bad_requests_get_openai_errors_naming_the_field(server: ServerProcess, body: Any, status: int,
                                                         param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer test-key"},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"]


def test_the_default_weight_form_and_the_kv_dtype_are_printed_at_start(tmp_path: Path) -> None:
    """Without --weights the server picks the fastest accurate form for this CPU and says which; --kv-dtype
    bfloat16 fits twice the blocks in --kv-memory (16 MiB: 22 float32 blocks of 16 positions, 45 bfloat16)."""
    from attnkit.bench.serve import served_form

    need_smollm2()
    server = ServerProcess.attnkit("--kv-memory", "16", "--kv-dtype", "bfloat16", log=tmp_path / "server.log")
    try:
        assert f"({served_form()} weights, CPU capability" in server.log()  # what the serve bench's ceiling runs
        assert "(45 bfloat16 KV blocks of 16 positions)" in server.log()
    finally:
        server.stop()


def test_malformed_json_oversized_bodies_and_keys(server: ServerProcess) -> None:
    auth = {"Authorization": "Bearer test-key"}
    url = server.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=auth, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, content=b"[" + b"1," * 600_000 + b"1]", headers=auth, timeout=10)
    assert r.status_code == 413
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(server.url + "/v1/models", headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}  # open without a key
    assert httpx.get(server.url + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"] == "smollm2"


@pytest.mark.slow
def test_preemption_under_tiny_kv_memory_still_answers_correctly(tmp_path: Path) -> None:
    """6 requests of ~40 tokens each in room for about 3: the newest are preempted and recomputed later."""
    need_smollm2()
    server = ServerProcess.attnkit("--kv-memory", "9", "--max-batch", "6", "--weights", "float32",
                                   log=tmp_path / "server.log")  # 12 blocks
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def ask(question: str) -> str:
            reply = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=24,
                                                   messages=[{"role": "user", "content": question}])
            return str(reply.choices[0].message.content)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, QUESTIONS[:6]))
        for question, answer in zip(QUESTIONS[:6], answers, strict=True):
            _assert_same_or_near_tie(answer, [{"role": "user", "content": question}], 24)
        metrics = server.metrics()
        assert metrics["preemptions_total"] > 0 and metrics["kv_blocks_used"] == 0
        assert "Traceback" not in server.log()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_soak_of_short_requests_with_random_disconnects_leaves_every_block_free(server: ServerProcess) -> None:
    auth = {"Authorization": "Bearer test-key"}
    rng = random.Random(0)
    rss = []

    def one(i: int) -> None:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}],
                "max_tokens": 6, "temperature": 0.7, "seed": i, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth, timeout=60) as r:
            assert r.status_code == 200
            leave_after = rng.randint(1, 6) if i % 3 == 0 else None
            for n, _ in enumerate(r.iter_lines()):
                if leave_after is not None and n >= leave_after:
                    break

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for batch in range(4):
            list(pool.map(one, range(batch * 30, (batch + 1) * 30)))
            rss.append(server.rss_mib())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and server.metrics(auth)["requests_running"]:
        time.sleep(0.1)
    metrics = server.metrics(auth)
    assert metrics["kv_blocks_used"] == 0 and metrics["requests_waiting"] == 0
    assert "Traceback" not in server.log() and "ERROR" not in server.log()
    assert rss[-1] - rss[1] < 50, rss  # resident memory flat after the first round (MiB)
