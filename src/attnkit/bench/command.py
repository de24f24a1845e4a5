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
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from attnkit._optional import MissingDependencyError, require

from . import cases as bench_cases
from .contenders import CONTENDERS

Row = dict[str, Any]
DTYPES = ("float32", "float16", "bfloat16", "float64")
DESCRIPTION = ("Run benchmark cases: median of --repeats runs after --warmup, min and max, peak extra memory "
               "(each case in a fresh process), GFLOP/s and its share of this machine's measured matmul rate, "
               "and ratios to a baseline. Writes results.json, summary.md and plots to --out.")


@dataclass(frozen=True)
class Options:
    """The options of ``attnkit bench``, named as its flags (``--seq-lens`` is ``seq_lens``)."""

    suite: str = "full"
    contenders: list[str] | None = None
    modes: list[str] | None = None
    batch: list[int] | None = None
    seq_lens: list[int] | None = None
    repeats: int = 5
    warmup: int = 1
    no_memory: bool = False
    baseline: str = "attnkit"
    max_memory_gib: float = 8.0
    device: str = "cpu"
    dtype: str = "float32"
    out: str = "bench-out"
    forms: list[str] | None = None
    compiled: list[str] | None = None
    kv_int8: list[str] | None = None
    new_tokens: int = 128
    threads: int = 2
    no_transformers: bool = False
    no_llamacpp: bool = False
    llamacpp_fa: str = "both"
    model: str = "smollm2"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> Options:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


# Suites that time themselves: name -> function(options) -> rows. To add one, add an entry,
# importing its module inside the function (it is loaded only when run), e.g.
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

    return run_serve_suite(threads=options.threads)


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


def _csv(kind: type) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        try:
            items = [kind(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from err
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")
        return items

    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``attnkit bench``, added to ``p``."""
    p.add_argument("--quick", dest="suite", action="store_const", const="quick",
                   help="a small suite that finishes in under two minutes")
    p.add_argument("--suite", choices=suite_names(), default="full",
                   help="full (default), quick, targets (the cases the targets are judged on), padding (causal "
                   "+ key padding beside causal alone), custom (a grid of the lists below), or a row suite")
    p.add_argument("--contenders", type=_csv(str), help="comma-separated contenders (filter, or grid for custom)")
    p.add_argument("--modes", type=_csv(str), help="inference, training, decode")
    p.add_argument("--batch", type=_csv(int), help="batch sizes, e.g. 1,8 (generate: 1 = the batch-1 cases, "
                   "another size = the batched case's prompts; default 1,8)")
    p.add_argument("--seq-lens", "--lengths", type=_csv(int),
                   help="sequence lengths (context lengths for decode; generate: batch-1 prompt lengths, "
                   "default 16,4000,7900; gemma3: 16,2000; mods: L or L,S, its long and short lengths, "
                   "default 8192,2048)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses "
                   "(generate: the load-time and memory processes)")
    p.add_argument("--baseline", default="attnkit", help="layer contender the ratios divide by (default attnkit)")
    p.add_argument("--max-memory-gib", type=float, default=8.0,
                   help="skip cases whose (T, T) scores would need more (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="float32 (default); generate: float32 on the CPU, the activation dtype with --device cuda")
    p.add_argument("--out", default="bench-out", help="folder for results.json, summary.md and plots")
    generate = p.add_argument_group("the generate suite")
    generate.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2",
                          help="the model: smollm2 (default; every case) or gemma3 (batch 1 at 16 and 2000 tokens, "
                          "attnkit float32 and its fastest accurate form, transformers, llama.cpp)")
    generate.add_argument("--forms", type=_csv(str), help="attnkit weight forms, e.g. float32,int4 "
                          "(default: every form this CPU runs; --device cuda: float32 only, the plain weights in "
                          "--dtype)")
    generate.add_argument("--compiled", type=_csv(str), help="weight forms to run also with the compiled "
                          "decoding step (generate(compile=True)), e.g. int4; compiled in the warm-up rounds")
    generate.add_argument("--kv-int8", type=_csv(str), help="weight forms to run also over the int8 KV cache "
                          "(generate(kv_dtype='int8')), e.g. int4; CPU only")
    generate.add_argument("--new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    generate.add_argument("--threads", type=int, default=2, help="threads of every contender (default 2)")
    generate.add_argument("--no-transformers", action="store_true", help="leave transformers out")
    generate.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    generate.add_argument("--llamacpp-fa", choices=["off", "on", "both"], default="both",
                          help="llama.cpp's flash attention: off (llama-cpp-python's default), on, or both as two "
                          "contenders (default)")
    p.set_defaults(suite="full")  # --quick and --suite share one destination


def check_device(device: str) -> None:
    """Raise a one-line ValueError unless torch can put a tensor on ``device``."""
    try:
        where = torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device torch knows ({err})") from err
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch {torch.__version__} sees no CUDA device "
                         "(torch.cuda.is_available() is False); use --device cpu")
    try:
        torch.empty(0, device=where)
    except (RuntimeError, AssertionError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"--device {device} cannot be used: {first}") from err


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
    from . import runner

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
    from . import report, runner

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
    from . import report

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
