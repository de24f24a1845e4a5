"""``attnkit train induction``: train a small attention-only transformer and watch an induction head form.

Importing this module is cheap (argparse only): torch, rich and matplotlib are imported when the command runs.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from attnkit._optional import MissingDependencyError, require
from attnkit._outputs import check_output_dir

MAX_GIB = 8.0  # the most memory the estimate of one evaluation (see _check_memory) may reach


def _config(args: argparse.Namespace) -> Any:
    from attnkit.train.induction import InductionConfig, resolve_device

    resolve_device(args.device)  # a clear error before any work
    given = {name: getattr(args, name) for name in ("steps", "seed", "vocab_size", "seq_len", "device")
             if getattr(args, name) is not None}
    given["rope"] = args.positions == "rope"
    config = InductionConfig(**given)
    _check_memory(config)
    return config


def _check_memory(config: Any) -> None:
    """Refuse sizes whose evaluation batch cannot be held, before allocating anything.

    The largest tensors of a run are those of one evaluation, in float32: the logits (B, T, V), with about two
    copies more in the loss, and every layer's attention scores and weights (L x (B, H, T, T)).
    """
    b, t, v = config.eval_batch_size, config.seq_len, config.vocab_size
    gib = 4 * b * (3 * t * v + 2 * config.num_layers * config.num_heads * t * t) / 2**30
    if gib > MAX_GIB:
        raise ValueError(f"--vocab-size {v} with --seq-len {t} needs about {gib:.1f} GiB for one evaluation "
                         f"batch of {b} sequences (logits and attention weights in float32), more than the "
                         f"{MAX_GIB:.0f} GiB this command allows: lower --vocab-size or --seq-len")


@contextmanager
def _stop_on_ctrl_c() -> Iterator[Callable[[], bool]]:
    """Inside the block, Ctrl-C asks training to stop after the current step (a second Ctrl-C interrupts at once).

    Yields the ``should_stop`` question for :func:`train_induction`. Outside the main thread (where signal
    handlers cannot be set) Ctrl-C keeps its usual meaning.
    """
    asked: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return

    def ask(signum: int, frame: Any) -> None:
        if asked:
            raise KeyboardInterrupt
        asked.append(True)

    before = signal.signal(signal.SIGINT, ask)
    try:
        yield lambda: bool(asked)
    finally:
        signal.signal(signal.SIGINT, before)


def _train(args: argparse.Namespace) -> int:
    from attnkit.train import report

    config = _config(args)  # bad values are errors before anything else
    out = check_output_dir(args.out, "--out")
    rich_console = require("rich.console", "attnkit train")
    rich_progress = require("rich.progress", "attnkit train")
    escape = require("rich.markup", "attnkit train").escape
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

        with _stop_on_ctrl_c() as should_stop:
            run = _run(config, show, should_stop)
    if run.stopped_at is not None:
        console.print(f"stopped by Ctrl-C after step {run.stopped_at} of {config.steps}: saving what was done")
    _summary(console, run, report)
    written = [report.write_metrics(run, out)]
    try:
        written += report.write_figures(run, out)
    except MissingDependencyError as err:
        console.print(f"no figures: {escape(str(err))}")  # data, not markup: "[viz]" must stay
    console.print(escape("wrote " + ", ".join(str(p) for p in written)))
    return 0 if run.stopped_at is None else 130


def _run(config: Any, show: Callable[[int, float, float], None], should_stop: Callable[[], bool]) -> Any:
    """:func:`train_induction`, with running out of memory reported as one line (a ValueError)."""
    from attnkit.train.induction import train_induction

    try:
        return train_induction(config, progress=show, should_stop=should_stop)
    except (MemoryError, RuntimeError) as err:
        if isinstance(err, RuntimeError) and "alloc" not in str(err) and "out of memory" not in str(err):
            raise
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"out of memory with --vocab-size {config.vocab_size} and --seq-len {config.seq_len} "
                         f"({first}): lower them") from err


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
        "(interactive page) to --out. Ctrl-C stops training after the current step and still writes the "
        "files of the steps done (exit code 130); a second Ctrl-C quits at once.",
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
