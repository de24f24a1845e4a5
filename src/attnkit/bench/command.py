"""What ``attnkit bench`` and ``python -m attnkit.bench`` do: pick the cases, time them, report.

The command line only parses: :func:`add_arguments` defines the options,
:class:`Options` holds them, and :func:`run` does the work, so the same run
can be started from Python::

    from attnkit.bench.command import Options, run
    run(Options(suite="custom", contenders=["attnkit", "raw-sdpa"], seq_lens=[1024]))

Two sorts of suite:

- case suites (:data:`.cases.SUITES` and ``custom``): cases timed side by side
  by :mod:`.runner`, with ratios, targets, a table, JSON, markdown and plots;
- row suites (:data:`ROW_SUITES`): a function that times what it measures
  itself and returns its rows (dicts of any keys), shown as one table and
  written to the same files. Adding one is one entry in :data:`ROW_SUITES`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from attnkit._optional import MissingDependencyError, require

from . import cases as bench_cases
from . import report, runner
from .contenders import CONTENDERS
from .options import DTYPES, Options, add_suite_options, check_device

Row = dict[str, Any]
DESCRIPTION = ("Run benchmark cases: median of --repeats runs after --warmup, min and max, peak extra memory "
               "(each case in a fresh process), GFLOP/s and its share of this machine's measured matmul rate, "
               "and ratios to a baseline. Writes results.json, summary.md and plots to --out.")


# Suites that time themselves: name -> function(options) -> rows. To add one, add an entry,
# importing its module inside the function (it is loaded only when run, which keeps `attnkit`'s
# start-up light: the CLI builds this command's parser on every call), e.g.
#     def _generate(options: Options) -> list[Row]:
#         from .generate import GenerateSuite, run_generate_suite
#         return run_generate_suite(GenerateSuite(repeats=options.repeats))
#     ROW_SUITES["generate"] = _generate
# `--suite` then offers it and `run` reports its rows.
def _generate(options: Options) -> list[Row]:
    from .generate import GenerateSuite, run_generate_suite

    return run_generate_suite(GenerateSuite.from_options(options),
                              log=lambda line: print(line, file=sys.stderr, flush=True))


def _ring(options: Options) -> list[Row]:
    from .ring import memory_slope_rows, run_ring_suite

    if options.seq_lens:
        rows = run_ring_suite(seq_lens=tuple(options.seq_lens), repeats=options.repeats)
    else:
        rows = run_ring_suite(repeats=options.repeats)
    return rows + memory_slope_rows(rows)


def _serve(options: Options) -> list[Row]:
    from .serve import run_serve_suite

    if options.batch:  # the numbers of concurrent clients; a short run: --batch 1 --repeats 2
        return run_serve_suite(options.batch, threads=options.threads, repeats=options.repeats)
    return run_serve_suite(threads=options.threads, repeats=options.repeats)


def _mods(options: Options) -> list[Row]:
    from .mods import ModsSuite, run_mods_suite

    return run_mods_suite(ModsSuite.from_options(options), log=lambda line: print(line, file=sys.stderr, flush=True))


def _streaming(options: Options) -> list[Row]:
    from .streaming import run_streaming_suite

    return run_streaming_suite(options)


ROW_SUITES: dict[str, Callable[[Options], list[Row]]] = {"generate": _generate, "ring": _ring, "serve": _serve,
                                                         "mods": _mods, "streaming": _streaming}
THREADED_SUITES = ("generate", "mods", "serve", "streaming")  # row suites that run at --threads, not the caller's


def _generate_plot(rows: list[Row], out: Path) -> list[Path]:
    from .generate import plot

    return plot(rows, out)


# Row suites that also draw their rows: name -> function(rows, folder) -> files written.
def _serve_plot(rows: list[Row], out: Path) -> list[Path]:
    from .serve import plot

    return plot(rows, out)


ROW_PLOTS: dict[str, Callable[[list[Row], Path], list[Path]]] = {"generate": _generate_plot, "serve": _serve_plot}


def suite_names() -> list[str]:
    """Every name ``--suite`` takes."""
    return [*bench_cases.SUITES, "custom", *ROW_SUITES]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``attnkit bench``, added to ``p``."""
    p.add_argument("--quick", dest="suite", action="store_const", const="quick",
                   help="a small suite: a few minutes on two cores (BENCHMARKS.md)")
    p.add_argument("--suite", choices=suite_names(), default="full",
                   help="full (default), quick, targets (the cases the targets are judged on), padding (causal "
                   "+ key padding beside causal alone), custom (a grid of the lists below), or a row suite")
    add_suite_options(p)
    p.set_defaults(suite="full")  # --quick and --suite share one destination


def check_options(options: Options) -> None:
    """Every option's value, checked before any work; errors name the option and the value."""
    if options.suite not in suite_names():
        raise ValueError(f"unknown suite {options.suite!r}; choose from: {', '.join(suite_names())}")
    if options.repeats < 1 or options.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {options.repeats} and {options.warmup}")
    if not options.max_memory_gib > 0:
        raise ValueError(f"--max-memory-gib must be > 0, got {options.max_memory_gib}")
    if options.dtype not in DTYPES:
        raise ValueError(f"unknown --dtype {options.dtype!r}; choose from: {', '.join(DTYPES)}")
    unknown = [c for c in options.contenders or [] if c not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}; choose from: {', '.join(sorted(CONTENDERS))}")
    bad_modes = [m for m in options.modes or [] if m not in bench_cases.MODES]
    if bad_modes:
        raise ValueError(f"unknown mode(s) {', '.join(bad_modes)}; choose from: {', '.join(bench_cases.MODES)}")
    base = CONTENDERS.get(options.baseline)
    if base is None or base.kind != "layer":
        layers = sorted(n for n, c in CONTENDERS.items() if c.kind == "layer")
        raise ValueError(f"--baseline {options.baseline!r} is not a layer contender; choose from: {', '.join(layers)}")
    check_device(options.device)


