"""Benchmarks: attnkit beside torch.nn.MultiheadAttention, raw SDPA, the textbook and Hugging Face.

    attnkit bench --quick        # a few minutes (BENCHMARKS.md says how long, on which CPU)
    attnkit bench                # the full suite (see BENCHMARKS.md)
    python -m attnkit.bench      # the same command

Results go to ``bench-out/``: ``results.json``, ``summary.md``, ``time.png``
and ``memory.png``. :mod:`.command` runs a suite, :mod:`.options` holds its
options, :mod:`.cases` names the suites' cases, :mod:`.contenders` builds
what they time, :mod:`.runner` times them and :mod:`.report` shows the
results.
"""

from __future__ import annotations

from .cases import SUITES, Case, grid
from .command import ROW_SUITES, run
from .contenders import CONTENDERS, Contender
from .options import Options
from .runner import Result, environment, matmul_gflops, run_case

__all__ = ["CONTENDERS", "ROW_SUITES", "SUITES", "Case", "Contender", "Options", "Result", "environment", "grid",
           "matmul_gflops", "run", "run_case"]
