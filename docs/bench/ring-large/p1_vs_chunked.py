"""What the ring's pieces cost with one rank: ring_attention (P = 1) against the chunked backend.

    python docs/bench/ring-large/p1_vs_chunked.py

Forward, causal, no grad, (1, 12, 8192, 64) float32, one thread, the
allocator's default settings (the ring suite sets MALLOC_MMAP_THRESHOLD_ for
its memory readings, which also slows every large allocation). Median of 3
after a warm-up.
"""

import statistics
import time

import torch

import attnkit
from attnkit.distributed import ring_attention
from attnkit.distributed.launch import run_world


def work(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 12, 8192, 64) for _ in range(3))
    calls = {"chunked backend": lambda: attnkit.attention(q, k, v, causal=True, backend="chunked"),
             "ring P=1 zigzag": lambda: ring_attention(q, k, v, causal=True, layout="zigzag"),
             "ring P=1 contiguous": lambda: ring_attention(q, k, v, causal=True, layout="contiguous")}
    out = {}
    with torch.no_grad():
        for name, call in calls.items():
            call()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times)
    return out


if __name__ == "__main__":
    result = run_world(work, 1, timeout_s=600, threads=1)[0]
    base = result["chunked backend"]
    for name, seconds in result.items():
        print(f"{name:<22} {seconds * 1e3:8.0f} ms  {seconds / base:.2f}x")
