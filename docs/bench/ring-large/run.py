"""The ring suite at longer sequences, one repeat: forward up to T = 65536, forward+backward at 16384 (zigzag).

    python docs/bench/ring-large/run.py   # about 40 minutes on a 2-core machine

Writes summary.txt and results.json next to this script.
"""

import json
import pathlib

from attnkit.bench.ring import format_table, memory_slope_rows, run_ring_suite

if __name__ == "__main__":
    here = pathlib.Path(__file__).parent
    rows = run_ring_suite(seq_lens=(16384, 32768, 65536), modes=("forward",), layouts=("zigzag",), repeats=1)
    rows += run_ring_suite(seq_lens=(16384,), modes=("forward+backward",), layouts=("zigzag",), repeats=1)
    (here / "summary.txt").write_text(format_table(rows) + "\n")
    (here / "results.json").write_text(json.dumps(rows + memory_slope_rows(rows), indent=1) + "\n")
    print(format_table(rows))
