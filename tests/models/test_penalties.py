"""Penalties on repeated tokens (OpenAI's frequency / presence, transformers' repetition) in generate() and the
serving engine, and the engine's logprobs: each against a float64 reference written out here.

Bugs these catch: a penalty applied to the wrong tokens (the prompt's for OpenAI's, padding), with the wrong
sign or at the wrong place (after temperature), counts that do not grow with the answer, the engine and
generate() disagreeing, logprobs of another distribution than the one sampled from.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnkit.models.generation_options import GenerationOptions
from tests.serve._engine import tiny_engine, tiny_model


def _penalised(model: Any, tokens: list[int], prompt: int, frequency: float, presence: float,
               repetition: float) -> torch.Tensor:
    """The next token's logits (V,) by a full forward, penalised by the definitions (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens]))[0, -1].double()  # (V,)
    answer = tokens[prompt:]
    for token in set(tokens):  # transformers: every token of the prompt and the answer
        logits[token] = logits[token] / repetition if logits[token] > 0 else logits[token] * repetition
    for token in set(answer):  # OpenAI: the answer's tokens only
        logits[token] -= answer.count(token) * frequency + presence
    return logits


def _reference(model: Any, prompt: list[int], n: int, frequency: float, presence: float,
               repetition: float) -> list[int]:
    """Greedy tokens by full forwards, each step's logits penalised by the definitions (float64)."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(_penalised(model, tokens, len(prompt), frequency, presence, repetition).argmax()))
    return tokens[len(prompt) :]


PENALTIES = [(1.5, 0.0, 1.0), (0.0, 2.0, 1.0), (0.0, 0.0, 3.0), (0.7, 0.5, 1.3), (-1.0, 0.0, 0.5)]


@pytest.mark.parametrize(("frequency", "presence", "repetition"), PENALTIES)
def test_generate_and_the_engine_penalise_as_the_definitions(frequency: float, presence: float,
                                                            repetition: float) -> None:
    model = tiny_model()
    prompt = [3, 7, 7, 9, 3, 1]
    want = _reference(model, prompt, 10, frequency, presence, repetition)
    options = {"max_new_tokens": 10, "frequency_penalty": frequency, "presence_penalty": presence,
               "repetition_penalty": repetition}
    out = model.generate(torch.tensor([prompt]), stop_ids=[], **options)
    assert out[0, len(prompt) :].tolist() == want
    engine, events = tiny_engine(model), []
    engine.submit(prompt, GenerationOptions(**options), events.append)
    while not engine.idle:
        engine.step()
    assert [t for e in events for t in e.token_ids] == want


def test_repetition_penalty_changes_a_looping_greedy_answer() -> None:
    """The tiny model loops on one token; a penalty that never applied would leave the loop."""
    model = tiny_model()
    prompt = torch.tensor([[3, 7, 7, 9, 3, 1]])
    plain = model.generate(prompt, max_new_tokens=10, stop_ids=[])
    penalised = model.generate(prompt, max_new_tokens=10, stop_ids=[], repetition_penalty=3.0)
    assert len(set(plain[0, 6:].tolist())) == 1 and len(set(penalised[0, 6:].tolist())) > 1


def test_left_padding_is_not_a_seen_token() -> None:
    """Bug: the pad id of a left-padded row counted as a prompt token for the repetition penalty."""
    model = tiny_model()
    prompt = [3, 7, 9, 4]
    alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, stop_ids=[], repetition_penalty=5.0)
    ids = torch.tensor([[0, 0, *prompt], [5, 6, 8, 2, 1, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    batch = model.generate(ids, mask, max_new_tokens=6, stop_ids=[], repetition_penalty=5.0)
    assert batch[0, 6:].tolist() == alone[0, 4:].tolist()


@pytest.mark.parametrize(("frequency", "presence", "repetition"), PENALTIES)
def test_engine_logprobs_are_the_log_softmax_of_the_penalised_logits(frequency: float, presence: float,
                                                                    repetition: float) -> None:
    """Sampled at temperature 1.3: logprobs of the distribution before temperature, after every penalty (a
    penalty not applied, or applied to the wrong tokens, moves them)."""
    model = tiny_model()
    prompt = [3, 7, 9, 4]
    engine, events = tiny_engine(model), []
    options = GenerationOptions(max_new_tokens=6, temperature=1.3, seed=2, logprobs=3, frequency_penalty=frequency,
                                presence_penalty=presence, repetition_penalty=repetition)
    engine.submit(prompt, options, events.append)
    while not engine.idle:
        engine.step()
    choices = [c for e in events for c in e.logprobs]
    tokens = [c.token for c in choices]
    assert len(choices) == 6
    for i, choice in enumerate(choices):
        logp = _penalised(model, prompt + tokens[:i], len(prompt), frequency, presence, repetition).log_softmax(-1)
        torch.testing.assert_close(choice.logprob, float(logp[choice.token]), atol=1e-9, rtol=0)
        top = logp.topk(3)  # (3,)
        assert [t for t, _ in choice.top] == top.indices.tolist()
        torch.testing.assert_close([v for _, v in choice.top], top.values.tolist(), atol=1e-9, rtol=0)


@pytest.mark.parametrize(("options", "message"), [
    ({"frequency_penalty": 2.5}, r"frequency_penalty must be a number in \[-2, 2\], got frequency_penalty=2.5"),
    ({"presence_penalty": "1"}, "presence_penalty='1'"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be a finite number > 0 .* got repetition_penalty=0.0"),
    ({"logprobs": 21}, r"logprobs must be None or an int in \[0, 20\], got logprobs=21"),
])
def test_bad_penalties_and_logprobs_are_refused_by_name(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GenerationOptions(**options)


def test_generate_refuses_logprobs_it_cannot_return() -> None:
    with pytest.raises(ValueError, match=r"logprobs=2: generate\(\) returns token ids only"):
        tiny_model().generate(torch.tensor([[1, 2]]), max_new_tokens=2, logprobs=2)
