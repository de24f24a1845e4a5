"""The paged pool's read through index_select against tensor indexing: one read alone, and the serving engine's
eager step.

    OMP_NUM_THREADS=2 python docs/bench/round17-gather/gather.py docs/bench/round17-gather

One read: a layer's keys (N = 8,193 slots, G = 3, D = 64, float32) gathered at (B, S) random slots, 500 calls
after 50 of warm-up, microseconds per call. End to end: SmolLM2 int4, the eager step (no compile), N requests of
the same 64-token prompt decoding 128 tokens each (stop ids off), 2 threads; a warm-up round, then 3 rounds with
the two reads interleaved in one process (``attnkit.serve.paged.gather`` swapped for plain indexing); the
median tokens/s. Printed, and written to results.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine, paged

NEW, ROUNDS = 128, 3


def indexing(storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return storage[slots]  # (B, S, ...)


def one_read(read: Any, keys: torch.Tensor, slots: torch.Tensor) -> float:
    for _ in range(50):
        read(keys, slots)
    start = time.perf_counter()
    for _ in range(500):
        read(keys, slots)
    return (time.perf_counter() - start) / 500 * 1e6


def run(model: Any, prompt: list[int], n: int) -> float:
    engine = Engine(model, model.decode, kv_memory_mib=256, max_batch=n)
    for _ in range(n):
        engine.submit(prompt, GenerationOptions(max_new_tokens=NEW, stop_ids=[]), lambda event: None)
    start = time.perf_counter()
    while not engine.idle:
        engine.step()
    return n * NEW / (time.perf_counter() - start)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    torch.set_num_threads(2)
    env = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": 2}
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    index_select, keys = paged.gather, torch.randn(8193, 3, 64)
    reads = []
    for s in (130, 1000, 4000):
        for b in (1, 16):
            slots = torch.randint(0, 8192, (b, s))
            row = {"B": b, "S": s, "index_select_us": one_read(index_select, keys, slots),
                   "indexing_us": one_read(indexing, keys, slots)}
            reads.append(row)
            print(f"one read, B = {b:2d}, S = {s:4d}: index_select {row['index_select_us']:8.1f} us, indexing "
                  f"{row['indexing_us']:8.1f} us ({row['indexing_us'] / row['index_select_us']:.2f}x)")
    model = load_gguf(smollm2_path(), weights="int4")
    prompt = (model.tokenizer.encode("Tell me a long story about a dragon who learns to read.") * 8)[:64]
    steps = []
    for n in (1, 16):
        rates: dict[str, list[float]] = {"index_select": [], "indexing": []}
        for r in range(ROUNDS + 1):  # round 0 warms up
            for name, read in (("index_select", index_select), ("indexing", indexing)):
                paged.gather = read
                rate = run(model, prompt, n)
                rates[name] += [rate] if r else []
        paged.gather = index_select
        row = {"N": n, **{f"{k}_tokens_per_s": statistics.median(v) for k, v in rates.items()}, "rounds": rates}
        steps.append(row)
        print(f"engine, SmolLM2 int4, eager, N = {n:2d}: index_select {row['index_select_tokens_per_s']:6.1f} "
              f"tokens/s, indexing {row['indexing_tokens_per_s']:6.1f} "
              f"({row['index_select_tokens_per_s'] / row['indexing_tokens_per_s']:.2f}x)")
    if out is not None:
        (out / "results.json").write_text(json.dumps({"env": env, "reads": reads, "steps": steps}, indent=1))


if __name__ == "__main__":
    main()
