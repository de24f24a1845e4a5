"""The ring benchmark's arithmetic (slopes, imbalance) and one tiny real run of the suite."""

from __future__ import annotations

import json
import math

import pytest
import torch

from attnkit.bench import ring
from attnkit.bench.ring import memory_slope_rows, memory_slopes, run_ring_suite, summarise


def _row(p: int, mib: float, t: int = 4096) -> dict:
    return dict(T=t, P=p, mode="forward", layout="zigzag", peak_mib_per_rank=mib)


def test_memory_slope_is_the_log_log_fit_against_p():
    rows = [_row(p, 600 / p) for p in (1, 2, 4)] + [_row(p, 100.0, t=8192) for p in (1, 2, 4)]
    slopes = memory_slopes(rows)
    assert slopes[(4096, "forward", "zigzag")] == pytest.approx(-1.0)  # exactly 1/P
    assert slopes[(8192, "forward", "zigzag")] == pytest.approx(0.0)  # no fall at all
    uneven = memory_slopes([_row(1, 100.0), _row(4, 50.0)])[(4096, "forward", "zigzag")]
    assert uneven == pytest.approx(math.log(0.5) / math.log(4))
    assert [r["slope"] for r in memory_slope_rows(rows)] == [-1.0, 0.0]


def test_summary_takes_the_largest_rank_and_the_compute_imbalance():
    per_rank = [dict(T=64, P=2, mode="forward", layout="contiguous", rank=r, time_s=t, compute_s=c, wait_s=w,
                     peak_mib=m) for r, t, c, w, m in ((0, 1.0, 0.5, 0.5, 10.0), (1, 1.2, 1.5, 0.0, 12.0))]
    (row,) = summarise(per_rank)
    assert row["time_ms"] == pytest.approx(1200) and row["peak_mib_per_rank"] == 12.0
    assert row["compute_ms"] == [500.0, 1500.0] and row["wait_ms"] == [500.0, 0.0]
    assert row["imbalance"] == pytest.approx(1.5)  # max / mean of 0.5 and 1.5


def test_a_tiny_ring_suite_runs_every_case_in_real_processes():
    rows = run_ring_suite(seq_lens=(16,), world_sizes=(1, 2), d_model=16, heads=2, repeats=1, timeout_s=120)
    cases = {(r["P"], r["mode"], r["layout"]) for r in rows}
    assert cases == {(p, m, lay) for p in (1, 2) for m in ("forward", "forward+backward")
                     for lay in ("zigzag", "contiguous")}
    for row in rows:
        assert len(row["compute_ms"]) == len(row["wait_ms"]) == row["P"]
        assert row["imbalance"] >= 1.0 and row["time_ms"] > 0


def test_ring_rows_record_the_cpu_capability(tmp_path, monkeypatch, capsys):
    """python -m attnkit.bench.ring printed and wrote neither the CPU's name nor its capability."""
    row = dict(_row(1, 10.0), time_ms=5.0, compute_ms=[4.9], wait_ms=[0.0], imbalance=1.0)
    monkeypatch.setattr(ring, "run_ring_suite", lambda **kwargs: [row])
    assert ring.main(["--json", str(tmp_path / "rows.json")]) == 0
    capability = torch.backends.cpu.get_cpu_capability()
    (written,) = json.loads((tmp_path / "rows.json").read_text())
    assert written["cpu_capability"] == capability and written["cpu"]
    lines = capsys.readouterr().out.splitlines()
    assert f"cpu_capability  {capability}" in lines  # the environment as two columns, key and value
