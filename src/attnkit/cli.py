"""The ``attnkit`` command: thin subcommands over library functions.

    attnkit explain [TEXT ...]   multi-head attention step by step
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attnkit._optional import MissingDependencyError, require


def _explain(args: argparse.Namespace) -> int:
    from attnkit.inspect import render, walkthrough

    rich_console = require("rich.console", "attnkit explain")
    text = " ".join(args.text) if args.text else None
    example = walkthrough.book_example() if text is None else walkthrough.text_example(text, seed=args.seed)
    keys = None if args.steps is None else [k.strip() for k in args.steps.split(",") if k.strip()]
    walkthrough.select([], keys)  # reject unknown step names before any work
    d_in = example.embeddings.shape[1]
    mha = walkthrough.build_layer(d_in, args.d_out, args.heads, len(example.tokens),
                                  seed=args.seed, dropout=args.dropout)
    mha.train(args.dropout > 0)
    steps = walkthrough.walkthrough(mha, example, causal=not args.no_causal)

    console = rich_console.Console(highlight=False)
    console.print("[bold]attnkit explain[/bold]: multi-head attention, step by step")
    console.print(f"text:  {' '.join(example.tokens)}  ({len(example.tokens)} tokens)")
    console.print(f"embeddings: {example.source}")
    console.print(f"layer: textbook MultiHeadAttention(d_in={d_in}, d_out={args.d_out}, "
                  f"num_heads={args.heads}), head_dim={mha.head_dim}")
    console.print(f"       {'causal' if not args.no_causal else 'not causal'}, dropout={args.dropout}, "
                  f"weights from torch.manual_seed({args.seed})")
    render.render(console, walkthrough.select(steps, keys), example.tokens)
    if args.json:
        meta = {"text": " ".join(example.tokens), "source": example.source, "d_in": d_in,
                "d_out": args.d_out, "num_heads": args.heads, "head_dim": mha.head_dim,
                "causal": not args.no_causal, "dropout": args.dropout, "seed": args.seed}
        render.write_json(args.json, render.steps_to_json(steps, example.tokens, meta))
        console.print(f"wrote every step's tensors to {args.json}")
    return 0


def _explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="walk through multi-head attention step by step",
        description="Print every step of multi-head attention on a short text: embeddings, "
        "projections, queries/keys/values, scores, mask, weights, dropout, context vectors, "
        "the head split and merge, and the output. With no text, the notebooks' sentence "
        "'Your journey starts with one step' and its six 3-d embeddings.",
    )
    p.add_argument("text", nargs="*", help="your own text: tokens split on whitespace, "
                   "embeddings drawn at random from --seed")
    p.add_argument("--heads", type=int, default=2, help="number of heads (default 2)")
    p.add_argument("--d-out", type=int, default=4, help="output size, split across heads (default 4)")
    p.add_argument("--seed", type=int, default=123, help="seed for the weights (and embeddings of "
                   "your own text) (default 123)")
    p.add_argument("--no-causal", action="store_true", help="let every token see every token")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout on the attention weights, "
                   "in [0, 1); > 0 runs the layer in training mode (default 0)")
    p.add_argument("--steps", help="comma-separated steps to show, from: "
                   "inputs, weights, qkv, split, scores, mask, scaled, softmax, dropout, context, "
                   "merge, output (default: all)")
    p.add_argument("--json", metavar="FILE", help="also write every step's tensors to FILE as JSON")
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
