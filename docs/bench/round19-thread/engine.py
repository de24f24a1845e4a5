"""One request on the serving engine, stepped in this thread, beside ``generate`` of the same prompt.

    python docs/bench/round19-thread/engine.py ROUNDS

SmolLM2-135M-Instruct in its default form, 2 threads, a 60-token random prompt, 128 greedy tokens (stop ids
off). Each round, interleaved: a fresh engine (its blocks consecutive: keys read as a slice of the pool), an
engine that answered the same prompt before (its prompt's blocks cached, its answer's blocks elsewhere: keys
gathered), and ``generate`` (dense caches). The first round warms up. Decode rate: tokens after the first over the
time after it (the engine's events; ``GenerationStats`` for ``generate``). One JSON line with the CPU capability.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from attnkit.models import load_gguf
from attnkit.models.generation_options import GenerationOptions, GenerationStats
from attnkit.models.loader import smollm2_path
from attnkit.serve import Engine
from attnkit.serve.driver import run_request

NEW = 128


def main() -> None:
    rounds = int(sys.argv[1])
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="auto")
    model.stop_token_ids = ()
    ids = torch.randint(100, 40000, (60,), generator=torch.Generator().manual_seed(0)).tolist()

    def on_engine(engine: Engine) -> float:
        times = [time.perf_counter() for event in run_request(engine, ids, GenerationOptions(max_new_tokens=NEW))
                 if event.token_ids]
        return (len(times) - 1) / (times[-1] - times[0])

    def generated() -> float:
        stats = GenerationStats()
        model.generate(torch.tensor([ids]), max_new_tokens=NEW, stop_ids=[], stats=stats)
        return stats.decode_tokens_per_s

    reused = Engine(model, model.decode, kv_memory_mib=64, max_batch=4)
    on_engine(reused)  # its prompt's blocks now cached
    contenders = {"engine, fresh": lambda: on_engine(Engine(model, model.decode, kv_memory_mib=64, max_batch=4)),
                  "engine, prompt cached": lambda: on_engine(reused), "generate": generated}
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name, contender in contenders.items():
            value = contender()
            if r:
                runs[name].append(round(value, 1))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "medians": medians,
                      "runs": runs}))


if __name__ == "__main__":
    main()
