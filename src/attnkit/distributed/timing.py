"""How long ring attention computes and waits: :func:`ring_timing`, and the ranges the ring marks its work with.

The ring wraps each piece's block kernels in :func:`timed` with
:data:`COMPUTE_EVENT` and each wait on communication with :data:`WAIT_EVENT`:
a ``torch.profiler.record_function`` range that any profiler sees, whose wall
time also goes to every open :func:`ring_timing` block, without a profiler.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch.profiler import record_function

COMPUTE_EVENT = "attnkit.ring.compute"  # torch.profiler range of each piece's block kernels
WAIT_EVENT = "attnkit.ring.wait"  # torch.profiler range of each wait on the ring's communication


@dataclass
class RingTimes:
    """Seconds spent computing blocks and waiting on communication (see :func:`ring_timing`)."""

    compute_s: float = 0.0
    wait_s: float = 0.0


_OPEN_TIMINGS: list[RingTimes] = []  # the ring_timing blocks open now, in any thread; empty outside them
_TIMINGS_LOCK = threading.Lock()


@contextmanager
def ring_timing() -> Iterator[RingTimes]:
    """This process's compute and wait time of every ring call in the block, as the ring runs.

    The ring marks its work with ``torch.profiler.record_function`` ranges
    (:data:`COMPUTE_EVENT`, :data:`WAIT_EVENT`), which any profiler sees
    (e.g. one that exports a trace); this block adds up their wall time
    itself, without a profiler (which would cost time and memory in the
    block, and leaves a thread of its own in the process). Work in every
    thread counts (a backward pass on an autograd device thread included);
    nested blocks each count all of it.
    """
    times = RingTimes()
    with _TIMINGS_LOCK:
        _OPEN_TIMINGS.append(times)
    try:
        yield times
    finally:
        with _TIMINGS_LOCK:
            _OPEN_TIMINGS[:] = [t for t in _OPEN_TIMINGS if t is not times]


@contextmanager
def timed(event: str) -> Iterator[None]:
    """A profiler range named ``event`` whose wall time goes to every open :func:`ring_timing` block."""
    start = time.perf_counter()
    try:
        with record_function(event):
            yield
    finally:
        if _OPEN_TIMINGS:
            elapsed = time.perf_counter() - start
            with _TIMINGS_LOCK:
                for times in _OPEN_TIMINGS:
                    if event == COMPUTE_EVENT:
                        times.compute_s += elapsed
                    else:
                        times.wait_s += elapsed
