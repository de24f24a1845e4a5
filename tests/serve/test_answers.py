"""Answers shaped in OpenAI's format (attnkit.serve.answers): usage over a request's n choices, whole and streamed,
in process over the tiny float64 decoder of test_engine."""

from __future__ import annotations

import json
from typing import Any

import pytest

from attnkit.serve.api import Server, create_app
from tests._util import need
from tests.serve._engine import Words, tiny_engine, tiny_model

testclient = need("fastapi.testclient")


def _usage(client: Any, body: dict[str, Any]) -> dict[str, Any]:
    if not body.get("stream"):
        return dict(client.post("/v1/completions", json=body).json()["usage"])
    with client.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return dict(chunks[-1]["usage"])


@pytest.mark.parametrize("stream", [False, True])
def test_with_n_choices_cached_tokens_are_of_the_prompt_counted_once(stream: bool) -> None:
    """With n > 1, prompt_tokens counts the prompt once (as OpenAI's does), and cached_tokens counts what of that one
    prompt the prefix cache served before the request: the blocks its choices share with the first one are the one
    prefill, not a cache hit. Bug to catch: summing every choice's hits (8 for each of two siblings) reports more
    cached tokens than the prompt has, and a first request that computed its whole prompt as served from cache."""
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        client = testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128)))
        body: dict[str, Any] = {"model": "tiny", "prompt": " ".join(["one", "two", "three"] * 4), "max_tokens": 2,
                                "n": 3, "seed": 1}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        first, again = _usage(client, body), _usage(client, body)
    finally:
        engine.shutdown()
    assert first == {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert again["prompt_tokens_details"] == {"cached_tokens": 8}  # the last full block is recomputed for logits
