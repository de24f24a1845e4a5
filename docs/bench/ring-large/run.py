import json
from attnkit.bench.ring import run_ring_suite, memory_slope_rows, format_table
if __name__ == "__main__":
    rows = run_ring_suite(seq_lens=(16384, 32768), modes=("forward",), layouts=("zigzag",), repeats=1)
    print(format_table(rows))
    json.dump(rows + memory_slope_rows(rows), open("/tmp/ring_big.json", "w"), indent=1)
