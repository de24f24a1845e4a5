"""What a sink window costs the serving engine: one request decoding past its window, eager step, SmolLM2 int4.

    OMP_NUM_THREADS=2 python docs/bench/round17-sink/sink.py > docs/bench/round17-sink/sink.txt

Rows (interleaved, best of 3 rounds): the engine with every position kept (cache="full"), the engine with a
sink window of 320 positions (cache="sink:4,253,64": 900 new tokens evict every 64), and generate() with the
same window (its dense KVCache), all greedy from the same 32-token prompt; tokens/s over the whole request
(prefill included), the most KV blocks the request held, and whether the engine's tokens equal generate's.
"""

from __future__ import annotations

import time

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine

NEW, WINDOW = 900, "sink:4,253,64"


def run_engine(model, prompt: list[int], cache: str) -> tuple[float, int, list[int]]:
    engine = Engine(model, model.decode, kv_memory_mib=64, cache=cache)
    tokens: list[int] = []
    engine.submit(prompt, GenerationOptions(max_new_tokens=NEW), lambda event: tokens.extend(event.token_ids))
    most, start = 0, time.perf_counter()
    while not engine.idle:
        engine.step()
        most = max(most, int(engine.metrics()["kv_blocks_used"]))
    return time.perf_counter() - start, most, tokens


def main() -> None:
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="int4")
    prompt = model.tokenizer.encode("Write a long story about a lighthouse keeper who finds a message in a bottle.")
    prompt = (prompt * 3)[:32]
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads,"
          f" SmolLM2 int4, {len(prompt)}-token prompt, {NEW} new tokens, greedy")
    best: dict[str, float] = {}
    for _ in range(3):
        for cache in ("full", WINDOW):
            seconds, most, tokens = run_engine(model, prompt, cache)
            best[cache] = min(best.get(cache, float("inf")), seconds)
            if cache == WINDOW:
                sink_tokens, sink_blocks = tokens, most
            else:
                full_blocks = most
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), cache=WINDOW, max_new_tokens=NEW)
        best["generate"] = min(best.get("generate", float("inf")), time.perf_counter() - start)
    alone = out[0, len(prompt):].tolist()
    print(f"engine, cache=full:      {NEW / best['full']:6.1f} tokens/s, at most {full_blocks} blocks of 16")
    print(f"engine, cache={WINDOW}: {NEW / best[WINDOW]:6.1f} tokens/s, at most {sink_blocks} blocks of 16 "
          f"({NEW / best[WINDOW] / (NEW / best['full']):.2f}x full)")
    print(f"generate, cache={WINDOW}: {NEW / best['generate']:6.1f} tokens/s")
    same = next((i for i, (a, b) in enumerate(zip(sink_tokens, alone)) if a != b), None)
    print("engine's tokens equal generate's" if same is None and len(sink_tokens) == len(alone) else
          f"engine's tokens part from generate's at token {same} (int4 layers round a batch otherwise)")


if __name__ == "__main__":
    main()
