"""``attnkit train induction``: train a small attention-only transformer and watch an induction head form.

Importing this module is cheap (argparse only): torch, rich and matplotlib are imported when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from attnkit._optional import MissingDependencyError, require


def _config(args: argparse.Namespace) -> Any:
    from attnkit.train.induction import InductionConfig, resolve_device

    resolve_device(args.device)  # a clear error before any work
    given = {name: getattr(args, name) for name in ("steps", "seed", "vocab_size", "seq_len", "device")
             if getattr(args, name) is not None}
    given["rope"] = args.positions == "rope"
    return InductionConfig(**given)


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from attnkit.train import report
    from attnkit.train.induction import train_induction

    config = _config(args)  # bad values are errors before anything else
    rich_console = require("rich.console", "attnkit train")
    rich_progress = require("rich.progress", "attnkit train")
    escape = require("rich.markup", "attnkit train").escape
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = rich_console.Console(highlight=False)
    positions = "RoPE" if config.rope else "learned positions"
    console.print(f"[bold]attnkit train induction[/bold]: {config.num_layers} layers x {config.num_heads} heads, "
                  f"d_model {config.d_model}, {positions}, vocab {config.vocab_size}, {config.seq_len} tokens, "
                  f"{config.steps} steps of {config.batch_size} sequences, seed {config.seed}, {config.device}")
    columns = (*rich_progress.Progress.get_default_columns(), rich_progress.TextColumn("{task.fields[stats]}"))
    with rich_progress.Progress(*columns, console=console) as bar:
        task = bar.add_task("training", total=config.steps, stats="")

        def show(step: int, loss: float, best: float) -> None:
            bar.update(task, completed=step, stats=f"step {step} loss {loss:.3f} best induction {best:.2f}")

        run = train_induction(config, progress=show)
    _summary(console, run, report)
    written = [report.write_metrics(run, out)]
    try:
        written += report.write_figures(run, out)
    except MissingDependencyError as err:
        console.print(f"no figures: {escape(str(err))}")  # data, not markup: "[viz]" must stay
    console.print(escape("wrote " + ", ".join(str(p) for p in written)))
    return 0


def _summary(console: Any, run: Any, report: Any) -> None:
    from attnkit.train.induction import STRONG

    final, ablation = run.final, run.ablation
    (layer, head), (p_layer, p_head) = run.induction_head, run.previous_token_head
    formed = f"formed by step {run.formed_at}" if run.formed_at is not None else "did not pass 0.5"
    console.print(f"finished in {run.seconds:.0f} s; layers and heads are counted from 0")
    console.print(f"induction head {report.head_name(layer, head)}: score {final['induction'][layer][head]:.2f} "
                  f"({formed})")
    console.print(f"previous-token head {report.head_name(p_layer, p_head)}: score "
                  f"{final['previous_token'][p_layer][p_head]:.2f}")
    console.print(f"loss on the repeated segment {final['loss_repeat']:.2f}, on unpredictable tokens "
                  f"{final['loss_random']:.2f} nats")
    names = {"induction_head": "the induction head", "previous_token_head": "the previous-token head",
             "induction_heads": "every induction head", "previous_token_heads": "every previous-token head"}
    console.print(f"repeated-segment loss with heads zeroed (a head of a kind scores > {STRONG}): "
                  f"none zeroed {ablation['none']['loss_repeat']:.2f}")
    for key, name in names.items():
        heads = ", ".join(report.head_name(*h) for h in ablation[key]["heads"]) or "none found"
        console.print(f"  {name} ({heads}): {ablation[key]['loss_repeat']:.2f}")

def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``attnkit train`` and its subcommand ``induction`` to the ``attnkit`` parser's subcommands."""
    train = sub.add_parser("train", help="small training runs that show what heads learn",
                           description="Train small models built from attnkit layers and watch their heads.")
    runs = train.add_subparsers(dest="run", required=True, metavar="RUN")
    p = runs.add_parser(
        "induction", help="watch an induction head form in a 2-layer attention-only transformer",
        description="Train a 2-layer attention-only transformer (attnkit.MultiHeadAttention layers) on random "
        "tokens in which a segment reappears at a random offset. Every few steps, on a held-out batch: the loss "
        "on unpredictable tokens and on the repeated segment, and every head's induction and previous-token "
        "scores. Writes metrics.json, training.png (curves), induction_head.png (heatmap) and attention.html "
        "(interactive page) to --out.",
    )
    p.add_argument("--steps", type=int, help="training steps (default 1500)")
    p.add_argument("--seed", type=int, help="seed for the weights and the data (default 0)")
    p.add_argument("--vocab-size", type=int, help="number of token ids, >= 2 (default 32)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, >= 4 (default 32)")
    p.add_argument("--positions", choices=["rope", "learned"], default="rope", help="rotary position embedding "
                   "in each layer (default), or a learned position embedding added to the tokens")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--out", default="train-induction", help="folder for the files (default ./train-induction)")
    p.set_defaults(func=_train)
