"""The benchmark runner, report and command on tiny sizes (nothing here asserts a speed)."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys

import pytest
import torch

from attnkit import cli
from attnkit.bench import cases, command, report, runner
from attnkit.bench.cases import Case
from attnkit.bench.contenders import CONTENDERS, Contender


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
    drawn = cases.EVERY_LAYER + cases.DECODERS  # the decode panel sits beside the layer panels
    styles = [report.plot_style(name) for name in drawn]
    assert len({(s["color"], s["marker"]) for s in styles}) == len(drawn)
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
    # the CPU's capability beside its name: numbers from an AVX2 and an AVX512 machine are not comparable
    assert doc["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert re.search(rf"\bcpu_capability +{torch.backends.cpu.get_cpu_capability()}\b", out)  # key, value
    samples = doc["environment"]["matmul_samples_gflops"]  # one per group (two lengths), the best one used
    assert len(samples) == 2 and round(doc["matmul_gflops"]) == max(samples)
    assert "| contender |" in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "time.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "memory.png").exists() and "no memory.png" in out  # --no-memory: nothing to draw


def test_suite_selection():
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).suite == "full"
    assert parser.parse_args(["bench", "--quick"]).suite == "quick"

    def selected(*args):
        return command.select_cases(command.Options.from_namespace(parser.parse_args(["bench", *args])))

    assert selected("--quick") == cases.quick()
    assert selected("--suite", "targets") == cases.targets()
    assert selected("--suite", "padding", "--seq-lens", "1024", "--modes", "training") == [
        Case(c, "training", 1, 1024) for c in cases.PADDED]


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
    (["--baseline", "core-auto"], "--baseline 'core-auto' is not a layer contender"),
])
def test_bench_bad_input(capsys, args, message):
    assert cli.main(["bench", "--no-memory", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture
def my_kernel(monkeypatch):
    """A core contender whose name says nothing of its kind."""
    kernel = Contender("my-kernel", "a kernel", CONTENDERS["core-chunked"].build, kind="core")
    monkeypatch.setitem(CONTENDERS, "my-kernel", kernel)
    return kernel


def test_behaviour_follows_the_contenders_kind_not_its_name(my_kernel):
    """Flops, modes, baselines and plots were keyed on name prefixes ("core-", "decode-", "hf")."""
    case = Case("my-kernel", "inference", 2, 128, d_model=64, num_heads=4)
    assert runner.flops(case) == 4 * 2 * 128 * 128 * 64 / 2  # attention only: no projections
    assert cases.grid(["my-kernel"], ["decode", "inference"], [1], [8]) == [Case("my-kernel", "inference", 1, 8)]
    result = runner.run_case(Case("my-kernel", "inference", 1, 16), repeats=1, warmup=0, memory=False, max_bytes=1)
    assert result.status == "ok" and result.to_dict()["kind"] == "core"
    ratios = report.with_ratios([{**result.to_dict(), "median_ms": 2.0},
                                 {**result.to_dict(), "contender": "core-auto", "median_ms": 1.0}])
    assert ratios[0]["baseline"] == "core-auto" and ratios[0]["vs_baseline"] == 2.0
    decoder = CONTENDERS["decode-hf-gpt2-sdpa-cache"]
    assert decoder.kind == "decode" and decoder.requires == "transformers" and decoder.per_call > 1


def test_unknown_contender_in_a_grid_is_named():
    with pytest.raises(ValueError, match=r"unknown contender\(s\) nope; choose from: attnkit"):
        cases.grid(["attnkit", "nope"], ["inference"], [1], [8])


def test_a_row_suite_is_one_registry_entry(monkeypatch, tmp_path, capsys):
    """Suites that time themselves (generate, ring) plug in with one entry of ROW_SUITES."""
    seen = []

    def fake(options):
        seen.append(options)
        return [{"name": "[red]step", "tokens_per_s": 12.5}, {"name": "b", "tokens_per_s": None, "extra": [1, 2]}]

    monkeypatch.setitem(command.ROW_SUITES, "fake", fake)
    assert cli.main(["bench", "--suite", "fake", "--dtype", "float64", "--out", str(tmp_path)]) == 0
    assert seen[0].dtype == "float64"
    out = capsys.readouterr().out
    assert "[red]step" in out and "12.5" in out and "extra" in out
    doc = json.loads((tmp_path / "results.json").read_text())
    assert doc["suite"] == "suite fake" and doc["results"][1]["extra"] == [1, 2]
    assert "| name | tokens_per_s | extra |" in (tmp_path / "summary.md").read_text()


def test_python_dash_m_attnkit_bench_does_not_import_the_cli():
    """bench/__main__ imported attnkit.cli: the one import that ran up the layers."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "attnkit.bench", "--help"],
                          capture_output=True, text=True, check=True)
    assert "--suite" in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "attnkit.bench.command" in imported and "attnkit.cli" not in imported


