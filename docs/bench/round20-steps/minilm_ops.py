"""MiniLM's Python calls in one forward (``sys.setprofile``: Python and C functions called from Python) and its
ATen operations over five forwards (PyTorch's profiler), 8 x 128 token ids, 2 threads: run once per tree
(``PYTHONPATH=src`` and ``PYTHONPATH=BASE_SRC``) to see whether the two do the same work.

    PYTHONPATH=src python docs/bench/round20-steps/minilm_ops.py
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch.profiler import profile

from attnkit.models.minilm import load_minilm


def main() -> None:
    torch.set_num_threads(2)
    model = load_minilm()
    ids = torch.randint(1000, 20000, (8, 128), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    calls = [0]

    def count(frame: FrameType, event: str, arg: Any) -> None:
        calls[0] += event in ("call", "c_call")

    with torch.inference_mode():
        for _ in range(3):
            model(ids, mask)
        sys.setprofile(count)
        model(ids, mask)
        sys.setprofile(None)
        print(f"Python calls in one forward: {calls[0]}")
        with profile() as prof:
            for _ in range(5):
                model(ids, mask)
    events = sorted(prof.key_averages(), key=lambda e: e.key)
    print(f"{len(events)} ATen operations, self CPU {sum(e.self_cpu_time_total for e in events) / 1e3:.1f} ms:")
    for event in events:
        print(f"  {event.key}: {event.count} calls, self CPU {event.self_cpu_time_total / 1e3:.2f} ms")


if __name__ == "__main__":
    main()
