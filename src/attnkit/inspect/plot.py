"""Heatmaps of attention weights with matplotlib (extra ``viz``, imported on first use).

- :func:`plot_heads`: one panel per head, query tokens down, key tokens
  across, one colour bar;
- :func:`plot_model_view`: a grid of small heatmaps, layers x heads;
- :func:`plot_side_by_side`: a few whole-text heatmaps in a row (long texts:
  no token labels), optionally on a log scale where exactly 0 shows white.

Figures are built with matplotlib's object API on the Agg canvas: no pyplot
state, no display needed. ``fig.savefig(path)`` writes them. Tokens, titles
and names are data: a ``$`` in them is shown as written, never read as
matplotlib's math text.

Legend: L layers, H heads, T queries, S keys.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch import Tensor

from attnkit._optional import require

FEATURE = "attnkit's heatmaps"


def _png(figure: Any) -> bytes:
    """The figure as PNG bytes: what a notebook shows for it (``_repr_png_``)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def new_figure(width: float, height: float) -> Any:
    """A Figure attached to an Agg canvas (so savefig works without pyplot), shown as an image in notebooks.

    Without pyplot, Jupyter knows no way to draw the figure and shows only
    ``<Figure size ...>``; the instance's ``_repr_png_`` gives it one.
    """
    figure = require("matplotlib.figure", FEATURE).Figure(figsize=(width, height), layout="constrained")
    require("matplotlib.backends.backend_agg", FEATURE).FigureCanvasAgg(figure)
    figure._repr_png_ = functools.partial(_png, figure)
    return figure


def _check_weights(weights: Tensor, rank: int, what: str) -> Tensor:
    if not isinstance(weights, Tensor) or weights.dim() != rank:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"{what} must be a {rank}-d tensor, got {shape}")
    return weights.detach().float().cpu()


def _plain(text: str) -> str:
    """``text`` as matplotlib shows it literally: an unescaped ``$`` would start math text."""
    return str(text).replace("$", r"\$")


def _check_tokens(tokens: Sequence[str], size: int, what: str) -> list[str]:
    tokens = list(tokens)
    if len(tokens) != size:
        raise ValueError(f"{len(tokens)} {what} tokens for a weights axis of size {size}")
    return [_plain(t) for t in tokens]


def plot_heads(weights: Tensor, tokens: Sequence[str], key_tokens: Sequence[str] | None = None, *,
               title: str | None = None, columns: int = 4) -> Any:
    """One heatmap per head of ``weights`` (H, T, S), tokens on both axes, one colour bar.

    ``key_tokens`` default to ``tokens`` (self-attention). Returns the Figure.
    """
    w = _check_weights(weights, 3, "weights (H, T, S)")
    heads, t, s = w.shape
    queries = _check_tokens(tokens, t, "query")
    keys = _check_tokens(key_tokens if key_tokens is not None else tokens, s, "key")
    cols = min(columns, heads)
    rows = -(-heads // cols)
    cell = max(2.2, 0.28 * max(t, s))
    fig = new_figure(cell * cols + 1.2, cell * rows + (0.5 if title else 0))
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(w[h].numpy(), cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(s), keys, rotation=90, fontsize=7)
        ax.set_yticks(range(t), queries, fontsize=7)
        if h // cols == rows - 1 or h + cols >= heads:  # the bottom heatmap of each column
            ax.set_xlabel("keys", fontsize=8)
        if h % cols == 0:
            ax.set_ylabel("queries", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    if title:
        fig.suptitle(_plain(title), wrap=True)  # wrapped to the figure's width: a long title is never cut
    return fig


def plot_model_view(weights: Tensor, tokens: Sequence[str], *, title: str | None = None,
                    layer_names: Sequence[str] | None = None) -> Any:
    """A layers x heads grid of small heatmaps from ``weights`` (L, H, T, S). Returns the Figure."""
    w = _check_weights(weights, 4, "weights (L, H, T, S)")
    layers, heads, t, _ = w.shape
    _check_tokens(tokens, t, "query")
    names = [_plain(n) for n in layer_names] if layer_names is not None else [f"layer {i}" for i in range(layers)]
    if len(names) != layers:
        raise ValueError(f"{len(names)} layer names for {layers} layers")
    fig = new_figure(1.1 * heads + 1.5, 1.1 * layers + (0.6 if title else 0.3))
    axes = fig.subplots(layers, heads, squeeze=False)
    image = None
    for (layer, head), ax in zip(((i, j) for i in range(layers) for j in range(heads)), axes.flat, strict=True):
        image = ax.imshow(w[layer, head].numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_xticks([])
        ax.set_yticks([])
        if layer == 0:
            ax.set_title(f"head {head}", fontsize=8)
        if head == 0:
            ax.set_ylabel(names[layer], fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.supxlabel("each heatmap: queries down, keys across", fontsize=8)
    if title:
        fig.suptitle(_plain(title), wrap=True)  # wrapped to the figure's width: a long title is never cut
    return fig


LOG_FLOOR = 1e-4  # the log colour scale starts here; weights below are its darkest colour, exact zeros white


def plot_side_by_side(weights: Tensor, names: Sequence[str], *, title: str | None = None, log: bool = False,
                      size: float = 3.2) -> Any:
    """Heatmaps of ``weights`` (N, T, S) in a row, ``size`` inches each, titled by ``names``; no token labels.

    For whole texts of hundreds of tokens, e.g. two layers' weights averaged
    over their heads. ``log``: colours by the weight's logarithm from
    :data:`LOG_FLOOR` to 1, and a weight of exactly 0 (a key the query cannot
    see) in white, so a window's edge shows however little weight lies near it.
    """
    w = _check_weights(weights, 3, "weights (N, T, S)")
    count = w.shape[0]
    labels = [_plain(n) for n in names]
    if len(labels) != count:
        raise ValueError(f"{len(labels)} names for {count} heatmaps")
    colors = require("matplotlib.colors", FEATURE)
    cmap = require("matplotlib", FEATURE).colormaps["viridis"].with_extremes(bad="white")
    norm = colors.LogNorm(vmin=LOG_FLOOR, vmax=1.0, clip=True) if log else colors.Normalize(vmin=0.0, vmax=1.0)
    fig = new_figure(size * count + 1.2, size + (0.9 if title else 0.5))
    axes = fig.subplots(1, count, squeeze=False)
    image = None
    for panel, (ax, label) in enumerate(zip(axes.flat, labels, strict=True)):
        data = w[panel].numpy()
        shown = np.ma.masked_equal(data, 0.0) if log else data  # exact zeros: the "bad" colour
        image = ax.imshow(shown, cmap=cmap, norm=norm, interpolation="nearest")
        ax.set_title(label, fontsize=9, wrap=True)
        ax.set_xlabel("keys (position)", fontsize=8)
        if panel == 0:
            ax.set_ylabel("queries (position)", fontsize=8)
        ax.tick_params(labelsize=7)
    scale = " (log scale; white: exactly 0)" if log else ""
    fig.colorbar(image, ax=axes, shrink=0.8, label=f"attention weight{scale}")
    if title:
        fig.suptitle(_plain(title), wrap=True)
    return fig