@pytest.fixture
def figures(monkeypatch):
    """Every figure report.plot makes, kept for the test to look at."""
    from attnkit.inspect import plot as plot_module

    made = []
    make = plot_module.new_figure

    def keep(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(plot_module, "new_figure", keep)
    return made


def _bars(ax):  # type: ignore[no-untyped-def]
    """The horizontal bars of ``ax`` as {contender: (width, label)}, read back through matplotlib's objects."""
    (container,) = ax.containers
    names = [t.get_text() for t in ax.get_yticklabels()]
    labels = [t.get_text() for t in ax.texts]  # bar_label's annotations, one per bar in order
    return {name: (bar.get_width(), label) for name, bar, label in zip(names, container.patches, labels, strict=True)}


def test_a_series_of_one_length_is_drawn_as_labelled_bars(tmp_path, figures):
    """`bench --quick` wrote time.png and memory.png with empty axes (one-point series skipped), then one dot per
    contender on a log axis: now a horizontal bar per contender on a linear axis, each labelled with its value."""
    rows = [{"mode": "inference", "batch": 1, "seq_len": 512, "contender": name, "median_ms": 1.5 + i,
             "peak_mib": 3.0 + i} for i, name in enumerate(["attnkit", "raw-sdpa"])]
    written = report.plot(rows, tmp_path)
    assert [p.name for p in written] == ["time.png", "memory.png"] and all(p.stat().st_size for p in written)
    for figure, unit, values in zip(figures, ["ms", "MiB"], [(1.5, 2.5), (3.0, 4.0)], strict=True):
        inference, training = figure.axes
        assert _bars(inference) == {"attnkit": (values[0], f"{values[0]:.3g} {unit}"),
                                    "raw-sdpa": (values[1], f"{values[1]:.3g} {unit}")}
        assert inference.get_xscale() == "linear" and not inference.lines
        assert "T = 512" in inference.get_title()
        assert not training.patches and "no training rows" in training.texts[0].get_text()


def test_a_contender_without_a_value_keeps_a_labelled_bar(tmp_path, figures):
    """A skipped contender and a 0 MiB peak were dropped from the quick plot without a word: each now has its
    place, an empty bar, and a label saying why."""
    def row(name, status="ok", ms=1.0, mib=2.0, reason=""):  # type: ignore[no-untyped-def]
        return {"mode": "decode", "batch": 1, "seq_len": 1024, "contender": name, "kind": "decode", "status": status,
                "reason": reason, "median_ms": ms, "peak_mib": mib}

    rows = [row("decode-attnkit-cache", ms=0.25, mib=0.0), row("decode-attnkit-recompute", ms=9.0, mib=12.0),
            row("decode-hf-gpt2-sdpa-cache", "skipped", None, None, "needs transformers: pip install 'attnkit[hf]'")]
    report.plot(rows, tmp_path)
    time_bars, memory_bars = (_bars(figure.axes[0]) for figure in figures)
    assert time_bars == {"decode-attnkit-cache": (0.25, "0.25 ms"), "decode-attnkit-recompute": (9.0, "9 ms"),
                         "decode-hf-gpt2-sdpa-cache": (0.0, "skipped: needs transformers: pip install 'attnkit[hf]'")}
    assert memory_bars["decode-attnkit-cache"] == (0.0, "0 MiB: no growth of the resident set")
    assert memory_bars["decode-attnkit-recompute"] == (12.0, "12 MiB")
    assert memory_bars["decode-hf-gpt2-sdpa-cache"][1].startswith("skipped: needs transformers")


def test_a_run_with_no_layer_rows_writes_no_empty_plot(tmp_path, figures):
    """The committed keymask run (decode rows only) had an empty time.png: its decode rows are now drawn."""
    rows = [{"mode": "decode", "batch": 1, "seq_len": t, "contender": name, "median_ms": 0.5 + i + t / 1e4,
             "peak_mib": None, "kind": "decode"}
            for i, name in enumerate(["decode-attnkit-cache", "decode-attnkit-cache-keymask"]) for t in (512, 4096)]
    written = report.plot(rows, tmp_path)
    assert [p.name for p in written] == ["time.png"]  # no memory measured: no memory.png
    (decode,) = figures[0].axes
    assert decode.get_title() == "decode, B=1" and "queries" not in decode.get_xlabel()
    assert sorted(line.get_label() for line in decode.lines) == ["decode-attnkit-cache",
                                                                 "decode-attnkit-cache-keymask"]
    assert all(list(line.get_xdata()) == [512, 4096] for line in decode.lines)


def test_a_run_with_nothing_to_draw_writes_no_plot(tmp_path):
    """Kernel-alone (core) rows and B=8 rows have no panel: no empty picture is written."""
    rows = [{"mode": "inference", "batch": 1, "seq_len": 512, "contender": "core-auto", "median_ms": 0.7,
             "kind": "core"},
            {"mode": "inference", "batch": 8, "seq_len": 512, "contender": "attnkit", "median_ms": 0.9}]
    assert report.plot(rows, tmp_path) == [] and not list(tmp_path.iterdir())


def test_the_environment_is_a_table_of_key_and_value(monkeypatch, tmp_path):
    """The generate suite's env row (16 keys) was one table of 16 columns squeezed into 120 (`mod…`, `dev…`);
    the bench's environment one comma-joined line. Both are now two columns, key and value, in the terminal and in
    summary.md."""
    import io

    from rich.console import Console

    env_row = {"kind": "env", "model": "smollm2", "device": "cpu", "dtype": "float32", "default_form": "int4",
               "threads": 2, "torch": torch.__version__, "cpu": "AMD EPYC 9R14 96-Core Processor",
               "cpu_capability": "AVX512", "forms": "float32,bfloat16,float16,int8,int4,int4-gptq",
               "new_tokens": 128, "repeats": 5, "transformers": "5.24.0", "llama_cpp": "0.3.16 (b1234)",
               "cpu_count": 2, "load_average_start": 1.25, "extra": [1, 2]}
    monkeypatch.setitem(command.ROW_SUITES, "fake", lambda options: [env_row, {"kind": "batch 1", "tokens_per_s": 1}])
    console = Console(file=io.StringIO(), width=120)
    command.run(command.Options(suite="fake", out=str(tmp_path)), console=console)
    lines = console.file.getvalue().splitlines()
    assert "…" not in console.file.getvalue()
    def values(key: str) -> list[str]:
        return [line.split(None, 1)[1].strip() for line in lines if line.split()[:1] == [key]]

    for key, value in [("load_average_start", "1.25"), ("extra", "1, 2"), ("python", platform.python_version()),
                       ("forms", env_row["forms"]), ("model", "smollm2")]:
        assert values(key) == [value]
    capability = torch.backends.cpu.get_cpu_capability()
    assert values("cpu_capability") == [capability, "AVX512"]  # one table each: the bench's, then the suite's
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| key | value |") == 2 and "| cpu_capability | AVX512 |" in summary
    assert "| model | device |" not in summary and "| load_average_start | 1.25 |" in summary
    assert "| tokens_per_s |" in summary  # the other rows keep their columns


def test_a_case_suites_environment_is_a_table_of_key_and_value():
    env = {"device": "cpu", "dtype": "float32", "cpu_capability": "AVX2", "matmul_samples_gflops": [140, 157]}
    text = report.markdown([], [], env, 157.4)
    assert text.startswith("**environment**\n\n| key | value |\n|---|---|\n| device | cpu |")
    assert "| cpu_capability | AVX2 |" in text and "| matmul_samples_gflops | 140, 157 |" in text
    assert "| matmul (best sample) | 157 GFLOP/s |" in text


def test_columns_every_row_shares_with_the_environment_are_said_once():
    """The serve suite's rows repeat threads, cpu and cpu_capability: columns the environment table already gives,
    which squeezed the rest (`thre…`, `cpu_…`); a column whose value differs in some row stays."""
    env = {"threads": 1, "cpu": "AMD EPYC", "cpu_capability": "AVX512"}
    rows = [{"kind": "serve", **env, "clients": n, "tokens_per_s": 10.0 * n} for n in (1, 4)]
    assert "| clients | tokens_per_s |" in report.rows_markdown("suite serve", rows, env)
    rows[1]["threads"] = 2
    assert "| threads | clients | tokens_per_s |" in report.rows_markdown("suite serve", rows, env)
