"""attnkit's eager decode against the floor (attnkit.bench.floor: the same layers, gpt-fast-style plain code), and
the Python calls per decoder layer, in one run.

    .venv/bin/python docs/bench/round14-engine/floor.py > docs/bench/round14-engine/floor.txt

SmolLM2-135M-Instruct, each weight form given, 16-token prompts, 64 new tokens, batch 1 and 8, greedy, 2
threads: decode tokens/s per row (the 63 steps after the first token), median of 3 interleaved rounds after
a warm-up. The floor runs the very same modules (packed layers included), so the difference is what attnkit's
framework adds: the step context, the cache protocol, kernel dispatch, the generation loop's bookkeeping.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from attnkit.bench.floor import FloorLlama
from attnkit.models import load_smollm2

NEW = 64
PROMPT = ("The old lighthouse keeper climbed the stairs every evening, counting each step as his father had taught "
          "him, and at the top he wiped the salt from the glass")


def decode_rate(run: object, ids: torch.Tensor) -> float:
    """Rows x new tokens after the first, per second of the steps after the first."""
    steps = run(ids)  # type: ignore[operator]
    next(steps)
    start = time.perf_counter()
    for _ in steps:
        pass
    return ids.shape[0] * (NEW - 1) / (time.perf_counter() - start)


def attnkit_steps(model: object, ids: torch.Tensor):  # type: ignore[no-untyped-def]
    from attnkit.models.generation import generate_steps

    return generate_steps(model, ids, max_new_tokens=NEW, stop_ids=[])  # type: ignore[arg-type]


def main() -> None:
    torch.set_num_threads(2)
    forms = sys.argv[1:] or ["float32", "int4"]
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, 2 threads")
    for form in forms:
        model = load_smollm2(weights=form)
        floor = FloorLlama.from_attnkit(model, capacity=128)
        ids1 = model.tokenize(PROMPT)["input_ids"][:, :16]  # (1, 16)
        for batch in (1, 8):
            ids = ids1.expand(batch, -1).contiguous()  # (B, 16): one length, no padding
            runs = {"attnkit": lambda x: attnkit_steps(model, x), "floor": lambda x: floor.steps(x, NEW)}
            for run in runs.values():
                decode_rate(run, ids)  # warm-up
            rates: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(3):
                for name, run in runs.items():
                    rates[name].append(decode_rate(run, ids))
            a, f = statistics.median(rates["attnkit"]), statistics.median(rates["floor"])
            print(f"{form:8} batch {batch}: attnkit {a:7.1f} tok/s, floor {f:7.1f} tok/s, ratio {a / f:.2f}")
    print("Python calls per layer per decode step: python -m attnkit.bench.calls")


if __name__ == "__main__":
    main()
