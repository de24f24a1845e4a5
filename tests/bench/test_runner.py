"""The benchmark runner, report and command on tiny sizes (nothing here asserts a speed)."""

from __future__ import annotations

import json

import pytest

from attnkit import cli
from attnkit.bench import cases, report, runner
from attnkit.bench.cases import Case


def test_flops_and_estimates():
    case = Case("attnkit", "inference", 2, 128, d_model=64, num_heads=4)
    attention = 4 * 2 * 128 * 128 * 64 / 2
    projections = 2 * 2 * 128 * 64 * 3 * 64 + 2 * 2 * 128 * 64 * 64
    assert runner.flops(case) == projections + attention
    assert runner.flops(Case("attnkit", "training", 2, 128, d_model=64, num_heads=4)) == 3 * (projections + attention)
    assert runner.flops(Case("core-auto", "inference", 2, 128, d_model=64, num_heads=4)) == attention
    assert runner.flops(Case("decode-attnkit-cache", "decode", 1, 128)) is None
    assert runner.estimated_bytes(Case("textbook-mha", "inference", 8, 4096)) == 3 * 8 * 12 * 4096**2 * 4
    assert runner.estimated_bytes(Case("attnkit", "training", 8, 4096)) == 0


def test_estimates_follow_the_mode_that_materialises():
    """nn.MultiheadAttention holds (T, T) scores only on its is_causal fast path in inference."""
    assert runner.estimated_bytes(Case("torch-mha-is-causal", "inference", 1, 4096)) == 3 * 12 * 4096**2 * 4
    assert runner.estimated_bytes(Case("torch-mha-is-causal", "training", 1, 4096)) == 0
    assert runner.estimated_bytes(Case("torch-mha", "inference", 1, 4096)) == 0  # float mask: SDPA's flash kernel
    assert runner.estimated_bytes(Case("torch-mha-weights", "training", 1, 4096)) == 6 * 12 * 4096**2 * 4


def test_plot_styles_tell_every_contender_apart():
    styles = [report._style(name) for name in cases.EVERY_LAYER]
    assert len({(s["color"], s["marker"]) for s in styles}) == len(cases.EVERY_LAYER)
    assert len({s["color"] for s in styles}) == len(cases.EVERY_LAYER)


def test_suites_are_well_formed():
    for build in cases.SUITES.values():
        suite = build()
        assert len(suite) == len(set(suite))
        assert all((c.mode == "decode") == c.contender.startswith("decode-") for c in suite)
    assert len(cases.quick()) <= 20


def test_run_case_times_and_measures_memory_in_a_subprocess():
    result = runner.run_case(Case("attnkit-math", "inference", 1, 1024), repeats=2, warmup=1, memory=True,
                             max_bytes=2**33)
    assert result.status == "ok" and len(result.times_ms) == 2
    # the math backend holds (1, 12, 1024, 1024) float32 weights: 48 MiB
    assert result.peak_mib is not None and result.peak_mib >= 40


def test_skips_are_reported_not_raised():
    big = runner.run_case(Case("textbook-mha", "training", 8, 16384), repeats=1, warmup=0, memory=False,
                          max_bytes=2**30)
    assert big.status == "skipped" and "GiB of scores" in big.reason
    wrong = runner.run_case(Case("decode-attnkit-cache", "inference", 1, 64), repeats=1, warmup=0,
                            memory=False, max_bytes=2**30)
    assert wrong.status == "skipped" and "does not run in mode" in wrong.reason


def test_ratios_and_targets():
    def row(contender, mode, ms, t=1024, peak=None):
        return {"contender": contender, "mode": mode, "batch": 1, "seq_len": t, "median_ms": ms, "status": "ok",
                "peak_mib": peak, "gflops": None}

    rows = report.with_ratios([row("attnkit", "inference", 10.0), row("torch-mha", "inference", 40.0),
                               row("raw-sdpa", "inference", 9.0)])
    assert [r["vs_baseline"] for r in rows] == [1.0, 4.0, 0.9]
    found = {t.name: t for t in report.targets(rows, matmul=100.0)}
    assert found["inference B=1 T=1024: attnkit vs torch-mha"].passed
    assert not found["inference B=1 T=1024: attnkit vs raw-sdpa"].passed  # 11% slower than raw SDPA


def test_bench_command_writes_json_markdown_and_plots(tmp_path, capsys):
    code = cli.main(["bench", "--suite", "custom", "--contenders", "attnkit,raw-sdpa,core-chunked",
                     "--seq-lens", "32,64", "--repeats", "2", "--no-memory", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "inference, B=1" in out and "matmul" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert {r["contender"] for r in doc["results"]} == {"attnkit", "raw-sdpa", "core-chunked"}
    assert all(r["status"] == "ok" and len(r["times_ms"]) == 2 for r in doc["results"])
    assert doc["environment"]["torch"] and doc["matmul_gflops"] > 0
    samples = doc["environment"]["matmul_samples_gflops"]  # one per group (two lengths), the best one used
    assert len(samples) == 2 and round(doc["matmul_gflops"]) == max(samples)
    assert "| contender |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "time.png").read_bytes()[:4] == b"\x89PNG"


def test_suite_selection():
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).suite == "full"
    assert parser.parse_args(["bench", "--quick"]).suite == "quick"
    assert cli._bench_cases(parser.parse_args(["bench", "--quick"])) == cases.quick()
    assert cli._bench_cases(parser.parse_args(["bench", "--suite", "targets"])) == cases.targets()


def test_targets_suite_holds_every_pairing_the_targets_compare():
    suite = set(cases.targets())
    for mode, batch, t in [("inference", 1, 1024), ("inference", 8, 4096), ("training", 8, 1024)]:
        assert {Case("attnkit", mode, batch, t), Case("raw-sdpa", mode, batch, t)} <= suite
    assert {Case("core-auto", "inference", 1, 4096), Case("core-chunked", "training", 1, 16384)} <= suite
    assert {Case("decode-attnkit-cache", "decode", 1, 4096), Case("decode-attnkit-recompute", "decode", 1, 4096),
            Case("decode-hf-gpt2-sdpa-cache", "decode", 1, 4096)} <= suite


@pytest.mark.parametrize(("args", "message"), [
    (["--contenders", "fast"], "unknown contender(s) fast"),
    (["--modes", "eval"], "unknown mode(s) eval"),
    (["--quick", "--seq-lens", "3"], "no case of the quick suite matches"),
    (["--repeats", "0"], "--repeats must be >= 1"),
])
def test_bench_bad_input(capsys, args, message):
    assert cli.main(["bench", "--no-memory", *args]) == 2
    assert message in capsys.readouterr().err
