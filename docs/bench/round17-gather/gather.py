"""The paged pool's read through index_select against tensor indexing: the serving engine's eager step.

    python docs/bench/round17-gather/gather.py > docs/bench/round17-gather/gather.txt

SmolLM2 int4, the eager step (no compile), N requests of the same 64-token prompt decoding 128 tokens each
(stop ids off), 2 threads; tokens/s over the whole run, best of 3 rounds, the two reads interleaved in one
process (``attnkit.serve.paged.gather`` swapped for plain indexing).
"""

from __future__ import annotations

import time

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine, paged

NEW = 128


def indexing(storage: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return storage[slots]  # (B, S, ...)


def run(model, prompt: list[int], n: int) -> float:
    engine = Engine(model, model.decode, kv_memory_mib=256, max_batch=n)
    for _ in range(n):
        engine.submit(prompt, GenerationOptions(max_new_tokens=NEW, stop_ids=[]), lambda event: None)
    start = time.perf_counter()
    while not engine.idle:
        engine.step()
    return n * NEW / (time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="int4")
    prompt = (model.tokenizer.encode("Tell me a long story about a dragon who learns to read.") * 8)[:64]
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 2 threads, SmolLM2 int4, eager step")
    index_select = paged.gather
    for n in (1, 16):
        best = {"index_select": 0.0, "indexing": 0.0}
        for _ in range(3):
            for name, read in (("index_select", index_select), ("indexing", indexing)):
                paged.gather = read
                best[name] = max(best[name], run(model, prompt, n))
        paged.gather = index_select
        print(f"N = {n:2d}: index_select {best['index_select']:6.1f} tokens/s, indexing {best['indexing']:6.1f} "
              f"({best['index_select'] / best['indexing']:.2f}x)")


if __name__ == "__main__":
    main()
