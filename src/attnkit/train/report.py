"""What a finished induction run writes: metrics.json, training curves, a heatmap and the interactive page.

matplotlib (extra ``viz``) is imported on first use, through :mod:`attnkit.inspect.plot`.

Legend: L layers, H heads, T positions.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .induction import InductionRun

CURVES = "training.png"
HEATMAP = "induction_head.png"
PAGE = "attention.html"
METRICS = "metrics.json"


def head_name(layer: int, head: int) -> str:
    """'L1H3': layer 1, head 3, both counted from 0 (as in metrics.json and the figures)."""
    return f"L{layer}H{head}"


def run_to_json(run: InductionRun) -> dict[str, Any]:
    """Everything in ``run`` but the model and the tensors, as JSON-ready values."""
    (layer, head), (p_layer, p_head) = run.induction_head, run.previous_token_head
    return {"config": asdict(run.config), "final": run.final,
            "induction_head": {"layer": layer, "head": head, "score": run.final["induction"][layer][head]},
            "previous_token_head": {"layer": p_layer, "head": p_head,
                                    "score": run.final["previous_token"][p_layer][p_head]},
            "ablation": run.ablation, "formed_at": run.formed_at, "stopped_at": run.stopped_at,
            "seconds": round(run.seconds, 2),
            "torch": torch.__version__, "history": run.history}


def write_metrics(run: InductionRun, out: Path) -> Path:
    """``metrics.json``: the config, final metrics, heads found, ablation and every evaluation."""
    path = out / METRICS
    path.write_text(json.dumps(run_to_json(run), indent=1) + "\n", encoding="utf-8")
    return path


def plot_training(run: InductionRun) -> Any:
    """Three panels over training: the two losses, every head's induction score, every previous-token score.

    A dotted vertical line marks the step where an induction score first passed 0.5. Returns the Figure.
    """
    from attnkit.inspect.plot import new_figure

    steps = [h["step"] for h in run.history]
    fig = new_figure(13.0, 3.8)
    loss_ax, ind_ax, prev_ax = fig.subplots(1, 3)
    loss_ax.plot(steps, [h["loss_random"] for h in run.history], label="unpredictable tokens", color="0.5")
    loss_ax.plot(steps, [h["loss_repeat"] for h in run.history], label="repeated segment", color="C3")
    loss_ax.set(title="loss (held-out batch)", xlabel="step", ylabel="cross-entropy (nats)", ylim=(0, None))
    loss_ax.legend(fontsize=8)
    layers, heads = len(run.final["induction"]), len(run.final["induction"][0])
    for ax, key, title, found in ((ind_ax, "induction", "induction score", run.induction_head),
                                  (prev_ax, "previous_token", "previous-token score", run.previous_token_head)):
        for layer in range(layers):
            for head in range(heads):
                chosen = (layer, head) == found
                ax.plot(steps, [h[key][layer][head] for h in run.history], color=f"C{head}",
                        linestyle="-" if layer == layers - 1 else "--", linewidth=2.4 if chosen else 1.0,
                        label=head_name(layer, head) + (" (found)" if chosen else ""))
        ax.set(title=f"{title} per head", xlabel="step", ylim=(0, 1))
        ax.legend(fontsize=7, ncol=2)
    for ax in (loss_ax, ind_ax, prev_ax):
        if run.formed_at is not None:
            ax.axvline(run.formed_at, color="k", linestyle=":", linewidth=1)
    c = run.config
    positions = "RoPE" if c.rope else "learned positions"
    steps_done = "" if run.stopped_at is None else f", stopped at step {run.stopped_at} of {c.steps}"
    fig.suptitle(f"{layers}-layer attention-only transformer, {heads} heads, d_model {c.d_model}, {positions}, vocab "
                 f"{c.vocab_size}, {c.seq_len} tokens, seed {c.seed}{steps_done}: induction head "
                 f"{head_name(*run.induction_head)}"
                 + (f" formed by step {run.formed_at}" if run.formed_at is not None else " did not form"),
                 fontsize=10)
    return fig


@torch.no_grad()
def sample_weights(run: InductionRun) -> tuple[list[str], list[torch.Tensor]]:
    """The held-out sequence with the longest repeat: its tokens (the repeat primed) and each layer's (H, T, T)."""
    batch = run.eval_batch
    index = int(batch.length.argmax())
    run.model.eval()
    _, weights = run.model(batch.tokens[index:index + 1], need_weights=True)  # L x (1, H, T, T)
    repeat = batch.repeat_positions()[index].tolist()
    tokens = [f"{t}'" if r else str(t) for t, r in zip(batch.tokens[index].tolist(), repeat, strict=True)]
    return tokens, [w[0] for w in weights]


def write_figures(run: InductionRun, out: Path) -> list[Path]:
    """The training curves, the induction head's heatmap on a test sequence, and the interactive page."""
    from attnkit.inspect.html import write_html
    from attnkit.inspect.plot import plot_heads

    written = []
    tokens, weights = sample_weights(run)
    layer, head = run.induction_head
    pages = [(f"layer {i}", w) for i, w in enumerate(weights)]
    subtitle = (f"induction head {head_name(*run.induction_head)}, previous-token head "
                f"{head_name(*run.previous_token_head)}; primed tokens repeat an earlier segment")
    written.append(write_html(out / PAGE, tokens, pages, title="attnkit train induction", subtitle=subtitle))
    figure = plot_training(run)
    figure.savefig(out / CURVES, dpi=100)
    written.append(out / CURVES)
    heat = plot_heads(weights[layer][head:head + 1], tokens, title=f"induction head {head_name(layer, head)} on a "
                      "held-out sequence (primed tokens: the repeat)")
    heat.savefig(out / HEATMAP, dpi=80)
    written.append(out / HEATMAP)
    return written
