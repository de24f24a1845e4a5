"""MiniLM's embeddings rate (8 x 128 token ids, 2 threads, median of 11 calls after a warm-up) in a fresh process,
then again after the SmolLM2 part of steps.py ran in the same process (int4 ``generate``: batch 1 and 8 after a
16-token prompt, then a 2,000-token prompt), to see whether what ran before moves MiniLM's row.

    PYTHONPATH=src python docs/bench/round20-steps/minilm_after.py "this tree"
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from attnkit.models import load_gguf
from attnkit.models.loader import smollm2_path
from attnkit.models.minilm import load_minilm


def texts_per_second(model: torch.nn.Module, ids: torch.Tensor) -> float:
    mask = torch.ones_like(ids)
    model(ids, mask)
    times = []
    for _ in range(11):
        start = time.perf_counter()
        model(ids, mask)
        times.append(time.perf_counter() - start)
    return round(ids.shape[0] / statistics.median(times), 2)


def main() -> None:
    torch.set_num_threads(2)
    minilm = load_minilm()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        fresh = texts_per_second(minilm, ids)
    smollm2 = load_gguf(smollm2_path(), weights="auto")
    smollm2.stop_token_ids = ()
    prompt = torch.randint(100, 40000, (8, 16), generator=torch.Generator().manual_seed(0))
    for ids_ in (prompt[:1], prompt[:1], prompt, prompt,
                 torch.randint(100, 40000, (1, 2000), generator=torch.Generator().manual_seed(1))):
        smollm2.generate(ids_, max_new_tokens=64, stop_ids=[])
    with torch.inference_mode():
        after = texts_per_second(minilm, ids)
    print(json.dumps({"tree": sys.argv[1], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                      "fresh": fresh, "after SmolLM2": after}))


if __name__ == "__main__":
    main()
