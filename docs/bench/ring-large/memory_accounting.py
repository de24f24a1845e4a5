"""Where a rank's peak memory goes, in units of one (1, 12, n, 64) float32 tensor (n = T / P positions).

    python docs/bench/ring-large/memory_accounting.py [P ...]   # default 1 2 4; T = 16384, forward, zigzag

Per world size: the rank's q, k, v, and its peak resident set during a
no-grad ring_attention call above what it held before (after a warm-up
call), in MiB and in units.
"""

import os
import sys

import torch

from attnkit.bench.memory import _reset_cpu_peak, _status_kib
from attnkit.distributed import ring_attention
from attnkit.distributed.launch import run_world

T = 16384


def work(rank: int, world: int, t: int) -> dict:
    n = t // world
    small = torch.randn(1, 12, 2 * world, 64)
    ring_attention(small, small, small, causal=True)  # the process group's buffers
    before = _status_kib("VmRSS")
    q, k, v = (torch.randn(1, 12, n, 64) for _ in range(3))
    inputs = (_status_kib("VmRSS") - before) / 1024
    with torch.no_grad():
        ring_attention(q, k, v, causal=True)  # warm-up
        _reset_cpu_peak()
        ring_attention(q, k, v, causal=True)
    peak = (_status_kib("VmHWM") - before) / 1024
    unit = n * 12 * 64 * 4 / 2**20
    return dict(P=world, rank=rank, n=n, unit_mib=unit, qkv_mib=round(inputs, 1),
                peak_above_qkv_mib=round(peak - inputs, 1), units=round((peak - inputs) / unit, 2))


if __name__ == "__main__":
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # freed large blocks leave the resident set
    for world in [int(w) for w in (sys.argv[1:] or ["1", "2", "4"])]:
        rows = run_world(work, world, args=(T,), timeout_s=1800, pg_timeout_s=1200, threads=1)
        print(max(rows, key=lambda r: r["peak_above_qkv_mib"]))