def select_cases(options: Options) -> list[bench_cases.Case]:
    """The cases of a case suite, filtered by (or, for custom, built from) the lists in ``options``."""
    if options.suite == "custom":
        cases = bench_cases.grid(options.contenders or ["attnkit", "raw-sdpa"], options.modes or ["inference"],
                                 options.batch or [1], options.seq_lens or [1024])
    else:
        cases = [c for c in bench_cases.SUITES[options.suite]()
                 if (not options.contenders or c.contender in options.contenders)
                 and (not options.modes or c.mode in options.modes)
                 and (not options.batch or c.batch in options.batch)
                 and (not options.seq_lens or c.seq_len in options.seq_lens)]
    if not cases:
        raise ValueError(f"no case of the {options.suite} suite matches these filters")
    return [bench_cases.Case(c.contender, c.mode, c.batch, c.seq_len, dtype=options.dtype, device=options.device)
            for c in cases]


def _console() -> Any:
    rich_console = require("rich.console", "attnkit bench")
    return rich_console.Console(width=None if sys.stdout.isatty() else 120)  # logs get the full table


def _time_cases(cases: Sequence[bench_cases.Case], options: Options, console: Any) -> tuple[list[Row], list[float]]:
    """Every case timed group by group, with a progress bar; the rows and the matmul rate before each group."""
    rich_progress = require("rich.progress", "attnkit bench")
    rates = []  # the matmul rate, sampled before each group: a shared machine's speed drifts
    results = []
    with rich_progress.Progress(*rich_progress.Progress.get_default_columns(), console=console) as progress:
        task = progress.add_task("benchmark", total=len(cases))
        for group in runner.group_cases(cases):
            rates.append(runner.matmul_gflops(options.dtype, options.device))
            first = group[0]
            progress.update(task, description=f"{first.mode} B={first.batch} T={first.seq_len}: "
                            f"{len(group)} contenders")
            results += runner.run_group(group, repeats=options.repeats, warmup=options.warmup,
                                        memory=not options.no_memory, max_bytes=options.max_memory_gib * 2**30)
            progress.advance(task, len(group))
    return [r.to_dict() for r in results], rates


def run(options: Options, console: Any = None) -> list[Path]:
    """Run ``options.suite``, print its report and write it to ``options.out``; returns the files written."""
    check_options(options)
    cases = [] if options.suite in ROW_SUITES else select_cases(options)  # filters checked before any work
    console = _console() if console is None else console
    plain = require("rich.text", "attnkit bench").Text  # paths and messages are data, never markup
    env = runner.environment(options.device, options.dtype)
    if options.suite in THREADED_SUITES:
        env["threads"] = options.threads  # what the suite sets while it runs (torch's count is restored after)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    if options.suite in ROW_SUITES:
        rows = ROW_SUITES[options.suite](options)
        report.print_rows(console, f"suite {options.suite}", rows, env)
        written = report.write_rows(out, f"suite {options.suite}", rows, env)
        if options.suite in ROW_PLOTS:
            try:
                written += ROW_PLOTS[options.suite](rows, out)
            except MissingDependencyError as err:
                console.print(plain(f"no plots: {err}"))
    else:
        rows, rates = _time_cases(cases, options, console)
        env["matmul_samples_gflops"] = [round(r) for r in rates]
        written = _report_cases(rows, max(rates), env, options, console, out)
    console.print(plain("wrote " + ", ".join(str(p) for p in written)))
    return written


def _report_cases(rows: list[Row], matmul: float, env: dict[str, Any], options: Options, console: Any,
                  out: Path) -> list[Path]:
    """Ratios and targets of timed cases: printed, and written as JSON, markdown and plots."""
    plain = require("rich.text", "attnkit bench").Text
    rows = report.with_ratios(rows, options.baseline)
    found = report.targets(rows, matmul)  # the best rate seen: "% of matmul" is then a conservative share
    report.print_report(console, rows, found, env, matmul)
    report.write_json(out / "results.json", rows, found, env, matmul)
    (out / "summary.md").write_text(report.markdown(rows, found, env, matmul))
    written = [out / "results.json", out / "summary.md"]
    try:
        plots = report.plot(rows, out)
        if not plots:
            console.print(plain("no time.png / memory.png: they draw layer and decode rows at B=1 against T, and "
                                "this run has none (its rows are in summary.md)"))
        elif len(plots) == 1:
            console.print(plain("no memory.png: no row drawn in time.png has a peak memory (--no-memory?)"))
        written += plots
    except MissingDependencyError as err:
        console.print(plain(f"no plots: {err}"))
    return written


ERRORS = (ValueError, TypeError, MissingDependencyError, OSError)  # shown as one line, exit code 2


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m attnkit.bench``: the same options as ``attnkit bench``."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(Options.from_namespace(args))
    except ERRORS as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0
