"""Does PyTorch decode slower in a thread that is not the main one? SmolLM2 ``generate`` in the main thread and in a
new thread, alternating.

    python docs/bench/round19-thread/thread.py THREADS ROUNDS

SmolLM2-135M-Instruct in its default form, a 16-token random prompt, 64 new tokens greedy (stop ids off), THREADS
PyTorch threads; a warm-up pair, then ROUNDS pairs (main first, then a new ``threading.Thread``; the main thread
waits in ``join``). Decode rate: ``GenerationStats.decode_tokens_per_s``. Prints the medians and every value
as one JSON line, with the CPU capability and the environment variables that change malloc or OpenMP.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading

import torch

from attnkit.models import load_gguf
from attnkit.models.generation_options import GenerationStats
from attnkit.models.loader import smollm2_path

NEW = 64


def decode_rate(model: object, prompt: torch.Tensor) -> float:
    """Decode tokens/s (after the first token) of one greedy ``generate`` of NEW tokens."""
    stats = GenerationStats()
    model.generate(prompt, max_new_tokens=NEW, stop_ids=[], stats=stats)  # type: ignore[attr-defined]
    return stats.decode_tokens_per_s


def in_thread(model: object, prompt: torch.Tensor) -> float:
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(decode_rate(model, prompt)))
    worker.start()
    worker.join()
    return out[0]


def main() -> None:
    threads, rounds = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(threads)
    model = load_gguf(smollm2_path(), weights="auto")
    prompt = torch.randint(100, 40000, (1, 16), generator=torch.Generator().manual_seed(0))
    runs: dict[str, list[float]] = {"main": [], "thread": []}
    for r in range(rounds + 1):
        pair = {"main": decode_rate(model, prompt), "thread": in_thread(model, prompt)}
        if r:  # the first pair warms up
            for name, value in pair.items():
                runs[name].append(round(value, 2))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    env = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC", "OMP", "GOMP", "KMP"))}
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": threads, "env": env,
                      "medians": medians, "thread_over_main": round(medians["thread"] / medians["main"], 3),
                      "runs": runs}))


if __name__ == "__main__":
    main()
