"""``generate`` beside the serving engine stepped in this thread, for the same batch of prompts (issue 35, item 2).

    python docs/bench/round20-steps/engine_batch.py ROUNDS BATCH

SmolLM2-135M-Instruct in its default form, 2 threads, BATCH random 16-token prompts, 64 greedy tokens each (stop
ids off). ``engine``: a fresh :class:`attnkit.serve.Engine` (64 MiB of KV blocks), every prompt submitted, then
stepped here until each request finished; its decode rate is the tokens after each request's first over the
time after the first step (which prefills every prompt and samples each first token). ``generate``: one batched
call, ``GenerationStats.decode_tokens_per_s``. The two interleaved, which goes first alternating; the first round
warms up. The ratio is the median of each round's pair. One JSON line, with the CPU capability.
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

NEW = 64


def main() -> None:
    rounds, batch = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="auto")
    model.stop_token_ids = ()
    ids = torch.randint(100, 40000, (batch, 16), generator=torch.Generator().manual_seed(0))

    def on_engine() -> float:
        engine = Engine(model, model.decode, kv_memory_mib=64, max_batch=16)
        finished: list[str] = []
        for row in ids.tolist():
            engine.submit(row, GenerationOptions(max_new_tokens=NEW),
                          lambda event: finished.append(event.finish_reason) if event.finish_reason else None)
        engine.step()  # every prompt prefilled, each first token sampled
        start = time.perf_counter()
        while len(finished) < batch:
            engine.step()
        return batch * (NEW - 1) / (time.perf_counter() - start)

    def generated() -> float:
        stats = GenerationStats()
        model.generate(ids, max_new_tokens=NEW, stop_ids=[], stats=stats)
        return stats.decode_tokens_per_s

    contenders = {"engine": on_engine, "generate": generated}
    runs: dict[str, list[float]] = {name: [] for name in contenders}
    for r in range(rounds + 1):
        for name in sorted(contenders, reverse=r % 2 == 1):  # which goes first alternates
            value = contenders[name]()
            if r:
                runs[name].append(round(value, 1))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    pairs = [a / b for a, b in zip(runs["engine"], runs["generate"], strict=True)]
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "batch": batch,
                      "engine / generate": round(statistics.median(pairs), 3),
                      "pairs": [round(p, 3) for p in pairs], "medians": medians, "runs": runs}))


if __name__ == "__main__":
    main()
