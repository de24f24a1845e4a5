"""One decoding step of SmolLM2 (int4 weights) over a 4,000-token cache, float32 or int8, and its profile.

    .venv/bin/python docs/bench/generate-round8/step_profile.py          # the float32 cache
    .venv/bin/python docs/bench/generate-round8/step_profile.py int8     # the int8 cache

Milliseconds per ``model.step`` (20 steps after 5), then the profile of 10 more steps.
"""

from __future__ import annotations

import sys
import time

import torch

from attnkit.bench.generate import prompt_ids
from attnkit.models import load_smollm2


def main(kv: str | None) -> None:
    torch.set_num_threads(2)
    model = load_smollm2(weights="int4")
    ids = torch.tensor([prompt_ids(model.tokenizer, 4000)])  # (1, 4000)
    caches = model.new_caches(dtype=torch.int8 if kv == "int8" else None)
    token = torch.tensor([[5]])  # (1, 1)
    with torch.inference_mode():
        model.step(ids, None, caches)
        for _ in range(5):
            model.step(token, None, caches)
        start = time.perf_counter()
        for _ in range(20):
            model.step(token, None, caches)
        print(f"{kv or 'float32'} cache: {(time.perf_counter() - start) / 20 * 1e3:.1f} ms/step, cpu "
              f"{torch.backends.cpu.get_cpu_capability()}")
        with torch.profiler.profile() as profile:
            for _ in range(10):
                model.step(token, None, caches)
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
