"""Start P local processes in one gloo (or NCCL) process group, bounded in time: for tests and benchmarks.

``torchrun`` is the way to launch real jobs; this helper lets a test or a
benchmark start its own world on 127.0.0.1 and always come back: a rank that
raises, dies or hangs makes :func:`run_world` raise with a message, never
wait forever (the process group has a timeout and the join a deadline).
"""

from __future__ import annotations

import os
import queue as queue_module
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class WorldTimeoutError(RuntimeError):
    """Some rank was still running at the deadline (a hung peer); every rank was killed."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, pg_timeout_s: float,
            threads: int, results: Any, args: tuple[Any, ...]) -> None:
    if Path("/sys/class/net/lo").exists():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on the loopback, never a real network
    torch.set_num_threads(threads)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout_s))
    try:
        results.put((rank, fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world: int, *, args: tuple[Any, ...] = (), timeout_s: float = 120.0,
              pg_timeout_s: float = 30.0, backend: str = "gloo", threads: int | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; return each rank's result, by rank.

    ``fn`` must be importable (a module-level function) and its result
    picklable and small. A rank that raises makes this raise its traceback
    (``torch.multiprocessing.ProcessRaisedException``); one that exits
    raises ``ProcessExitedException``; if any rank still runs after
    ``timeout_s``, every rank is killed and :class:`WorldTimeoutError` names
    them. ``threads``: torch threads per rank (default: the cores divided
    among the ranks).
    """
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.start_processes(_worker, args=(fn, world, free_port(), backend, pg_timeout_s, threads, results, args),
                               nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    try:
        while not procs.join(timeout=0.2):
            _drain(results, collected)
            if time.monotonic() > deadline:
                alive = [r for r, p in enumerate(procs.processes) if p.is_alive()]
                raise WorldTimeoutError(f"ranks {alive} of {world} were still running after {timeout_s:g} s "
                                        "(a hung peer?); all were killed")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    _drain(results, collected)
    while len(collected) < world:  # a result still in the pipe after its rank exited
        try:
            rank, value = results.get(timeout=2)
        except queue_module.Empty:
            break
        collected[rank] = value
    missing = sorted(set(range(world)) - set(collected))
    if missing:
        raise RuntimeError(f"ranks {missing} exited without a result")
    return [collected[r] for r in range(world)]


def _drain(results: Any, collected: dict[int, Any]) -> None:
    while True:
        try:
            rank, value = results.get_nowait()
        except queue_module.Empty:
            return
        collected[rank] = value
