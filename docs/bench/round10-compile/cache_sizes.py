"""The compiled decoding step over three cache sizes, SmolLM2 int4, 2 threads: what each call's first run costs
(compiling included) and its decoding speed, beside the eager loop.

    .venv/bin/python docs/bench/round10-compile/cache_sizes.py > docs/bench/round10-compile/cache_sizes.txt

Inductor's on-disk cache is a fresh temporary folder, so the first compilation is a cold one. Until round ten
every cache size (prompt + max_new_tokens: every chat turn) compiled a graph of its own, two in fact; now the
static caches' capacity is symbolic and one graph serves them all. Decoding speed: the median of 3 calls after
the first, new tokens after the first over the seconds after the first.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings

os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnkit-inductor-")  # a cold compile

import torch
from torch._dynamo.utils import counters

from attnkit.models import load_smollm2
from attnkit.models.generation import GenerationStats, generate


def main() -> None:
    torch.set_num_threads(2)
    warnings.simplefilter("ignore", UserWarning)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 2 threads")
    model = load_smollm2(weights="int4")
    ids = model.tokenize("The old lighthouse keeper climbed the stairs every evening")["input_ids"]

    def decode_rate(new: int, compiled: bool) -> float:
        rates = []
        for _ in range(3):
            stats = GenerationStats()
            generate(model, ids, max_new_tokens=new, stop_ids=[], compile=compiled, stats=stats)
            rates.append((stats.new_tokens - 1) / stats.decode_seconds)
        return statistics.median(rates)

    for new in (64, 72, 68):
        start = time.perf_counter()
        generate(model, ids, max_new_tokens=new, stop_ids=[], compile=True)
        first = time.perf_counter() - start
        print(f"compiled, cache of {ids.shape[1] + new} positions: first call {first:.1f} s, then "
              f"{decode_rate(new, True):.1f} tokens/s decoding; graphs so far: {counters['stats']['unique_graphs']}",
              flush=True)
    print(f"eager: {decode_rate(64, False):.1f} tokens/s decoding")


if __name__ == "__main__":
    main()
