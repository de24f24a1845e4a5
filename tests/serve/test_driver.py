"""One request's events read in the caller's thread from a running engine (attnkit.serve.driver): chat's loop."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

import pytest

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine
from attnkit.serve.driver import run_request
from tests.serve._engine import run_requests, tiny_engine, tiny_model

MODEL = tiny_model()


@pytest.fixture
def engine() -> Iterator[Engine]:
    engine = tiny_engine(MODEL)
    engine.start()
    yield engine
    engine.shutdown()


def test_a_request_gives_the_engines_tokens_and_a_later_prompt_finds_the_first(engine: Engine) -> None:
    options = GenerationOptions(max_new_tokens=7, temperature=0.9, seed=3)
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 6]
    expected, reason = run_requests(tiny_engine(MODEL), [prompt], [options])[0]
    answering = run_request(engine, prompt, options)
    events = list(answering)
    assert [t for e in events for t in e.token_ids] == expected
    assert events[-1].finish_reason == reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert answering.request.cached_tokens == 0 and list(answering) == []  # ended: no more events, no wait
    longer = [*prompt, *expected, 11, 12]  # the conversation goes on: the first turn's whole blocks are found
    again = run_request(engine, longer, GenerationOptions(max_new_tokens=2))
    list(again)
    assert again.request.cached_tokens == (len(prompt) + len(expected) - 1) // 4 * 4  # blocks of 4


@pytest.mark.parametrize("read", [0, 1])
def test_closing_early_cancels_the_request_and_frees_its_blocks(engine: Engine, read: int) -> None:
    """Closed before the first event (Ctrl-C right after submitting: the request ran on, unseen) or after one."""
    free = engine.blocks.free_blocks
    with closing(run_request(engine, [1, 2, 3, 4, 5, 6], GenerationOptions(max_new_tokens=100))) as answering:
        for _ in range(read):
            next(answering)
    assert answering.request.finished and answering.request.generated < 100
    assert engine.idle and engine.blocks.free_blocks == free


def test_an_engine_that_dies_ends_the_request_with_an_error_not_a_hang(engine: Engine,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(rows: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "forward", broken)
    events = list(run_request(engine, [1, 2, 3], GenerationOptions(max_new_tokens=5)))
    assert events[-1].finish_reason == "error" and "out of memory" in (events[-1].error or "")


def test_an_engine_not_started_is_refused() -> None:
    with pytest.raises(RuntimeError, match=r"engine\.start\(\) first"):
        run_request(tiny_engine(MODEL), [1, 2], GenerationOptions(max_new_tokens=2))
