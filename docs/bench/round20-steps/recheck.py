"""The rows of steps.py that read under 0.97x in one of its runs, again: milliseconds per call, one tree per process.

    for i in 1 2 3; do PYTHONPATH=src python docs/bench/round20-steps/recheck.py "this tree"
                       PYTHONPATH=BASE_SRC python docs/bench/round20-steps/recheck.py e148183
                       PYTHONPATH=BASE_SRC python docs/bench/round20-steps/recheck.py e148183
                       PYTHONPATH=src python docs/bench/round20-steps/recheck.py "this tree"; done

(six pairs, which tree goes first alternating: ABBA).

2 threads; each row the median of 21 calls after two warm-ups (the prefill: of 3): the layer
(``MultiHeadAttention``, d 768, 12 heads, causal) at B = 1, T = 1,024 in inference and in training (forward and
backward); ``attnkit.attention`` at B = 1, 12 heads, T = 1,024, causal, with the default and the ``"chunked"``
kernel; MiniLM over 8 x 128 token ids; SmolLM2-135M-Instruct (int4 here, ``weights="auto"``) prefilling 2,000
tokens (``step``: one forward that fills its caches, as ``generate`` prefills). One JSON line per process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import attnkit
from attnkit.models import load_gguf
from attnkit.models.loader import smollm2_path
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
    smollm2 = load_gguf(smollm2_path(), weights="auto")
    prompt = torch.randint(100, 40000, (1, 2000), generator=torch.Generator().manual_seed(1))
    xg = x.clone().requires_grad_()
    rows = {"layer training": milliseconds(lambda: layer(xg).sum().backward())}
    with torch.inference_mode():
        rows |= {"layer inference": milliseconds(lambda: layer(x)),
                 "attention() default": milliseconds(lambda: attnkit.attention(q, k, v, causal=True)),
                 "attention() chunked": milliseconds(lambda: attnkit.attention(q, k, v, causal=True,
                                                                               backend="chunked")),
                 "MiniLM 8 x 128": milliseconds(lambda: minilm(ids, torch.ones_like(ids))),
                 "SmolLM2 prefill 2,000": milliseconds(
                     lambda: smollm2.step(prompt, None, smollm2.new_caches()), repeats=3)}
    print(json.dumps({"tree": sys.argv[1], "attnkit": attnkit.__file__,
                      "cpu_capability": torch.backends.cpu.get_cpu_capability(), "ms": rows}))


if __name__ == "__main__":
    main()
