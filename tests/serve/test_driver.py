"""The engine stepped from the caller's thread (attnkit.serve.driver): attnkit chat's loop."""

from __future__ import annotations

import pytest

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve.driver import run_request
from tests.serve._engine import run_requests, tiny_engine, tiny_model


def test_a_request_run_here_gives_the_engines_tokens_and_a_later_prompt_finds_the_first() -> None:
    model = tiny_model()
    options = GenerationOptions(max_new_tokens=7, temperature=0.9, seed=3)
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 6]
    expected = run_requests(tiny_engine(model), [prompt], [options])[0]
    engine = tiny_engine(model)
    answering = run_request(engine, prompt, options)
    events = list(answering)
    assert [t for e in events for t in e.token_ids] == expected[0]
    assert events[-1].finish_reason == expected[1] == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert answering.request.cached_tokens == 0
    longer = [*prompt, *expected[0], 11, 12]  # the conversation goes on: the first turn's whole blocks are found
    again = run_request(engine, longer, GenerationOptions(max_new_tokens=2))
    list(again)
    assert again.request.cached_tokens == (len(prompt) + len(expected[0]) - 1) // 4 * 4  # blocks of 4


def test_leaving_early_cancels_the_request_and_frees_its_blocks() -> None:
    engine = tiny_engine(tiny_model())
    free = engine.blocks.free_blocks
    events = iter(run_request(engine, [1, 2, 3, 4, 5, 6], GenerationOptions(max_new_tokens=50)))
    next(events)
    events.close()  # what a Ctrl-C between two tokens does (attnkit chat closes the iterator)
    assert engine.idle and engine.blocks.free_blocks == free


def test_an_interrupted_step_leaves_an_engine_that_answers_the_next_request() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    step, calls = engine.step, []

    def interrupted() -> None:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C inside the second step
        step()

    engine.step = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        list(run_request(engine, [1, 2, 3, 4, 5], GenerationOptions(max_new_tokens=9)))
    engine.step = step  # type: ignore[method-assign]
    assert engine.idle
    options = GenerationOptions(max_new_tokens=5)
    got = [t for e in run_request(engine, [7, 8, 9], options) for t in e.token_ids]
    assert got == run_requests(tiny_engine(model), [[7, 8, 9]], [options])[0][0]


def test_an_engine_running_in_its_own_thread_is_refused() -> None:
    engine = tiny_engine(tiny_model())
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="runs in its own thread"):
            run_request(engine, [1, 2], GenerationOptions(max_new_tokens=2))
    finally:
        engine.shutdown()
