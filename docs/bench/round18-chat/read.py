"""One layer's read of the paged pool at one decode step: the slice (one sequence in consecutive blocks) against
the gather, through ``PagedLayerCache.update`` (the write of the new token included).

    OMP_NUM_THREADS=2 python docs/bench/round18-chat/read.py

SmolLM2's layer shape (G = 3 key/value heads, D = 64, float32), a pool of 8,192 slots, one row holding S positions
in consecutive blocks of 16; 20 calls of warm-up, then 5 x 200 calls; the median microseconds per call.
"""

from __future__ import annotations

import statistics
import time

import torch

from attnkit.serve.paged import PagedBatch, PagedLayerCache

G, D, N, BLOCK = 3, 64, 8192, 16


def per_call(cache: PagedLayerCache, k: torch.Tensor, positions: torch.Tensor) -> float:
    for _ in range(20):
        cache.update(k, k, positions)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(200):
            cache.update(k, k, positions)
        times.append((time.perf_counter() - start) / 200 * 1e6)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(2)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    storage = torch.randn(2, N + 1, G, D)
    k = torch.randn(1, G, 1, D)  # (B, G, T, D): the new token's
    for s in (16, 1024, 3900):
        table = [list(range(-(-s // BLOCK)))]
        positions = torch.tensor([[s - 1]])
        sliced = PagedBatch.build(table, positions, [s], BLOCK, N)
        assert sliced.span is not None
        gathered = PagedBatch(sliced.write_slots, sliced.read_slots, sliced.key_positions)
        a = per_call(PagedLayerCache(*storage.clone(), sliced), k, positions)
        b = per_call(PagedLayerCache(*storage.clone(), gathered), k, positions)
        print(f"S = {s}: slice {a:.1f} us, gather {b:.1f} us per layer; x 30 layers: {30 * (b - a) / 1000:.2f} ms "
              "a step saved")


if __name__ == "__main__":
    main()
