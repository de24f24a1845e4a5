"""The engine with a sink window (``Engine(cache="sink:...")``, ``attnkit serve --cache sink:...``): each request
keeps its first tokens and a recent window in the paged pool, and answers as ``generate(cache=...)`` does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve.api import Server, create_app
from attnkit.serve.paged import PagedKVPool
from tests._util import need
from tests.serve._engine import Words, run_requests, tiny_engine, tiny_model

testclient = need("fastapi.testclient")

MODEL = tiny_model()  # float64: the paged and the dense cache round alike, so sampled tokens match exactly
HOT = 8.0  # the tiny random model repeats its last token at temperature 1; hot sampling makes every step count


def alone(prompt: list[int], cache: str, max_new_tokens: int, seed: int) -> list[int]:
    """What ``generate`` samples for one prompt with the same window and seed."""
    out = MODEL.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=max_new_tokens, temperature=HOT,
                         seed=seed)
    return out[0, len(prompt) :].tolist()


def test_every_request_samples_what_generate_samples_with_the_same_window() -> None:
    """Prompts longer than the window (fed in generate's pieces), answers past the model's context of 128: each
    request of a batch equals generate alone, and a full cache would have answered otherwise."""
    cache = "sink:4,12,4"  # 19 positions at most
    prompts = [list(range(1, 31)), list(range(5, 12)), [3, 7, 9] * 15]
    lengths = [150, 40, 20]
    options = [GenerationOptions(max_new_tokens=n, temperature=HOT, seed=s) for s, n in enumerate(lengths)]
    results = run_requests(tiny_engine(MODEL, cache=cache, token_budget=8), prompts, options)
    for prompt, option, (tokens, reason) in zip(prompts, options, results, strict=True):
        assert reason == "length" and len(tokens) == option.max_new_tokens
        assert tokens == alone(prompt, cache, option.max_new_tokens, option.seed)
    full = MODEL.generate(torch.tensor([prompts[0]]), max_new_tokens=60, temperature=HOT, seed=0)[0, 30:].tolist()
    assert results[0][0][:60] != full  # the window was in use


@settings(max_examples=12, deadline=None)
@given(sinks=st.integers(1, 4), window=st.integers(2, 10), chunk=st.integers(1, 6), prompt_len=st.integers(1, 40),
       new=st.integers(1, 40), budget=st.integers(1, 10), requests=st.integers(1, 3))
def test_any_window_and_budget_answer_as_generate(sinks: int, window: int, chunk: int, prompt_len: int, new: int,
                                                  budget: int, requests: int) -> None:
    """Any window, chunk, prompt length, prefill budget (below a chunk too: a piece cut by the budget evicts as
    the whole piece) and number of answers to the prompt: each is generate's."""
    cache = f"sink:{sinks},{window},{chunk}"
    prompt = [(7 * i + 3) % 50 for i in range(prompt_len)]
    engine = tiny_engine(MODEL, cache=cache, token_budget=budget)
    options = [GenerationOptions(max_new_tokens=new, temperature=HOT, seed=5 + i) for i in range(requests)]
    for i, (tokens, _) in enumerate(run_requests(engine, [prompt] * requests, options)):
        assert tokens == alone(prompt, cache, new, 5 + i)


@pytest.mark.parametrize("together", [True, False])
def test_answers_to_one_prompt_share_its_prefill_and_each_still_samples_as_generate(together: bool) -> None:
    """n answers (together) or a later request (after the first finished) reuse the prompt's cached blocks while it
    fits the window; at an answer's first eviction the blocks it shares are copied first, so no answer's
    evictions move another's keys (a missing copy changes the other answers' tokens)."""
    cache, prompt = "sink:4,12,4", [(5 * i + 1) % 50 for i in range(17)]  # 4 full blocks of 4, within the window
    engine = tiny_engine(MODEL, cache=cache, token_budget=8)
    seeds = [11, 12, 13]
    options = [GenerationOptions(max_new_tokens=40, temperature=HOT, seed=s) for s in seeds]
    if together:
        results = run_requests(engine, [prompt] * 3, options)
    else:
        results = [run_requests(engine, [prompt], [option])[0] for option in options]
    for seed, (tokens, _) in zip(seeds, results, strict=True):
        assert tokens == alone(prompt, cache, 40, seed)
    metrics = engine.metrics()
    assert metrics["prompt_tokens_total"] == 17 + 2 * 1  # the others recompute the last token only
    assert metrics["kv_blocks_free"] == metrics["kv_blocks"]


@pytest.mark.parametrize(("cache", "blocks"), [("sink:4,12,4", 5), ("sink:4,9,4", 4)])  # 19 and 16 positions
@pytest.mark.parametrize("prompt_len", [3, 40])
def test_a_request_holds_at_most_its_window_in_blocks_whatever_its_length(cache: str, blocks: int,
                                                                          prompt_len: int) -> None:
    engine = tiny_engine(MODEL, cache=cache, token_budget=8)  # blocks of 4 positions
    done: list[str] = []
    engine.submit(list(range(1, prompt_len + 1)), GenerationOptions(max_new_tokens=200),
                  lambda event: done.append(event.finish_reason or ""))
    most = 0
    while not engine.idle:
        engine.step()
        most = max(most, int(engine.metrics()["kv_blocks_used"]))
    assert done[-1] == "length" and len(done) == 200 + 1  # one event per token, then the end
    assert most == blocks
    assert engine.metrics()["kv_blocks_free"] == engine.metrics()["kv_blocks"]


def test_preempted_sink_requests_still_finish_and_free_their_blocks() -> None:
    """A pool of 12 blocks for four requests of up to 5: preemption recomputes a request's tokens from the start."""
    block = PagedKVPool.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)
    engine = tiny_engine(MODEL, cache="sink:4,12,4", token_budget=8, kv_memory_mib=12 * block / 2**20)
    assert engine.metrics()["kv_blocks"] == 12
    prompts = [list(range(i, i + 6)) for i in range(4)]  # admitted in 2 blocks each, growing to 5
    results = run_requests(engine, prompts, [GenerationOptions(max_new_tokens=60, temperature=HOT, seed=1)] * 4)
    assert all(reason == "length" and len(tokens) == 60 for tokens, reason in results)
    metrics = engine.metrics()
    assert metrics["preemptions_total"] > 0 and metrics["kv_blocks_free"] == 12


