"""Ring attention at scale: memory per rank, compute vs waiting, zigzag vs contiguous balance.

    python -m attnkit.bench.ring [--seq-lens 4096,8192] [--world-sizes 1,2,4] [--json out.json]

Each world size starts its own gloo processes on 127.0.0.1
(:func:`attnkit.distributed.launch.run_world`). Per rank and case it
measures the median time of a call, the part of it spent computing blocks
and the part spent waiting on communication (:func:`attnkit.distributed.ring_timing`),
and the peak resident memory of the rank during the call above what the
process held before its inputs were made (Linux's VmHWM, reset per case), so
the rank's shards and gradients count (one torch thread per rank). Under causal attention the per-rank
compute time of each layout gives its imbalance (max over mean).

With few cores, more processes cannot be faster: they share the same cores.
What this shows is memory per rank (expected to fall as 1/P: the log-log
slope against P is reported) and balance.

Legend: B batch (1), H heads, T whole sequence, P ranks, n = T / P, D head dim.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from attnkit.bench.memory import _reset_cpu_peak, _status_kib
from attnkit.bench.report import env_text
from attnkit.bench.runner import cpu_record
from attnkit.distributed import ring_attention, ring_timing
from attnkit.distributed.launch import run_world


def _one_case(t: int, world: int, layout: str, mode: str, d_model: int, heads: int, repeats: int) -> dict[str, Any]:
    """This rank's measurements of one (T, layout, mode)."""
    import gc

    gc.collect()
    before = _status_kib("VmRSS")
    n, d = t // world, d_model // heads
    grad = mode == "forward+backward"
    q, k, v = (torch.randn(1, heads, n, d, requires_grad=grad) for _ in range(3))  # (B, H, n, D)

    def call() -> None:
        with torch.set_grad_enabled(grad):
            out = ring_attention(q, k, v, causal=True, layout=layout)
            if grad:
                out.sum().backward()

    call()  # warm-up
    _reset_cpu_peak()
    times, computes, waits = [], [], []
    for _ in range(repeats):
        with ring_timing() as spent:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        computes.append(spent.compute_s)
        waits.append(spent.wait_s)
    peak = _status_kib("VmHWM") - before
    return dict(time_s=statistics.median(times), compute_s=statistics.median(computes),
                wait_s=statistics.median(waits), peak_mib=peak / 1024)


