"""One request decoding after a short and a long prompt: ``generate`` against the serving engine, whose pool is
read as a slice (one sequence in consecutive blocks) or gathered (as before this round).

    OMP_NUM_THREADS=2 python docs/bench/round18-chat/long.py OUT_DIR

SmolLM2-135M-Instruct in its default form (int4), 2 threads, eager steps, greedy, stop ids off; a random prompt
of T tokens (T = 16 and 3,900), 64 new tokens. Each round runs the three contenders once, interleaved in one
process (``PagedBatch.build`` without its slice for "engine, gather"); a warm-up round, then ROUNDS rounds; the
median decode rate (tokens/s after the first token). The engine is stepped in this thread
(:mod:`attnkit.serve.driver`, as ``attnkit chat`` steps it). Printed, and written to OUT_DIR/results.json with the CPU
capability and whether each contender's tokens equal generate's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from attnkit.models.generation import generate_steps
from attnkit.models.generation_options import GenerationOptions
from attnkit.models.loader import load_gguf, smollm2_path
from attnkit.serve import Engine, PagedBatch
from attnkit.serve.driver import run_request

NEW, ROUNDS, LENGTHS = 64, 3, (16, 3900)
BUILD = PagedBatch.build.__func__  # type: ignore[attr-defined]


def gathered(cls: type[PagedBatch], *args: Any) -> PagedBatch:
    batch = BUILD(cls, *args)
    return cls(batch.write_slots, batch.read_slots, batch.key_positions)  # no slice: every read gathers


def with_generate(model: Any, prompt: list[int]) -> tuple[float, list[int]]:
    tokens, first = [], 0.0
    for token in generate_steps(model, torch.tensor([prompt]), max_new_tokens=NEW, stop_ids=[]):
        tokens.append(int(token[0]))
        first = first or time.perf_counter()
    return (NEW - 1) / (time.perf_counter() - first), tokens


def with_engine(model: Any, prompt: list[int], slice_read: bool) -> tuple[float, list[int]]:
    PagedBatch.build = classmethod(BUILD if slice_read else gathered)  # type: ignore[method-assign, assignment]
    engine = Engine(model, model.decode, kv_memory_mib=512, max_batch=1, token_budget=8192)
    try:
        tokens, first = [], 0.0
        for event in run_request(engine, prompt, GenerationOptions(max_new_tokens=NEW)):  # stepped here
            tokens += event.token_ids
            first = first or time.perf_counter()
        return (len(tokens) - 1) / (time.perf_counter() - first), tokens
    finally:
        PagedBatch.build = classmethod(BUILD)  # type: ignore[method-assign, assignment]


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(2)
    model = load_gguf(smollm2_path(), weights="auto")
    model.stop_token_ids = ()
    results: dict[str, Any] = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "new_tokens": NEW}
    g = torch.Generator().manual_seed(0)
    for length in LENGTHS:
        prompt = torch.randint(100, 40000, (length,), generator=g).tolist()
        runs: dict[str, list[float]] = {"generate": [], "engine, slice": [], "engine, gather": []}
        same: dict[str, bool] = {}
        for r in range(ROUNDS + 1):
            rate, reference = with_generate(model, prompt)
            rates = {"generate": rate}
            for name, slice_read in (("engine, slice", True), ("engine, gather", False)):
                rates[name], tokens = with_engine(model, prompt, slice_read)
                same[name] = same.get(name, True) and tokens == reference
            if r:  # the first round warms up
                for name, value in rates.items():
                    runs[name].append(value)
        medians = {name: statistics.median(values) for name, values in runs.items()}
        results[str(length)] = {"rates": runs, "medians": medians, "tokens_equal_generate": same}
        rows = [f"{name} {medians[name]:.1f} tok/s ({', '.join(f'{v:.1f}' for v in runs[name])})" for name in runs]
        print(f"T = {length}: " + "; ".join(rows) + f"; tokens equal generate's: {same}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "long.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