def test_a_window_takes_prompts_and_answers_longer_than_the_context_or_the_pool() -> None:
    """Without a window, a prompt past the context is refused at the door; with one it is served."""
    engine = tiny_engine(MODEL, cache="sink:4,12,4", kv_memory_mib=0.01)
    assert engine.capacity < 200
    [(tokens, reason)] = run_requests(engine, [list(range(50)) * 4], [GenerationOptions(max_new_tokens=150)])
    assert reason == "length" and len(tokens) == 150
    with pytest.raises(ValueError, match="more than the model's context length"):
        tiny_engine(MODEL).submit(list(range(50)) * 4, GenerationOptions(max_new_tokens=1), lambda event: None)


def test_the_server_answers_past_the_context_with_a_window_within_a_bound() -> None:
    """With a window, max_tokens may pass the context (128 here; by default an answer is one context long) up to
    2**17; beyond, a 400 names the field (an answer that never ends would hold its slot for good)."""
    engine = tiny_engine(MODEL, cache="sink:4,12,4")
    engine.start()
    try:
        client = testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128)))
        body = {"model": "tiny", "prompt": "a bb ccc", "temperature": 0}
        long = client.post("/v1/completions", json=body | {"max_tokens": 300})
        default = client.post("/v1/completions", json=body)
        endless = client.post("/v1/completions", json=body | {"max_tokens": 2**17 + 1})
    finally:
        engine.shutdown()
    assert long.status_code == 200 and long.json()["usage"]["completion_tokens"] == 300
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] == 128
    assert endless.status_code == 400 and endless.json()["error"]["param"] == "max_tokens"
    assert "at most 131072" in endless.json()["error"]["message"]
