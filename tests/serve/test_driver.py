"""One request run to its end by stepping the engine in the caller's thread (attnkit.serve.driver): chat's loop."""

from __future__ import annotations

import os
import signal
from contextlib import closing
from typing import Any

import pytest

from attnkit.models.generation_options import GenerationOptions
from attnkit.serve.driver import run_request
from tests.serve._engine import run_requests, tiny_engine, tiny_model

MODEL = tiny_model()


def test_a_request_gives_the_engines_tokens_and_a_later_prompt_finds_the_first() -> None:
    engine = tiny_engine(MODEL)
    options = GenerationOptions(max_new_tokens=7, temperature=0.9, seed=3)
    prompt = [5, 9, 2, 7, 1, 3, 8, 4, 6]
    expected, reason = run_requests(tiny_engine(MODEL), [prompt], [options])[0]
    answering = run_request(engine, prompt, options)
    events = list(answering)
    assert [t for e in events for t in e.token_ids] == expected
    assert events[-1].finish_reason == reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert answering.request.cached_tokens == 0 and list(answering) == []  # ended: no more events, no step
    longer = [*prompt, *expected, 11, 12]  # the conversation goes on: the first turn's whole blocks are found
    again = run_request(engine, longer, GenerationOptions(max_new_tokens=2))
    list(again)
    assert again.request.cached_tokens == (len(prompt) + len(expected) - 1) // 4 * 4  # blocks of 4


@pytest.mark.parametrize("read", [0, 1])
def test_closing_early_cancels_the_request_and_frees_its_blocks(read: int) -> None:
    """Closed before the first event (Ctrl-C right after submitting: it would run on, unseen) or after one."""
    engine = tiny_engine(MODEL)
    free = engine.blocks.free_blocks
    with closing(run_request(engine, [1, 2, 3, 4, 5, 6], GenerationOptions(max_new_tokens=100))) as answering:
        for _ in range(read):
            next(answering)
    assert answering.request.finished and answering.request.generated < 100
    assert engine.idle and engine.blocks.free_blocks == free


def test_ctrl_c_during_a_step_is_raised_after_it_and_the_engine_answers_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT arrives inside a step's forward: the step ends whole, then KeyboardInterrupt; closing cancels the
    request, every block is free, and the next request answers as it would alone."""
    engine = tiny_engine(MODEL)
    forward, calls = engine.runner.forward, []

    def interrupted(rows: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, in the middle of the third step
        return forward(rows)

    monkeypatch.setattr(engine.runner, "forward", interrupted)
    answering = run_request(engine, [1, 2, 3, 4, 5], GenerationOptions(max_new_tokens=9))
    seen = []
    with pytest.raises(KeyboardInterrupt):
        for event in answering:
            seen += event.token_ids
    assert len(seen) == 2 and answering.request.generated == 3  # the third step sampled its token, whole
    answering.close()
    assert answering.request.finished and engine.idle and engine.blocks.free_blocks == engine.blocks.num_blocks
    options = GenerationOptions(max_new_tokens=5)
    got = [t for e in run_request(engine, [7, 8, 9], options) for t in e.token_ids]
    assert got == run_requests(tiny_engine(MODEL), [[7, 8, 9]], [options])[0][0]


def test_ctrl_c_held_back_restores_the_handler_and_an_ignored_one_stays_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step the SIGINT handler is the one before it (after an error too); a process that ignores
    SIGINT (started in the background) answers on through one."""
    engine = tiny_engine(MODEL)
    before = signal.getsignal(signal.SIGINT)
    list(run_request(engine, [1, 2, 3], GenerationOptions(max_new_tokens=3)))
    assert signal.getsignal(signal.SIGINT) is before
    forward = engine.runner.forward

    def interrupted(rows: Any) -> Any:
        os.kill(os.getpid(), signal.SIGINT)
        return forward(rows)

    monkeypatch.setattr(engine.runner, "forward", interrupted)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        events = list(run_request(engine, [1, 2, 3], GenerationOptions(max_new_tokens=3)))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason == "length"


def test_a_request_that_stops_moving_ends_with_an_error_and_is_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(MODEL)
    monkeypatch.setattr(engine, "step_or_die", lambda: True)  # steps that do nothing
    answering = run_request(engine, [1, 2, 3], GenerationOptions(max_new_tokens=3))
    events = list(answering)
    assert len(events) == 1 and events[0].finish_reason == "error" and "did not move" in (events[0].error or "")
    monkeypatch.undo()
    assert answering.request.cancelled
    engine.step()  # the engine drops it
    assert engine.idle and engine.blocks.free_blocks == engine.blocks.num_blocks


def test_an_engine_that_dies_ends_the_request_with_an_error_not_a_hang(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = tiny_engine(MODEL)

    def broken(rows: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "forward", broken)
    events = list(run_request(engine, [1, 2, 3], GenerationOptions(max_new_tokens=5)))
    assert events[-1].finish_reason == "error" and "out of memory" in (events[-1].error or "")
    assert not engine.alive


def test_an_engine_running_its_own_thread_is_refused() -> None:
    engine = tiny_engine(MODEL)
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="runs its own"):
            run_request(engine, [1, 2], GenerationOptions(max_new_tokens=2))
    finally:
        engine.shutdown()
