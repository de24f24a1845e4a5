"""The sampler's counter-based hash under torch.compile: inlined by Inductor, or called as an op.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python docs/bench/round17-hash/hash.py inline
    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python docs/bench/round17-hash/hash.py op
    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python docs/bench/round17-hash/hash.py inline8

One process per form, each with an empty Inductor cache: the sampler (temperature 0.8, top-k 50, V = 49,152,
B = 3) compiled with fullgraph, its first call's seconds (the compile, the process's first), then
microseconds per call (300 calls, a warm-up of 20, median of 3 runs). "inline" is the hash as plain tensor
code (what attnkit.models.sampling.uniform was before it became an op); "op" is attnkit's; "inline8" the plain
code with Inductor's ``realize_opcount_threshold`` at 8 (which bounds the inlining's fan-out). The eager hash
alone is timed too. Printed as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch

from attnkit.models import sampling
from attnkit.models.sampling import Sampler


def per_call_us(fn: Any, *args: Any) -> float:
    for _ in range(20):
        fn(*args)
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(300):
            fn(*args)
        runs.append((time.perf_counter() - start) / 300 * 1e6)
    return statistics.median(runs)


def main() -> None:
    form = sys.argv[1]
    torch.set_num_threads(1)
    if form in ("inline", "inline8"):
        sampling.uniform = sampling._hash_uniform  # the plain tensor code, as before the op
    if form == "inline8":
        torch._inductor.config.realize_opcount_threshold = 8
    sampler = Sampler(temperature=0.8, top_k=50)
    compiled = torch.compile(lambda logits, seeds, steps: sampler(logits, seeds, steps), fullgraph=True)
    logits, seeds, steps = torch.randn(3, 49152), torch.arange(3), torch.full((3,), 5)
    start = time.perf_counter()
    compiled(logits, seeds, steps)
    first = time.perf_counter() - start
    call = per_call_us(compiled, logits, seeds, steps)
    eager = per_call_us(sampling._hash_uniform, seeds, steps)
    capability = torch.backends.cpu.get_cpu_capability()
    print(json.dumps({"form": form, "torch": torch.__version__, "cpu_capability": capability,
                      "first_call_s": round(first, 1), "compiled_call_us": round(call, 1),
                      "eager_hash_us": round(eager, 1)}))


if __name__ == "__main__":
    main()
