"""The engine's penalties over long answers: each request's (counts, seen) kept and updated one token a step, a
preempted request's too, give the tokens generate() gives with the same penalties."""

from __future__ import annotations

import gc

import pytest
import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import PagedKVPool
from attnkit.serve.runner import History
from tests.serve._engine import run_requests, tiny_engine, tiny_model

# strong enough for the tiny model, whose logits span about 50: each set changes most answers
PENALTIES = [dict(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3),
             dict(frequency_penalty=2.0, presence_penalty=-1.0),
             dict(frequency_penalty=0.5, repetition_penalty=4.0)]


def _alone(model: torch.nn.Module, prompt: list[int], p: GenerationOptions) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                         top_p=p.top_p, seed=p.seed, stop_ids=[], frequency_penalty=p.frequency_penalty,
                         presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty)
    return out[0, len(prompt):].tolist()


def _options(i: int, **penalties: float) -> GenerationOptions:
    if i % 2:
        return GenerationOptions(max_new_tokens=60, temperature=0.0, **penalties)
    return GenerationOptions(max_new_tokens=60, temperature=1.2, top_p=0.95, seed=i, **penalties)


@pytest.mark.parametrize("penalties", PENALTIES)
def test_penalised_long_answers_equal_generate_alone(penalties: dict[str, float]) -> None:
    """Stale counts (a history built once and never updated, or updated twice a step) change a long answer."""
    model = tiny_model()
    engine = tiny_engine(model, max_batch=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 11, 6, 17)]
    params = [_options(i, **penalties) for i in range(len(prompts))]
    results = run_requests(engine, prompts, params)
    for prompt, p, (tokens, reason) in zip(prompts, params, results, strict=True):
        assert len(tokens) == 60 and reason == "length"
        assert tokens == _alone(model, prompt, p)
    plain = run_requests(tiny_engine(model, max_batch=4), prompts, [_options(i) for i in range(len(prompts))])
    changed = sum(a != b for (a, _), (b, _) in zip(plain, results, strict=True))
    assert changed >= 2  # the penalties change answers: the comparison above means something


def test_a_preempted_penalised_request_recomputes_and_keeps_its_counts() -> None:
    """A preempted request keeps its tokens and its history: counting its tokens again when it comes back (or
    losing the answer's counts) would change the rest of its answer."""
    model = tiny_model()
    per_block = PagedKVPool.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                                            dtype=torch.float64)
    engine = tiny_engine(model, kv_memory_mib=24 * per_block / 2**20, max_batch=4)  # 24 blocks, each answer needs 17
    prompts = [[i + 1] * 7 for i in range(4)]
    params = [_options(i, **PENALTIES[i % len(PENALTIES)]) for i in range(4)]
    results = run_requests(engine, prompts, params)
    assert engine.metrics()["preemptions_total"] > 0
    for prompt, p, (tokens, _) in zip(prompts, params, results, strict=True):
        assert tokens == _alone(model, prompt, p)
    gc.collect()
    assert not engine.runner.histories  # a finished request's history goes with it


def test_a_history_counts_the_answer_and_sees_the_prompt_token_by_token() -> None:
    """The incremental history equals one built from all the tokens at once, whatever the steps' sizes."""
    engine = tiny_engine(tiny_model())
    request = engine.submit([4, 4, 9], GenerationOptions(max_new_tokens=8), lambda event: None)
    history = History(torch.zeros(50), torch.zeros(50, dtype=torch.bool))
    for token in (9, 9, 2, 4, 7):
        history.update(request)
        request.tokens.append(token)
    history.update(request)
    history.update(request)  # nothing new: nothing counted twice
    counts = torch.zeros(50)
    counts[[9, 2, 4, 7]] = torch.tensor([2.0, 1, 1, 1])
    torch.testing.assert_close(history.counts, counts, rtol=0, atol=0)
    assert history.seen.nonzero().flatten().tolist() == [2, 4, 7, 9]
