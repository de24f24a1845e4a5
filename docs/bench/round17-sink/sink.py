"""What a sink window costs the serving engine: one request decoding past its window, eager step, SmolLM2 int4.

    OMP_NUM_THREADS=2 python docs/bench/round17-sink/sink.py docs/bench/round17-sink

Rows (a warm-up round, then 3 rounds interleaved; the median): the engine keeping every position
(cache="full"), the engine with a sink window of 320 positions (cache="sink:4,253,64": 900 new tokens evict
every 64), and generate() with the same window (its dense KVCache), all greedy from the same 32-token prompt
with stop ids off; tokens/s over the whole request (prefill included), the tokens counted, the most KV blocks
the request held, and whether the engine's tokens equal generate's. Printed, and written to results.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine

NEW, WINDOW, ROUNDS = 900, "sink:4,253,64", 3


def run_engine(model: Any, prompt: list[int], cache: str) -> tuple[float, int, list[int]]:
    """Seconds, the most blocks held, the tokens: one request through the engine, stepped here."""
    engine = Engine(model, model.decode, kv_memory_mib=64, cache=cache)
    tokens: list[int] = []
    engine.submit(prompt, GenerationOptions(max_new_tokens=NEW, stop_ids=[]),
                  lambda event: tokens.extend(event.token_ids))
    most, start = 0, time.perf_counter()
    while not engine.idle:
        engine.step()
        most = max(most, int(engine.metrics()["kv_blocks_used"]))
    return time.perf_counter() - start, most, tokens


def run_generate(model: Any, prompt: list[int]) -> tuple[float, list[int]]:
    start = time.perf_counter()
    out = model.generate(torch.tensor([prompt]), cache=WINDOW, max_new_tokens=NEW, stop_ids=[])  # (1, T + NEW)
    return time.perf_counter() - start, out[0, len(prompt) :].tolist()


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="int4")
    prompt = (model.tokenizer.encode("Write a long story about a lighthouse keeper who finds a message.") * 3)[:32]
    env = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": 2,
           "model": "SmolLM2-135M-Instruct int4", "prompt_tokens": len(prompt), "new_tokens": NEW}
    seconds: dict[str, list[float]] = {"full": [], WINDOW: [], "generate": []}
    blocks, tokens = {}, {}
    for r in range(ROUNDS + 1):  # round 0 warms up
        for cache in ("full", WINDOW):
            took, blocks[cache], tokens[cache] = run_engine(model, prompt, cache)
            seconds[cache] += [took] if r else []
        took, tokens["generate"] = run_generate(model, prompt)
        seconds["generate"] += [took] if r else []
    rows = {name: {"tokens": len(tokens[name]), "tokens_per_s": len(tokens[name]) / statistics.median(runs),
                   "seconds": runs, "most_blocks": blocks.get(name)} for name, runs in seconds.items()}
    same = tokens[WINDOW] == tokens["generate"]
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    for name, row in rows.items():
        print(f"{name:>16}: {row['tokens_per_s']:6.1f} tokens/s over {row['tokens']} tokens (median of {ROUNDS}), "
              f"at most {row['most_blocks']} blocks of 16")
    print(f"window vs full: {rows[WINDOW]['tokens_per_s'] / rows['full']['tokens_per_s']:.2f}x; the engine's "
          f"tokens {'equal' if same else 'differ from'} generate's with the window")
    if out is not None:
        (out / "results.json").write_text(json.dumps({"env": env, "rows": rows, "same_tokens": same}, indent=1))


if __name__ == "__main__":
    main()
