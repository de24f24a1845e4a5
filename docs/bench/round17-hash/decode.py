"""The sampler's hash inside a whole compiled decode step: attnkit's op, or inlined with Inductor's fan-out bound.

    OMP_NUM_THREADS=2 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python docs/bench/round17-hash/decode.py FORM MODE

FORM: "op" (attnkit's) or "inline8" (the hash as plain tensor code, ``realize_opcount_threshold`` = 8 for the
whole graph); MODE: "sampled" (temperature 0.7, top-k 40, seeded) or "greedy". One process per pair, an empty
Inductor cache each: SmolLM2 int4, ``generate(compile=True)`` from a 16-token prompt, 128 new tokens with stop
ids off; the first call's seconds (the compile included), then the decode tokens/s of three more calls (the
median). Printed as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from attnkit.models import sampling
from attnkit.models.generation_options import GenerationStats
from attnkit.models.loader import load_gguf, smollm2_path


def main() -> None:
    form, mode = sys.argv[1], sys.argv[2]
    torch.set_num_threads(2)
    if form == "inline8":
        sampling.uniform = sampling._hash_uniform  # the plain tensor code, as before the op
        torch._inductor.config.realize_opcount_threshold = 8
    model = load_gguf(smollm2_path(), weights="int4")
    ids = torch.tensor([(model.tokenizer.encode("Tell me a story about a dragon who learns to read.") * 4)[:16]])
    options = {"temperature": 0.7, "top_k": 40, "seed": 3} if mode == "sampled" else {}
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=128, stop_ids=[], compile=True, **options)
    first = time.perf_counter() - start
    rates = []
    for _ in range(3):
        stats = GenerationStats()
        model.generate(ids, max_new_tokens=128, stop_ids=[], compile=True, stats=stats, **options)
        rates.append(stats.decode_tokens_per_s)
    print(json.dumps({"form": form, "mode": mode, "torch": torch.__version__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "first_call_s": round(first, 1),
                      "decode_tokens_per_s": round(statistics.median(rates), 1),
                      "rates": [round(r, 1) for r in rates]}))


if __name__ == "__main__":
    main()
