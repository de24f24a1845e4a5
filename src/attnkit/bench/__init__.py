"""Benchmarks: attnkit beside torch.nn.MultiheadAttention, raw SDPA, the textbook and Hugging Face.

    attnkit bench --quick        # under two minutes
    attnkit bench                # the full suite (see BENCHMARKS.md)
    python -m attnkit.bench      # the same command

Results go to ``bench-out/``: ``results.json``, ``summary.md``, ``time.png``
and ``memory.png``.
"""

from __future__ import annotations

from .cases import SUITES, Case, grid
from .contenders import CONTENDERS
from .runner import Result, environment, matmul_gflops, run_case

__all__ = ["CONTENDERS", "SUITES", "Case", "Result", "environment", "grid", "matmul_gflops", "run_case"]
