"""Exact ring attention in real processes (gloo on 127.0.0.1): one spawn per world size serves every case.

Each world runs all cases of tests/distributed/workers.py once; each
parametrized test then checks its case on every rank. Every world is bounded
in time: the process group times out and the join has a deadline.
"""

from __future__ import annotations

import re
import time

import pytest
import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from attnkit.distributed import ContextParallel, ring_attention, shard_positions
from attnkit.distributed.launch import WorldTimeoutError, run_world

from . import modifier_cases, workers

WORLDS = (1, 2, 4)
_RESULTS: dict[int, list[dict[str, str]]] = {}


def _world_results(world: int) -> list[dict[str, str]]:
    if world not in _RESULTS:
        _RESULTS[world] = run_world(workers.run_cases, world, timeout_s=240, pg_timeout_s=60, threads=1)
    return _RESULTS[world]


def _names() -> list[str]:
    names = [workers.case_name("exact", *c[:3], f"H{c[3][0]}G{c[3][1]}", c[4]) for c in workers.EXACT_CASES]
    names += [workers.case_name("layer", *c) for c in workers.LAYER_CASES] + workers.OTHER_CASES
    names += modifier_cases.NAMES
    return names + [workers.case_name("error", kind) for kind in workers.ERROR_CASES]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", _names())
def test_ring_case_on_every_rank(world, case):
    """Outputs and gradients equal single-process attention (exact-*, with a scale too; mods-*: with score / mask
    modifiers at global positions and learned sinks), a layer whose backend is ContextParallel equals the
    single-process layer (layer-*, mods-layer-*), a block rule skips the pairs it hides (mods-skipping-*),
    ring_timing reads the ring's profiler ranges, and bad arguments raise the same ValueError on every rank
    (error-*)."""
    if world == 1 and case.startswith("error"):
        pytest.skip("ranks that disagree need two ranks")
    for rank, results in enumerate(_world_results(world)):
        assert results[case] == "ok", f"P={world}, rank {rank}, {case}:\n{results[case]}"


@pytest.mark.parametrize("how", ["die", "hang"])
def test_a_dead_or_hung_peer_fails_in_bounded_time(how):
    """Rank 1 exits with code 3 (or sleeps) while rank 0 waits in the ring: the world fails within the
    process-group timeout, with rank 1's exit or rank 0's communication error in the message."""
    start = time.monotonic()
    with pytest.raises((ProcessExitedException, ProcessRaisedException)) as failure:
        run_world(workers.hang_or_die, 2, args=(how,), timeout_s=60, pg_timeout_s=3, threads=1)
    expected = r"(?i)process 1 terminated with exit code 3|connection closed|timed? ?out|timeout"
    if how == "hang":
        expected = r"(?i)timed? ?out|timeout"
    assert re.search(expected, str(failure.value)), str(failure.value)[-2000:]
    assert time.monotonic() - start < 60


def test_a_world_that_never_finishes_is_killed_at_the_deadline():
    with pytest.raises(WorldTimeoutError, match=r"ranks \[.*\] of 2 were still running after 4 s"):
        run_world(workers.sleep_forever, 2, timeout_s=4, threads=1)


def test_without_a_process_group_every_entry_point_names_init_process_group():
    q = torch.zeros(1, 1, 2, 2)
    for call in (lambda: ring_attention(q, q, q), lambda: shard_positions(4, layout="zigzag"), ContextParallel):
        with pytest.raises(ValueError, match=r"torch\.distributed\.init_process_group"):
            call()


def test_unknown_layout_is_refused_before_any_communication():
    with pytest.raises(ValueError, match=r"layout must be one of 'contiguous', 'zigzag', got layout='ring'"):
        ContextParallel(layout="ring")
