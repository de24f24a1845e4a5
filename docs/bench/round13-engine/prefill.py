"""Serving engine: the prefill chunks of several requests in one forward (this commit) against one forward per
prefilling request (the engine before it). Run with PYTHONPATH pointing at either tree's src/:

    PYTHONPATH=src python docs/bench/round13-engine/prefill.py [--equal]

16 requests arrive together (prompts of 24..144 tokens, SmolLM2 int4 as `attnkit serve` loads it), each asks
for 8 greedy tokens; the wall time until every request has finished, best of 3. One CPU thread per process
so that two trees can be compared side by side on a shared machine.
"""

from __future__ import annotations

import sys
import time

import torch

from attnkit.models import load_smollm2
from attnkit.serve import Engine

try:  # the engine after issue 35's second step
    from attnkit.models.generation_options import GenerationOptions

    import attnkit.serve.scheduler  # noqa: F401

    def options(n: int) -> object:
        return GenerationOptions(max_new_tokens=n)
except ImportError:  # before it
    from attnkit.serve import SamplingParams

    def options(n: int) -> object:
        return SamplingParams(max_tokens=n, temperature=0.0)


def main() -> None:
    torch.set_num_threads(1)
    model = load_smollm2(weights="int4")
    g = torch.Generator().manual_seed(0)
    equal = "--equal" in sys.argv  # every prompt 64 tokens (else 24, 32, ..., 144)
    prompts = [torch.randint(100, 40000, (64 if equal else 24 + 8 * i,), generator=g).tolist() for i in range(16)]
    best = float("inf")
    for _ in range(3):
        engine = Engine(model, model.decode, kv_memory_mib=64)  # a fresh one: no prefix reuse across runs
        done = []
        begin = time.perf_counter()
        for p in prompts:
            engine.submit(p, options(8), lambda e, d=done: d.append(1) if e.finish_reason else None)
        while len(done) < len(prompts):
            engine.step()
        best = min(best, time.perf_counter() - begin)
    lengths = "64-token" if equal else "24..144-token"
    print(f"capability {torch.backends.cpu.get_cpu_capability()}: 16 requests ({lengths} prompts, 8 tokens each): "
          f"{best:.2f} s")


if __name__ == "__main__":
    main()
