"""Round seven's prefill measurements: packed layers through their kernels or through the widened product.

    .venv/bin/python docs/bench/generate-round7/prefill_paths.py > docs/bench/generate-round7/prefill_paths.txt

1. One layer of each of SmolLM2's four shapes (attnkit fuses q/k/v and gate/up), milliseconds per call, the
   kernel against ``F.linear`` over ``dense_weight()`` (widening included), 2 threads.
2. A 4,000-token prompt end to end (time to the first token), both paths alternating in one process.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from attnkit.bench.generate import Attnkit, prompt_ids
from attnkit.models import load_smollm2
from attnkit.modules.quantize import Int4Linear, Int8Linear, PackedLinear

SHAPES = {"q/k/v 960 x 576": (960, 576), "out 576 x 576": (576, 576), "gate/up 3072 x 576": (3072, 576),
          "down 576 x 1536": (576, 1536)}
ROWS = (32, 64, 128, 256, 4000)


def _ms(f, n: int) -> float:
    f()
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n * 1e3


def layers() -> None:
    print("| layer | " + " | ".join(f"{r} rows" for r in ROWS) + " |")
    print("|---|" + "---|" * len(ROWS))
    for cls in (Int4Linear, Int8Linear):
        for name, (n, k) in SHAPES.items():
            layer = cls(torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.02)
            cells = []
            for rows in ROWS:
                x = torch.randn(rows, k).bfloat16()
                reps = 5 if rows > 1000 else 40
                kernel = _ms(lambda layer=layer, x=x: layer.matmul(x), reps)
                widened = _ms(lambda layer=layer, x=x: F.linear(x, layer.dense_weight()), reps)
                cells.append(f"{kernel:.2f} / {widened:.2f}")
            print(f"| {cls.form} {name}, kernel / widened | " + " | ".join(cells) + " |")


def end_to_end(form: str, rounds: int = 2) -> None:
    model = load_smollm2(weights=form)
    ids = prompt_ids(model.tokenizer, 4000)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear) and m.dense_rows is not None]
    thresholds = [m.dense_rows for m in packed]
    for _ in range(rounds):
        for path in ("kernel", "widened"):
            for layer, rows in zip(packed, thresholds, strict=True):
                layer.dense_rows = None if path == "kernel" else rows
            first, _ = Attnkit(model).single(ids, 2)
            print(f"{form} {path}: time to first token {first:.2f} s, prefill {len(ids) / first:.0f} tokens/s")


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, 2 threads\n")
    layers()
    print()
    for form in ("int4", "int8"):
        end_to_end(form)
