"""The rows of steps.py that read under 0.97 in one of its runs, again: milliseconds per call, one tree per process.

    for i in 1 2 3 4 5; do PYTHONPATH=src python docs/bench/round20-steps/recheck.py "this tree"
                           PYTHONPATH=BASE_SRC python docs/bench/round20-steps/recheck.py e148183; done

2 threads; each row the median of 21 calls after two warm-ups: the layer (``MultiHeadAttention``, d 768, 12 heads,
causal) at B = 1, T = 1,024 in inference; ``attnkit.attention`` at B = 1, 12 heads, T = 1,024, causal, with the
``"chunked"`` kernel; MiniLM over 8 x 128 token ids. One JSON line per process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import attnkit
from attnkit.models.minilm import load_minilm


def milliseconds(fn: Callable[[], object], repeats: int = 21) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    layer = attnkit.MultiHeadAttention(768, 768, 12, causal=True)
    x = torch.randn(1, 1024, 768)
    q, k, v = (torch.randn(1, 12, 1024, 64) for _ in range(3))
    minilm = load_minilm()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        rows = {"layer inference": milliseconds(lambda: layer(x)),
                "attention() chunked": milliseconds(lambda: attnkit.attention(q, k, v, causal=True,
                                                                              backend="chunked")),
                "MiniLM 8 x 128": milliseconds(lambda: minilm(ids, torch.ones_like(ids)))}
    print(json.dumps({"tree": sys.argv[1], "attnkit": attnkit.__file__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "ms": rows}))


if __name__ == "__main__":
    main()