def _world_worker(rank: int, world: int, seq_lens: Sequence[int], modes: Sequence[str], layouts: Sequence[str],
                  d_model: int, heads: int, repeats: int) -> list[dict[str, Any]]:
    small = torch.randn(1, heads, 2 * world, d_model // heads)
    ring_attention(small, small, small, causal=True)  # thread pools and buffers of the process group
    rows = []
    for t in sorted(seq_lens):
        for mode in modes:
            for layout in layouts:
                rows.append(dict(T=t, P=world, mode=mode, layout=layout, rank=rank,
                                 **_one_case(t, world, layout, mode, d_model, heads, repeats)))
    return rows


def summarise(per_rank: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (T, P, mode, layout) from the ranks' measurements (``time_s``, ``compute_s``, ``wait_s``,
    ``peak_mib`` each): the slowest rank's time, the largest rank's memory, every rank's compute and wait in
    milliseconds, and the compute imbalance (max over mean)."""
    keys = sorted({(r["T"], r["P"], r["mode"], r["layout"]) for r in per_rank})
    rows = []
    for t, p, mode, layout in keys:
        ranks = [r for r in per_rank if (r["T"], r["P"], r["mode"], r["layout"]) == (t, p, mode, layout)]
        computes = [r["compute_s"] for r in ranks]
        rows.append(dict(T=t, P=p, mode=mode, layout=layout, time_ms=1e3 * max(r["time_s"] for r in ranks),
                         compute_ms=[round(1e3 * c, 1) for c in computes],
                         wait_ms=[round(1e3 * r["wait_s"], 1) for r in ranks],
                         peak_mib_per_rank=max(r["peak_mib"] for r in ranks),
                         imbalance=max(computes) / statistics.mean(computes)))
    return rows


def memory_slopes(rows: list[dict[str, Any]]) -> dict[tuple[int, str, str], float]:
    """Least-squares slope of log(peak memory per rank) against log(P), per (T, mode, layout); -1 is 1/P."""
    slopes = {}
    for key in sorted({(r["T"], r["mode"], r["layout"]) for r in rows}):
        pts = [(math.log(r["P"]), math.log(r["peak_mib_per_rank"])) for r in rows
               if (r["T"], r["mode"], r["layout"]) == key and r["peak_mib_per_rank"] > 0]
        if len(pts) >= 2:
            mx, my = statistics.mean(x for x, _ in pts), statistics.mean(y for _, y in pts)
            slopes[key] = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return slopes


def run_ring_suite(*, seq_lens: Sequence[int] = (4096, 8192, 16384), world_sizes: Sequence[int] = (1, 2, 4),
                   d_model: int = 768, heads: int = 12, modes: Sequence[str] = ("forward", "forward+backward"),
                   layouts: Sequence[str] = ("zigzag", "contiguous"), repeats: int = 3,
                   timeout_s: float = 3600) -> list[dict[str, Any]]:
    """Run every (T, P, mode, layout), causal, float32, B = 1; one row per case (see the module docstring)."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed large blocks leave the resident set
    per_rank: list[dict[str, Any]] = []
    for world in world_sizes:
        args = (tuple(seq_lens), tuple(modes), tuple(layouts), d_model, heads, repeats)
        for rows in run_world(_world_worker, world, args=args, timeout_s=timeout_s, pg_timeout_s=600, threads=1):
            per_rank.extend(rows)
    return summarise(per_rank)


def memory_slope_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`memory_slopes` as rows of their own kind, for the bench's report."""
    return [{"kind": "memory per rank vs P (log-log slope; -1 = 1/P)", "T": t, "mode": mode, "layout": layout,
             "slope": round(slope, 2)} for (t, mode, layout), slope in memory_slopes(rows).items()]


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'T':>6} {'P':>2} {'mode':<17} {'layout':<10} {'ms/call':>9} {'MiB/rank':>9} {'imbal':>6}  "
            "compute ms / wait ms per rank")
    lines = [head, "-" * len(head)]
    for r in rows:
        split = ", ".join(f"{c:g}/{w:g}" for c, w in zip(r["compute_ms"], r["wait_ms"], strict=True))
        lines.append(f"{r['T']:>6} {r['P']:>2} {r['mode']:<17} {r['layout']:<10} {r['time_ms']:>9.1f} "
                     f"{r['peak_mib_per_rank']:>9.1f} {r['imbalance']:>6.2f}  {split}")
    lines.append("")
    lines.append("log-log slope of peak MiB per rank against P (-1 = falls as 1/P):")
    for (t, mode, layout), slope in memory_slopes(rows).items():
        lines.append(f"  T={t} {mode} {layout}: {slope:+.2f}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench.ring", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="4096,8192,16384")
    parser.add_argument("--world-sizes", default="1,2,4")
    parser.add_argument("--modes", default="forward,forward+backward")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    ints = lambda s: tuple(int(x) for x in s.split(","))  # noqa: E731
    cpu = cpu_record()
    rows = [{**row, **cpu} for row in run_ring_suite(seq_lens=ints(args.seq_lens), world_sizes=ints(args.world_sizes),
                                                     modes=tuple(args.modes.split(",")), repeats=args.repeats)]
    print(env_text({"torch": torch.__version__, "machine": platform.machine(), **cpu, "cpu_count": os.cpu_count(),
                    "case": "float32, causal, B=1, d_model=768, 12 heads", "transport": "gloo on 127.0.0.1"}))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
